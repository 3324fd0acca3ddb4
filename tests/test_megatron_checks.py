"""Issue 23, cases 1 and 2, on real megatron-core (gloo, 2 processes).

1. fp16 from Megatron-LM's initial loss scale (2**32), a forward overflow that persists from step 3, while
   the scale is still coming down: the skip whose loss is non-finite is the incident, at once (not where
   the scale collapses), run again in place there.
2. Megatron-LM's NaN-loss check (``validate_result(rejection_func=torch.isnan, fatal=True)`` in its
   loss_func) in every rerun mode: gradnan records the rejected loss, keeps its micro-batch and, where
   every rank of the model-parallel group raised together, reruns the step's forward pass, BEFORE
   Megatron's own RuntimeError reaches the user unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradnan.offline.analysis import analyze
from gradnan.offline.read import read_run
from gradnan.offline.replay import replay_bundle
from gradnan.offline.report import build_report, format_text
from gradnan.testing.toy import Injection, TinyGPTJob, launch_many

from .helpers import records_by_rank

pytestmark = pytest.mark.slow  # real gloo jobs: `pytest -m "not slow"` skips them

FC1 = "decoder.layers.0.mlp.linear_fc1"
CORE = "decoder.layers.1.self_attention.core_attention"
BASE = TinyGPTJob(world_size=2, steps=3, quiet=True)

SCENARIOS = {
    # linear_fc1's weight on tensor-parallel rank 1 scaled to just under fp16's limit from step 3: its
    # output overflows in every forward pass from there, while the scale (from 2**32) is still warming up
    "fp16_warmup_forward_overflow": BASE.with_(tp=2, dtype="fp16", initial_loss_scale=2.0 ** 32, steps=5,
                                               injections=(Injection(1, 3, f"{FC1}.weight", "6e4",
                                                                     where="scale_to"),)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_checks")
    launch_many([job.with_(gradnan={"out_dir": str(root / name)}) for name, job in SCENARIOS.items()])
    return {name: root / name for name in SCENARIOS}


def _headline(analysis) -> str:
    return "\n".join(format_text(analysis).splitlines()[:6])


def test_an_fp16_skip_with_a_nonfinite_loss_is_an_incident_during_the_warm_up(runs):
    run_dir = runs["fp16_warmup_forward_overflow"]
    by_rank = records_by_rank(run_dir)
    for records in by_rank.values():
        overflows = {r["step"]: r for r in records if r["kind"] == "loss_scale_overflow"}
        # steps 1 and 2: the scale coming down, a finite loss: routine
        assert [(overflows[s]["warmup"], overflows[s]["loss_finite"]) for s in (1, 2)] == [(True, True)] * 2
        assert (overflows[3]["warmup"], overflows[3]["loss_finite"]) == (False, False)
    [rerun] = [r for r in by_rank[1] if r["kind"] == "rerun"]
    assert (rerun["step"], rerun["trigger"], rerun["role"], rerun["module"], rerun["conclusion"]) == (
        3, "loss_scale_overflow", "origin", FC1, "reproducible")
    analysis = analyze(read_run(run_dir))
    headline = _headline(analysis)
    assert headline.splitlines()[1].startswith("First failing step: 3"), headline
    assert f"Forward origin (step 3 run again in place): {FC1}" in headline, headline
    assert "on rank 1 (tp1 pp0 dp0)" in headline and "REPRODUCIBLE" in headline, headline
    report = build_report(read_run(run_dir))
    assert report["first_step"] == 3 and report["incident"]["step"] == 3
    found = report["incident"]["rerun"]
    assert (found["module"], found["global_rank"], found["conclusion"]) == (FC1, 1, "reproducible")
    assert found["batch"] and found["bundle"]
    manifest = json.loads((Path(found["bundle"]) / "manifest.json").read_text())
    assert manifest["step"] == 3
    assert replay_bundle(found["bundle"])["verdict"] != "healthy"
