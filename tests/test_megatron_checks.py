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

import importlib
import json
from pathlib import Path

import pytest

from gradnan.decision.replica import conclusion_of
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report, format_text
from gradnan.offline.replay.command import replay_bundle
from gradnan.testing.toy import launch, launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

from .helpers import read_board, records_by_rank, rerun_block

# real gloo jobs: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

# megatron-core before 0.13 computes the loss inside forward_step: no rejection is known to be a loss there
SCHEDULES = importlib.import_module("megatron.core.pipeline_parallel.schedules")
needs_loss_computation = pytest.mark.skipif(
    not hasattr(SCHEDULES, "forward_step_calc_loss"),
    reason="megatron-core before 0.13 has no forward_step_calc_loss: a rejected loss is not seen as one")

FC1 = "decoder.layers.0.mlp.linear_fc1"
CORE = "decoder.layers.1.self_attention.core_attention"
FIRST_STAGE_CORE = "decoder.layers.0.self_attention.core_attention"
BASE = TinyGPTJob(world_size=2, steps=3, quiet=True)
LOSS_MESSAGE = "found NaN in local forward loss calculation"  # the toy loss_func says it as Megatron-LM
# a NaN out of layer 1's attention on rank 1 at step 2 (tensor-parallel rank 1 with TP=2): the loss is NaN
NAN_ON_RANK_1 = (Injection(1, 2, CORE, "nan", where="forward"),)
# both replicas' loss functions, at step 2's micro-batch 1: a finite report, a NaN loss for backward
LOSS_AFTER_REPORT = tuple(Injection(rank, 2, "", where="loss_after_report", index=1) for rank in (0, 1))

