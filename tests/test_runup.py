"""The run-up on real megatron-core (DP=2, gloo): a gradient that grows over several steps on one
data-parallel rank before going Inf is reported as grown, first on that rank; a sudden NaN as not grown;
with the overlapped reduction (several bucket groups) and the distributed optimizer; ``runup_steps=0``
writes none; a ring shorter than the run keeps the last steps; training stays bitwise identical."""

from __future__ import annotations

import pytest

from gradnan.formats.layout import RUNUP_DIR
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report, format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import step_trace

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
FAILING = 10
JOB = TinyGPTJob(world_size=2, steps=FAILING, quiet=True)
GROWING = tuple(Injection(1, step, WEIGHT, value, where="backward", index=5)
                for step, value in zip(range(6, FAILING), ("10", "1e3", "1e5", "1e7"))) + (
    Injection(1, FAILING, WEIGHT, "inf", where="backward", index=5),)
SUDDEN = (Injection(1, FAILING, WEIGHT, "nan", where="backward", index=5),)
SEVERAL_GROUPS = {"overlap_grad_reduce": True, "bucket_size": 6000}

SCENARIOS = {
    "grew": (JOB, GROWING, {}),
    "grew_overlap": (JOB.with_(**SEVERAL_GROUPS), GROWING, {}),
    "grew_distributed_optimizer": (JOB.with_(distributed_optimizer=True), GROWING, {}),
    "grew_overlap_distributed_optimizer": (JOB.with_(distributed_optimizer=True, **SEVERAL_GROUPS),
                                           GROWING, {}),
    "sudden": (JOB, SUDDEN, {}),
    "sudden_overlap_distributed_optimizer": (JOB.with_(distributed_optimizer=True, **SEVERAL_GROUPS),
                                             SUDDEN, {}),
    "ring_of_8": (JOB, GROWING, {"runup_steps": 8}),
    "off": (JOB, GROWING, {"runup_steps": 0}),
    # fp16: one routine skip (step 2) writes no run-up; skips that become an incident (the third in a row)
    "fp16_routine_skip": (JOB.with_(dtype="fp16", steps=4),
                          (Injection(1, 2, WEIGHT, "inf", where="backward", index=5),), {}),
    "fp16_skips_escalate": (JOB.with_(dtype="fp16", steps=12), tuple(
        Injection(1, step, WEIGHT, "inf", where="backward", index=5) for step in (9, 10, 11)), {}),
}
GREW = [name for name in SCENARIOS if name.startswith("grew")]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("runup")
    jobs = [job.with_(injections=injections, gradnan={"out_dir": str(root / name), **options})
            for name, (job, injections, options) in SCENARIOS.items()]
    jobs.append(JOB.with_(injections=GROWING))  # without the kit: the training it must not change
    results = launch_many(jobs)
    return {name: (root / name, results[i]) for i, name in enumerate(SCENARIOS)}, results[-1]


def _report(run_dir):
    files = read_run(run_dir)
    assert not files.problems, files.problems
    return files, build_report(files)


@pytest.mark.parametrize("name", GREW)
def test_a_gradient_that_grew_on_one_rank_is_reported_as_grown_there_first(outcomes, name):
    run_dir, _ = outcomes[0][name]
    files, report = _report(run_dir)
    runup = report["incident"]["runup"]
    assert report["incident"]["step"] == FAILING
    assert runup["finding"] == "grew"
    assert runup["parameter"] == WEIGHT
    assert runup["first_ranks"] == [1]
    assert runup["onset_step"] == 6 and runup["steps_before"] == 4
    by_rank = {rank["global_rank"]: rank for rank in runup["ranks"]}
    assert by_rank[0]["grew"] is False and by_rank[1]["grew"] is True
    assert by_rank[1]["values"][-4:] == [1e3, 1e5, 1e7, "inf"]  # the planted values, before the collective
    assert by_rank[1]["steps"] == list(range(1, FAILING + 1))
    text = format_text(analyze(files))
    assert f"Run-up: the gradients of {WEIGHT}'s bucket grew before the failing step" in text
    assert "first on rank 1 (tp0 pp0 dp1), 4 step(s) before it" in text


