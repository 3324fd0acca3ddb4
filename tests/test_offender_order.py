"""Records cap their offending parameters at ``max_params_per_record``: the cap keeps the first to go bad in
backward, so the origin survives even when it is the last of many in the optimizer's order (real
megatron-core, one gloo process, seven layers: a NaN in the gradient of the last layer's fc2 bias, the last
parameter the optimizer lists, and one in the output gradient of layer 5's MLP, from where everything back to
the embeddings goes bad: more offenders than the cap, yet not nearly all parameters)."""

from __future__ import annotations

import pytest

from gradnan.formats.maps import load as load_map
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.toy import launch
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

STEP = 2
ORIGIN = "decoder.layers.6.mlp.linear_fc2.bias"
UPSTREAM = "decoder.layers.5.mlp"
CAP = 64


@pytest.fixture(scope="module")
def many_offenders(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("offenders")
    launch(TinyGPTJob(world_size=1, num_layers=7, hidden_size=16, num_heads=2, quiet=True,
                      injections=(Injection(0, STEP, ORIGIN, "nan", where="backward"),
                                  Injection(0, STEP, UPSTREAM, "nan", where="module_backward")),
                      gradnan={"out_dir": str(run_dir), "max_params_per_record": CAP,
                               "pre_reduction": "off"}))  # the report reads the capped norm record only
    [record] = [r for r in records_by_rank(run_dir)[0]
                if r["kind"] == "nonfinite_grad_norm" and r["step"] == STEP]
    return run_dir, record


def test_the_origin_is_the_last_of_more_than_the_cap_in_optimizer_order(many_offenders):
    run_dir, record = many_offenders
    [map_file] = sorted((run_dir / "maps").glob("*.json"))
    entries = {entry["name"]: entry for entry in load_map(map_file)["params"]}
    assert record["params_total"] > CAP and len(record["params"]) == CAP
    later = [name for name, entry in entries.items() if entry["id"] > entries[ORIGIN]["id"]]
    assert later and all(name.startswith("decoder.final_layernorm.")
                         for name in later), "clean, after the origin"
    assert record["params"][0]["name"] == ORIGIN
    assert all(p["name"].startswith(("decoder.layers.", "embedding.")) for p in record["params"])


def test_the_report_and_its_rerun_settings_name_the_origin(many_offenders):
    run_dir, record = many_offenders
    report = build_report(read_run(run_dir))
    assert report["incident"]["pattern"]["first_in_backward"] == record["params"][0]["name"]
    assert report["rerun_capture"]["GRADNAN_CAPTURE_MODULES"] == "decoder.layers.6.mlp.linear_fc2"
    orders = [p["order"] for p in record["params"]]
    assert orders == sorted(orders, reverse=True)
