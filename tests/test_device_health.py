"""Issue 26, hardware: NVML's reading of the origin's device at the incident, in its records, the verdict's
evidence and beside the device to drain. Two real jobs with the same transient fault on rank 1 (a
hardware verdict): one without NVML (as on this machine, and in CI), one where a stand-in ``pynvml``
(this machine has no GPU: the only stand-in these tests use) reports known values on a device per rank,
and refuses some of them, as NVML does."""

from __future__ import annotations

import os
import sys
import types

import pytest

from gradnan.formats.health import health_line
from gradnan.formats.text import printable
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank

pytestmark = pytest.mark.slow

CORE = "decoder.layers.1.self_attention.core_attention"
TRANSIENT = TinyGPTJob(world_size=2, steps=3, micro_batches=2, quiet=True, dtype="bf16", injections=(
    Injection(1, 2, CORE, "inf", where="forward", transient=True),))

NOT_SUPPORTED, NO_PERMISSION, TIMEOUT = 3, 4, 10
# what the stand-in reports on the device of rank r (index r); unread: power (not supported on this
# board) and the pending page retirements (no permission)
EXPECTED = {"temperature_c": 83, "sm_clock_mhz": 1410, "mem_clock_mhz": 1593,
            "throttle_reasons": ["sw_power_cap", "hw_slowdown"],
            "ecc_volatile_corrected": 0, "ecc_volatile_uncorrected": 2, "ecc_aggregate_corrected": 12,
            "ecc_aggregate_uncorrected": 5, "retired_pages_single_bit": 0, "retired_pages_double_bit": 1,
            "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 1, "remapped_rows_pending": True,
            "remapped_rows_failed": False, "xid_errors": [79]}


def stand_in_nvml(job, rank):
    """A ``pynvml`` with two devices; this process runs on device ``rank``, one XID 79 is queued there."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

        def __str__(self):
            return {NOT_SUPPORTED: "Not Supported", NO_PERMISSION: "Insufficient Permissions",
                    TIMEOUT: "Timeout"}[self.value]

    def refuse(code):
        def call(*args):
            raise NVMLError(code)
        return call

    queued = [types.SimpleNamespace(eventType=0x8, eventData=79)]

    def wait(event_set, timeout_ms):
        if not queued:
            raise NVMLError(TIMEOUT)
        return queued.pop()

    # (error type: 0 corrected, 1 uncorrected; counter type: 0 volatile, 1 aggregate)
    ecc = {(0, 0): 0, (1, 0): 2, (0, 1): 12, (1, 1): 5}
    nvml.__dict__.update(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [types.SimpleNamespace(pid=os.getpid())]
        if handle == rank else [],
        nvmlDeviceGetName=lambda handle: "Stand-in H100", nvmlDeviceGetUUID=lambda handle: f"GPU-{handle}",
        nvmlDeviceGetTemperature=lambda handle, sensor: 83, nvmlDeviceGetPowerUsage=refuse(NOT_SUPPORTED),
        nvmlDeviceGetClockInfo=lambda handle, clock: {1: 1410, 2: 1593}[clock],
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: 0x4 | 0x8,
        nvmlDeviceGetTotalEccErrors=lambda handle, error, counter: ecc[(error, counter)],
        nvmlDeviceGetRetiredPages=lambda handle, cause: [0x1000] if cause == 1 else [],
        nvmlDeviceGetRetiredPagesPendingStatus=refuse(NO_PERMISSION),
        nvmlDeviceGetRemappedRows=lambda handle: (0, 1, 1, 0),
        nvmlEventSetCreate=lambda: object(), nvmlDeviceRegisterEvents=lambda handle, types_, events: None,
        nvmlEventSetWait=wait)
    sys.modules["pynvml"] = nvml


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two jobs in one set of processes, their stderr (the ranks' log) kept in ``log``."""
    root = tmp_path_factory.mktemp("health")
    saved = os.dup(2)
    with open(root / "log", "wb") as log:
        os.dup2(log.fileno(), 2)
        try:  # the job without NVML first: the stand-in stays in its processes' sys.modules after it
            launch_many([TRANSIENT.with_(gradnan={"out_dir": str(root / "absent")}),
                         TRANSIENT.with_(gradnan={"out_dir": str(root / "stand_in")},
                                         prepare=f"{__name__}:stand_in_nvml")])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return root


