"""Issue 26, hardware, without processes: a record's ``device_health`` read as untrusted input, weighed by
the analysis (signs of a device fault, or none) and printed beside the device to drain."""

from __future__ import annotations

import copy

import pytest

from gradnan.errors import InputError
from gradnan.formats.health import health_signs
from gradnan.formats.records import from_json
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.report import format_text

from .test_next_steps import _rerun
from .test_report_unit import _files, _record

HEALTHY = {"source": "nvml", "device": {"index": 1, "name": "H100", "uuid": "GPU-1"},
           "values": {"temperature_c": 61, "power_w": 250.5, "throttle_reasons": ["sw_power_cap"],
                      "ecc_volatile_uncorrected": 0, "ecc_aggregate_corrected": 3,
                      "remapped_rows_pending": False, "xid_errors": []},
           "unread": {"retired_pages_pending": "NVMLError_NoPermission: Insufficient Permissions"}}


def _incident_records(health):
    """A transient fault on rank 9 (node00272): its pre-reduction record carries ``health``."""
    own = _record(2, "pre_reduction", 9, ["decoder.layers.0.mlp.linear_fc1.weight"], device_health=health)
    own["rank"].update(host="node00272", device="cuda:1")
    return [own, _rerun(9, "transient", "node00272", own="loss"), _rerun(1, "after_collective", "node00001")]


@pytest.mark.parametrize("broken", [
    {"values": {"temperature_c": "hot"}},  # text where a number goes
    {"values": {"temperature_c": float("nan")}},
    {"values": {"ecc": {"nested": 1}}},
    {"values": {"xid_errors": [79, None]}},
    {"unread": {"power_w": 3}},
    {"device": {"index": True}},
    {"device": "GPU-1"},
    {"source": None},
])
def test_a_malformed_reading_makes_the_record_a_problem_line(broken):
    health = {**copy.deepcopy(HEALTHY), **broken}
    with pytest.raises(InputError, match="device_health"):
        from_json(_record(2, "nonfinite_grad_norm", device_health=health), "f:1")
    kept = from_json(_record(2, "nonfinite_grad_norm", device_health=HEALTHY), "f:1")
    assert kept["device_health"] == HEALTHY


def test_a_reading_without_signs_is_evidence_of_none_and_is_printed_beside_the_drain():
    analysis = analyze(_files(*_incident_records(HEALTHY)))
    incident = analysis.incident
    assert incident.verdict.cause.value == "device"
    assert [reading.signs for reading in incident.health] == [()]
    assert incident.verdict.evidence[-1] == (
        "NVML at the incident on node00272 cuda:1 (rank 9): no XID error, uncorrected ECC error, retired or"
        " remapped memory or hardware throttling (in what it could read; 1 value(s) not read)")
    text = format_text(analysis)
    drain = text.split("Next:\n")[1].split("  2. ")[0]
    assert " ".join(drain.split()) == (
        "1. drain node00272 cuda:1 (rank 9): take its node out of the job before restarting NVML at the"
        " incident (rank 9): 61 C; 250.5 W; throttle: sw_power_cap; ECC volatile uncorrected 0, aggregate"
        " corrected 3; remapped rows pending False; XID: none; not read: retired_pages_pending"
        " (NVMLError_NoPermission: Insufficient Permissions)")
    assert analysis.to_json()["incident"]["next"][0]["health"][0]["global_rank"] == 9


def test_signs_are_read_from_the_values_whatever_else_a_file_holds():
    health = copy.deepcopy(HEALTHY)
    health["values"].update(xid_errors=[48, 79], ecc_volatile_uncorrected=True, remapped_rows_failed=True,
                            throttle_reasons=7)  # a boolean count and a number for a list: no sign of them
    incident = analyze(_files(*_incident_records(health))).incident
    assert incident.health[0].signs == ("XID error(s) 48, 79", "a row remapping failed")
    assert "throttle: none" in format_text(analyze(_files(*_incident_records(health))))


def test_only_the_origin_devices_readings_count():
    records = _incident_records(None)
    records[0].pop("device_health")
    bystander = _record(2, "nonfinite_grad_norm", 1, device_health=HEALTHY)
    bystander["rank"].update(host="node00001", device="cuda:1")  # where its rerun record puts it
    analysis = analyze(_files(*records + [bystander]))
    assert analysis.incident.health == () and "NVML" not in format_text(analysis)



def test_a_hostile_xid_list_is_printed_bounded_in_the_evidence():
    """Issue 51: NVML lists were capped under Next: but printed whole in Evidence (6,603 lines)."""
    signs = health_signs({"xid_errors": list(range(100_000)), "throttle_reasons": ["hw_slowdown"] * 50})
    assert signs[0] == "XID error(s) 0, 1, 2, 3, 4, 5, 6, 7 and 99992 more"
    assert len(signs[1]) < 200