SCENARIOS = {
    # linear_fc1's weight on tensor-parallel rank 1 scaled to just under fp16's limit from step 3: its
    # output overflows in every forward pass from there, while the scale (from 2**32) is still warming up
    "fp16_warmup_forward_overflow": BASE.with_(tp=2, dtype="fp16", initial_loss_scale=2.0 ** 32, steps=5,
                                               injections=(Injection(1, 3, f"{FC1}.weight", "6e4",
                                                                     where="scale_to"),)),
    # Megatron does not validate iteration 1 in validate_results mode: the NaN loss reaches the grad norm
    "validate_results_iteration_1": BASE.with_(dtype="bf16", rerun_mode="validate_results",
                                               injections=(Injection(1, 1, CORE, "nan", where="forward"),)),
    "validate_results_iteration_2": BASE.with_(dtype="bf16", rerun_mode="validate_results",
                                               injections=NAN_ON_RANK_1),
    # issue 48 (case 4): micro-batch 1's loss function reports a finite value and hands backward a NaN
    "validate_results_loss_after_report": BASE.with_(dtype="bf16", rerun_mode="validate_results",
                                                     micro_batches=2, injections=LOSS_AFTER_REPORT),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_checks")
    launch_many([job.with_(gradnan={"out_dir": str(root / name)}) for name, job in SCENARIOS.items()])
    return {name: root / name for name in SCENARIOS}


def _headline(analysis) -> str:
    """The first two lines, then the rerun's."""
    text = format_text(analysis)
    return "\n".join(text.splitlines()[:2] + rerun_block(text))


def test_an_fp16_skip_with_a_nonfinite_loss_is_an_incident_during_the_warm_up(runs):
    run_dir = runs["fp16_warmup_forward_overflow"]
    by_rank = records_by_rank(run_dir)
    for records in by_rank.values():
        overflows = {r["step"]: r for r in records if r["kind"] == "loss_scale_overflow"}
        # steps 1 and 2: the scale coming down, a finite loss: routine
        assert [(overflows[s]["warmup"], overflows[s]["loss_finite"]) for s in (1, 2)] == [(True, True)] * 2
        assert (overflows[3]["warmup"], overflows[3]["loss_finite"]) == (False, False)
    [rerun] = [r for r in by_rank[1] if r["kind"] == "rerun"]
    assert (rerun["step"], rerun["trigger"], rerun["role"], rerun["module"], conclusion_of(rerun)) == (
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


def _raised(job: TinyGPTJob, run_dir: Path) -> JobFailed:
    """Launch a job that must fail; Megatron's own exception, as each rank raised it."""
    with pytest.raises(JobFailed) as failure:
        launch(job.with_(gradnan={"out_dir": str(run_dir)}))
    return failure.value


def _losses(run_dir: Path):
    return {rank: [r for r in records if r["kind"] == "nonfinite_loss"]
            for rank, records in records_by_rank(run_dir).items()}


@needs_loss_computation
def test_megatrons_loss_check_in_disabled_mode_is_recorded_rerun_and_kept_before_it_raises(tmp_path):
    """PP=1, TP=2: the loss is the same on both tensor-parallel ranks, both raise at once and run the
    step's forward pass again together before Megatron's RuntimeError goes on."""
    with pytest.raises(JobFailed) as raised:
        launch(BASE.with_(tp=2, dtype="bf16", rerun_mode="disabled", injections=NAN_ON_RANK_1,
                          gradnan={"out_dir": str(tmp_path), "tensorboard_dir": str(tmp_path / "board")}))
    failure = raised.value
    assert set(failure.errors) == {"job0_rank0", "job0_rank1"}
    assert all(error.startswith("RuntimeError: ") and LOSS_MESSAGE in error
               for error in failure.errors.values()), failure.errors
    losses = _losses(tmp_path)
    for rank in (0, 1):
        [record] = losses[rank]
        assert (record["step"], record["micro_batch"], record["loss"], record["message"]) == (
            2, 0, "nan", LOSS_MESSAGE)
        assert record["rerun_skipped"] is None
    [rerun] = [r for r in records_by_rank(tmp_path)[1] if r["kind"] == "rerun"]
    assert (rerun["step"], rerun["trigger"], rerun["role"], rerun["module"], rerun["micro_batch"],
            conclusion_of(rerun)) == (2, "nonfinite_loss", "origin", CORE, 0, "reproducible")
    batch = next(r["batch"] for rs in records_by_rank(tmp_path).values() for r in rs
                 if r["kind"] == "rerun" and r["batch"])
    assert Path(batch["path"]).is_file() and "tokens" in batch["tensors"]
    analysis = analyze(read_run(tmp_path))
    headline = _headline(analysis)
    assert headline.splitlines()[1].startswith("First failing step: 2  (nonfinite_loss)"), headline
    assert f"Forward origin (step 2 run again in place): {CORE}" in headline, headline
    assert "No non-finite gradient was recorded" not in format_text(analysis)
    report = build_report(read_run(tmp_path))
    assert report["incident"]["rerun"]["module"] == CORE and report["incident"]["origin_basis"] == "rerun"
    assert [entry["global_rank"] for entry in report["incident"]["origin"]] == [1]
    assert any("Megatron's loss check rejected a non-finite loss (nan) on rank 0, micro-batch 0" in line
               for line in report["incident"]["verdict"]["evidence"])
    # the weights were read before Megatron raised (no gradient exists): the forward origin rests on them
    assert {rank for rank, records in records_by_rank(tmp_path).items()
            for r in records if r["kind"] == "state" and r["step"] == 2} == {0, 1}
    # the incident in TensorBoard before Megatron raised, as at a non-finite norm (issue 58: it was not)
    texts, scalars, _ = read_board(tmp_path / "board")
    assert list(texts) == [2] and scalars["gradnan/origin_rank"] == [(2, 1.0)], (texts, scalars)
    assert "Rank 1: Megatron's loss check rejected a non-finite loss (nan) at micro-batch 0" in texts[2]
    assert report["incident"]["verdict"]["rule"] == "forward_operator"


@needs_loss_computation
def test_a_nan_weight_caught_by_megatrons_loss_check_is_the_weight_not_the_forward_operator(tmp_path):
    """Issue 48 (case 5), on issue 47's table: the loss check ends the step before any gradient; the weights
    are read there, so the verdict names the bad weight (it was `forward_op` "with finite weights", weights
    never read, with a skip flag that could not help)."""
    _raised(BASE.with_(tp=2, dtype="bf16", rerun_mode="disabled",
                       injections=(Injection(1, 2, f"{FC1}.weight", "nan", where="weight", index=5),)),
            tmp_path)
    incident = analyze(read_run(tmp_path)).incident
    assert incident.verdict.cause.value == "weights", incident.verdict
    assert FC1 in incident.verdict.summary and 1 in [entry["global_rank"] for entry in incident.origin]
    assert [step.action.value for step in incident.next_steps][0] == "resume"


@needs_loss_computation
def test_megatrons_loss_check_under_pipeline_parallelism_keeps_the_batch_without_a_rerun(tmp_path):
    """PP=2: only the last stage computes the loss and raises; the first stage waits in its point-to-point
    exchange, so no collective rerun: the record says why, the micro-batch is kept, the report names the
    rank and the micro-batch, and that the NaN came over the link from a stage whose side was not seen."""
    failure = _raised(BASE.with_(pp=2, dtype="bf16", rerun_mode="disabled",
                                 injections=(Injection(0, 2, FIRST_STAGE_CORE, "nan", where="forward"),)),
                      tmp_path)
    assert LOSS_MESSAGE in failure.errors["job0_rank1"], failure.errors
    losses = _losses(tmp_path)
    assert not losses.get(0)
    [record] = losses[1]
    assert (record["step"], record["micro_batch"], record["loss"]) == (2, 0, "nan")
    assert "pipeline parallelism" in record["rerun_skipped"]
    assert Path(record["batch"]["path"]).is_file()
    assert not [r for rs in records_by_rank(tmp_path).values() for r in rs if r["kind"] == "rerun"]
    analysis = analyze(read_run(tmp_path))
    text = format_text(analysis)
    assert text.splitlines()[1].startswith("First failing step: 2  (nonfinite_loss)"), text
    # stage 1 received the NaN over the link from stage 0, which died waiting before it wrote anything
    verdict = analysis.incident.verdict
    assert (verdict.cause.value, verdict.rule) == ("undetermined", "link_unobserved"), verdict
    assert "received a non-finite activation over the pipeline link pp0 -> pp1" in verdict.summary
    assert "rejected a non-finite loss (nan) on rank 1, micro-batch 0" in " ".join(verdict.evidence)
    [step] = analysis.incident.next_steps  # recording everywhere cannot help: Megatron's rerun, the batch
    # a Megatron-Core loop of one's own: megatron-core's own terms, not Megatron-LM's flag (issue 58)
    assert "megatron-core's RerunStateMachine in mode validate_results" in step.text, step.text
    assert step.command[-1] == record["batch"]["path"]
    assert "rank 1 (tp0 pp1 dp0)" in text and "non-finite loss (nan) at micro-batch 0" in text, text
    assert analysis.incident.origin_basis.value == "link_unobserved"


@needs_loss_computation
def test_a_loss_rejected_on_one_tensor_parallel_rank_alone_does_not_wait_for_the_others(tmp_path):
    """TP=2: rank 1's own loss goes bad alone (a device fault in its local sum); rank 0's is finite and it
    goes on to backward, so it never joins a rerun. Rank 1 waits for it a bounded time, then records the
    rejected loss without a rerun and Megatron's exception goes on: the job fails as it would without the
    kit, and does not hang until the collectives' timeout (it did)."""
    import time

    started = time.monotonic()
    failure = _raised(BASE.with_(tp=2, dtype="bf16", rerun_mode="disabled",
                                 injections=(Injection(1, 2, "", "nan", where="loss"),)), tmp_path)
    assert time.monotonic() - started < 240
    assert LOSS_MESSAGE in failure.errors["job0_rank1"], failure.errors
    losses = _losses(tmp_path)
    [record] = losses[1]
    assert not losses.get(0)
    assert "did not raise with this one" in record["rerun_skipped"]
    assert Path(record["batch"]["path"]).is_file()
    assert not [r for rs in records_by_rank(tmp_path).values() for r in rs if r["kind"] == "rerun"]


def test_validate_results_mode_at_iteration_1_goes_through_the_grad_norm(runs):
    """Megatron never validates iteration 1 (no checkpoint could be taken yet): the NaN loss reaches the
    grad norm, and gradnan's own incident runs the step again."""
    report = build_report(read_run(runs["validate_results_iteration_1"]))
    assert report["incident"]["step"] == 1 and "nonfinite_grad_norm" in report["incident"]["kinds"]
    rerun = report["incident"]["rerun"]
    assert (rerun["step"], rerun["trigger"], rerun["module"], rerun["global_rank"]) == (
        1, "nonfinite_grad_norm", CORE, 1)


def test_validate_results_mode_later_rides_on_megatrons_rerun(runs):
    report = build_report(read_run(runs["validate_results_iteration_2"]))
    rerun = report["incident"]["rerun"]
    assert (rerun["step"], rerun["trigger"], rerun["megatron"], rerun["module"], rerun["conclusion"]) == (
        2, "megatron_validation", "reproducible", CORE, "reproducible")



@needs_loss_computation
def test_a_loss_reported_finite_but_nan_for_backward_is_the_loss_function(runs):
    """Issue 48, case 4: the loss Megatron's check rejected (and backward used) is NaN while the value
    reported for logging is finite. gradnan judges the loss backward used: `loss`, micro-batch 1, with the
    loss function and the batch to look at (it was `backward_op`, "the loss was finite when run again",
    with only a self-test to do)."""
    incident = analyze(read_run(runs["validate_results_loss_after_report"])).incident
    verdict = incident.verdict
    assert (verdict.cause.value, verdict.rule) == ("loss", "loss_function"), verdict
    assert "micro-batch 1" in incident.verdict.summary
    assert [step.action.value for step in incident.next_steps][:2] == ["fix_loss", "inspect_batch"]


@needs_loss_computation
def test_a_loss_reported_finite_rejected_by_megatrons_check_in_disabled_mode_is_the_loss_function(tmp_path):
    """The same loss under --rerun-mode disabled: Megatron raises at micro-batch 1; gradnan's run again of
    the micro-batches up to it finds the loss backward would use NaN again (it was `device`, "transient")."""
    _raised(BASE.with_(dtype="bf16", rerun_mode="disabled", micro_batches=2, injections=LOSS_AFTER_REPORT),
            tmp_path)
    incident = analyze(read_run(tmp_path)).incident
    verdict = incident.verdict
    assert (verdict.cause.value, verdict.rule) == ("loss", "loss_function"), verdict
    assert "micro-batch 1" in incident.verdict.summary
    assert {entry["global_rank"] for entry in incident.origin} == {0, 1}


@needs_loss_computation
def test_the_rejected_micro_batch_is_counted_by_the_schedule_not_by_a_data_iterator():
    """Megatron-LM gives a data iterator only to tensor-parallel rank 0: the micro-batch whose loss was
    rejected is the number of losses the schedule stored before it, the same on every rank."""
    from megatron.core.pipeline_parallel import schedules

    from gradnan.patches.result_validation import _store

    stored = [{"lm loss": 1.0}, {"lm loss": 2.0}]
    assert len(_store(schedules.forward_step_calc_loss, (), {"forward_data_store": stored})) == 2
    assert len(_store(schedules.forward_step_calc_loss, (None,) * 7 + ([],), {})) == 0