@pytest.mark.parametrize("name", GREW)
def test_the_culprit_bucket_named_is_the_one_holding_the_parameter(outcomes, name):
    run_dir, _ = outcomes[0][name]
    files, report = _report(run_dir)
    rank = next(r for r in report["incident"]["runup"]["ranks"] if r["global_rank"] == 1)
    (path, document), = [(p, d) for p, d in files.runups.items() if d["rank"]["global_rank"] == 1]
    group = next(g for g in document["groups"] if g["bucket_group"] == rank["bucket_group"])
    bucket = next(b for b in group["buckets"] if b["bucket"] == rank["bucket"])
    assert WEIGHT in bucket["params"]
    if "overlap" in name:
        assert len(document["groups"]) > 1  # several bucket groups: the right one was picked
    else:
        assert len(document["groups"]) == 1
    records = [r for r in files.all_records() if r["rank"]["global_rank"] == 1 and r["step"] == FAILING]
    assert {r.get("runup") for r in records if r["kind"] == "nonfinite_grad_norm"} == {str(path)}


@pytest.mark.parametrize("name", ["sudden", "sudden_overlap_distributed_optimizer"])
def test_a_sudden_nan_is_reported_as_not_grown(outcomes, name):
    run_dir, _ = outcomes[0][name]
    _, report = _report(run_dir)
    runup = report["incident"]["runup"]
    assert runup["finding"] == "sudden"
    assert runup["first_ranks"] == [] and runup["onset_step"] is None
    assert {rank["global_rank"] for rank in runup["ranks"]} == {0, 1}
    assert all(rank["grew"] is False for rank in runup["ranks"])


def test_a_ring_shorter_than_the_run_keeps_the_last_steps_and_still_decides(outcomes):
    run_dir, _ = outcomes[0]["ring_of_8"]
    _, report = _report(run_dir)
    runup = report["incident"]["runup"]
    assert all(rank["steps"] == list(range(FAILING - 7, FAILING + 1)) for rank in runup["ranks"])
    assert runup["finding"] == "grew" and runup["first_ranks"] == [1]


def test_runup_steps_zero_writes_no_runup(outcomes):
    run_dir, _ = outcomes[0]["off"]
    _, report = _report(run_dir)
    assert not (run_dir / RUNUP_DIR).exists()
    assert report["incident"]["runup"] is None


@pytest.mark.parametrize("name", ["grew", "ring_of_8"])
def test_training_is_bitwise_identical_with_the_runup_kept(outcomes, name):
    (_, with_kit), without = outcomes[0][name], outcomes[1]
    assert step_trace(with_kit) == step_trace(without)
    assert len(step_trace(without)[0]) == FAILING


def _overflow_records(run_dir):
    files, _ = _report(run_dir)
    return [r for r in files.all_records() if r["kind"] == "loss_scale_overflow"], files


def test_a_routine_fp16_skip_writes_no_runup(outcomes):
    run_dir, _ = outcomes[0]["fp16_routine_skip"]
    overflows, _ = _overflow_records(run_dir)
    assert {r["step"] for r in overflows} == {2}
    assert all(r["runup"] is None for r in overflows)
    assert not (run_dir / RUNUP_DIR).exists()


def test_fp16_skips_that_become_an_incident_write_the_runup_once(outcomes):
    run_dir, _ = outcomes[0]["fp16_skips_escalate"]
    overflows, files = _overflow_records(run_dir)
    assert {r["step"]: r["consecutive_skips"] for r in overflows} == {9: 1, 10: 2, 11: 3}
    assert {(r["step"], r["runup"] is not None) for r in overflows} == {(9, False), (10, False), (11, True)}
    assert sorted(doc["step"] for doc in files.runups.values()) == [11, 11]  # one per rank


def test_the_report_of_an_fp16_skip_run_reads_its_runup_up_to_where_the_run_began(outcomes):
    """The report starts from step 9 (the run of skips), the run-up was written at 11 (the incident)."""
    run_dir, _ = outcomes[0]["fp16_skips_escalate"]
    _, report = _report(run_dir)
    assert report["first_step"] == 9
    runup = report["incident"]["runup"]
    assert runup["finding"] == "sudden"  # an Inf planted at once: no growth before it
    assert all(rank["steps"] == list(range(1, 10)) for rank in runup["ranks"])
