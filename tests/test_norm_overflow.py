"""Issue 23, case 3: a grad norm that overflows from FINITE gradients (exploding gradients). One gradient
element of 1e30 on one rank, real megatron-core over gloo: the log, the rerun record, the report headline
and ``--json`` say the grad norm overflowed although every gradient is finite, and name the rank, the
parameter, the element and the value; with Megatron's ``check_for_nan_in_grad`` its bucket check finds Inf
and raises, after gradnan's pre-reduction record is on disk."""

from __future__ import annotations

import json

import pytest

from gradnan.cli import main as cli_main
from gradnan.decision.replica import conclusion_of
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch, launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

from .helpers import records_by_rank

pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

STEP = 2
WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
ELEMENT = 5
HUGE = float("1e30")
JOBS = {
    "dp2": TinyGPTJob(world_size=2, dtype="fp32", quiet=True),
    "tp2": TinyGPTJob(world_size=2, tp=2, dtype="bf16", quiet=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("norm_overflow")
    jobs = [job.with_(gradnan={"out_dir": str(root / name)},
                      injections=(Injection(1, STEP, WEIGHT, "1e30", where="backward", index=ELEMENT),))
            for name, job in JOBS.items()]
    launch_many(jobs)
    return {name: root / name for name in JOBS}


def _json_report(run_dir, capsys):
    capsys.readouterr()
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dp2_names_the_replica_that_produced_it_before_the_collective(runs, capsys):
    report = analyze(read_run(runs["dp2"]))
    incident = report.incident
    assert incident.step == STEP and incident.origin_basis.value == "norm_overflow"
    assert [entry["global_rank"] for entry in incident.origin] == [1]
    [origin] = incident.origin
    assert origin["kind"] == "pre_reduction"
    largest = origin["largest_grad"]
    assert (largest["name"], largest["flat"]) == (WEIGHT, ELEMENT)
    assert largest["value"] == pytest.approx(HUGE, rel=1e-6)  # before the collective, not the average
    assert [view["global_rank"] for view in incident.receivers] == [0]
    assert incident.verdict.cause.value == "norm_overflow"
    summary = incident.verdict.summary
    assert summary.startswith("exploding gradients: the grad norm overflowed although every gradient is"
                              " finite")
    assert "rank 1 (tp0 pp0 dp1, " in summary and "rank 0" not in summary
    assert f"{WEIGHT}[0, {ELEMENT}] = 1e+30" in summary and "before the data-parallel collective" in summary
    assert incident.rerun.conclusion.value == "norm_overflow"
    text = format_text(report)
    assert "Verdict: norm_overflow: exploding gradients" in text and "none found" not in text
    assert "from another replica" not in text
    document = _json_report(runs["dp2"], capsys)
    assert document["incident"]["verdict"]["summary"] == summary
    assert document["incident"]["origin"][0]["largest_grad"]["name"] == WEIGHT
    assert document["incident"]["rerun"]["conclusion"] == "norm_overflow"


def test_dp2_records_say_it_on_every_rank(runs):
    records = records_by_rank(runs["dp2"])
    for rank in (0, 1):
        norm = next(r for r in records[rank] if r["kind"] == "nonfinite_grad_norm")
        assert norm["params"] == [] and norm["largest_grad"]["overflows"] is True
        assert norm["pre_reduction"] == ("overflow" if rank == 1 else "clean")
        rerun = next(r for r in records[rank] if r["kind"] == "rerun")
        assert conclusion_of(rerun) == "norm_overflow"
    assert [r["rank"]["global_rank"] for rank in (0, 1) for r in records[rank]
            if r["kind"] == "pre_reduction"] == [1]


def test_tp2_names_the_tensor_parallel_rank_holding_it(runs):
    report = analyze(read_run(runs["tp2"]))
    incident = report.incident
    assert [entry["global_rank"] for entry in incident.origin] == [1]
    [origin] = incident.origin
    assert (origin["largest_grad"]["name"], origin["largest_grad"]["flat"]) == (WEIGHT, ELEMENT)
    assert origin["largest_grad"]["value"] == pytest.approx(HUGE, rel=1e-2)  # bf16
    assert "rank 1 (tp1" in incident.verdict.summary
    assert incident.verdict.cause.value == "norm_overflow"
    assert incident.rerun.conclusion.value == "norm_overflow"


def test_megatron_bucket_check_finds_inf_after_our_pre_reduction_record_is_on_disk(tmp_path):
    job = JOBS["dp2"].with_(check_for_nan_in_grad=True, gradnan={"out_dir": str(tmp_path)},
                            injections=(Injection(1, STEP, WEIGHT, "1e30", where="backward", index=ELEMENT),))
    with pytest.raises(JobFailed) as failure:
        launch(job)
    assert "found Inf in local grad norm" in failure.value.errors["job0_rank1"]
    [pre] = [r for r in records_by_rank(tmp_path)[1] if r["kind"] == "pre_reduction"]
    assert pre["mode"] == "sync" and pre["norm_overflow"] is True and pre["params"] == []
    assert (pre["largest_grad"]["name"], pre["largest_grad"]["flat"]) == (WEIGHT, ELEMENT)
    assert pre["largest_grad"]["value"] == pytest.approx(HUGE, rel=1e-6)
    incident = analyze(read_run(tmp_path)).incident
    assert incident.step == STEP and [entry["global_rank"] for entry in incident.origin] == [1]
    assert incident.verdict.summary.startswith("exploding gradients")