def test_without_nvml_the_log_says_so_once_per_node_at_the_incident(runs):
    lines = [line for line in (runs / "log").read_text().splitlines() if "device health" in line]
    assert lines == ["[gradnan rank 0] INFO device health not read at this incident (pynvml is not"
                     " importable: pip install nvidia-ml-py): the records carry no 'device_health'"]


def test_without_nvml_no_record_carries_a_health_field(runs):
    by_rank = records_by_rank(runs / "absent")
    assert by_rank and all("device_health" not in record
                           for records in by_rank.values() for record in records)
    analysis = analyze(read_run(runs / "absent"))
    assert analysis.incident.verdict.cause.value == "device"
    assert analysis.incident.health == ()
    assert analysis.to_json()["incident"]["next"][0]["health"] == []
    assert "NVML" not in format_text(analysis)


def test_the_stand_in_reading_is_in_each_incident_record_of_the_origin(runs):
    by_rank = records_by_rank(runs / "stand_in")
    incident = [record for record in by_rank[1] if record["kind"] in ("pre_reduction", "nonfinite_grad_norm")
                and record["step"] == 2]
    assert incident and all(record["device_health"] == incident[0]["device_health"] for record in incident)
    health = incident[0]["device_health"]
    assert health["source"] == "nvml"
    assert health["device"] == {"index": 1, "name": "Stand-in H100", "uuid": "GPU-1"}
    assert health["values"] == EXPECTED
    assert health["unread"] == {"power_w": "NVMLError: Not Supported",
                                "retired_pages_pending": "NVMLError: Insufficient Permissions"}
    received = next(record for record in by_rank[0] if record["kind"] == "nonfinite_grad_norm")
    assert received["device_health"]["device"]["index"] == 0  # each rank reads its own device
    assert all("device_health" not in record for records in by_rank.values() for record in records
               if record["kind"] == "rerun")  # only incident records carry it


def test_the_report_prints_the_reading_beside_the_device_to_drain_and_weighs_its_signs(runs):
    analysis = analyze(read_run(runs / "stand_in"))
    incident = analysis.incident
    assert incident.verdict.cause.value == "device"
    drain = incident.next_steps[0]
    assert drain.action.value == "drain" and [reading.rank["global_rank"] for reading in drain.health] == [1]
    reading = drain.health[0]
    assert reading.signs == ("XID error(s) 79", "2 uncorrected ECC error(s) since the driver loaded",
                             "5 uncorrected ECC error(s) in the device's lifetime",
                             "1 page(s) retired for double-bit ECC errors",
                             "1 memory row(s) remapped for uncorrectable errors",
                             "a row remapping pending (it takes effect at the device's next reset)",
                             "clocks throttled by the hardware (hw_slowdown)")
    evidence = [line for line in incident.verdict.evidence if line.startswith("NVML at the incident")]
    assert len(evidence) == 1 and evidence[0].endswith("signs of a device fault") and "XID error(s) 79" in \
        evidence[0]
    document = analysis.to_json()["incident"]
    assert document["next"][0]["health"][0]["values"] == EXPECTED
    assert document["health"] == document["next"][0]["health"]
    text = format_text(analysis)
    section = " ".join(text.split("Next:\n")[1].split("Evidence:")[0].split())
    reading_text = printable(f"NVML at the incident (rank 1): {health_line(EXPECTED, reading.unread)}")
    line = " ".join(reading_text.split())
    assert section.index(line) < section.index("gradnan selftest"), text
    assert "83 C" in line and "XID: 79" in line and "power_w (NVMLError: Not Supported)" in line
