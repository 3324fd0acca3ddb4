"""Issue 59: verdicts that were confidently wrong on real megatron-core, planted through its schedules (gloo
processes, the CPU shim): an expert's overflow grown on the other expert-parallel rank than the one the
layer norm downstream ties on, one rank's copy of a dense weight under expert parallelism, one
tensor-parallel rank's loss non-finite beside its peer's finite, and fp16's loss scale stuck at +Inf or
NaN."""

from __future__ import annotations

import json

import pytest

from gradnan.cli import main
from gradnan.formats.incident import Action, Cause
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

pytestmark = [pytest.mark.slow]

EP = TinyGPTJob(world_size=2, dtype="bf16", experts=4, ep=2, quiet=True, steps=3)
EXPERT = "decoder.layers.{}.mlp.experts.local_experts.{}"
TP_DP = TinyGPTJob(world_size=4, tp=2, dtype="bf16", quiet=True, steps=3)
FP16 = TP_DP.with_(dtype="fp16", steps=6)

EXPERT_JOBS = {
    # global expert 2 lives on expert-parallel rank 1: its weight made 1e25, its output grows, and the next
    # layer norm goes non-finite on both ranks at once (the combine hands its output to every rank)
    "expert_growth": EP.with_(injections=(Injection(1, 2, EXPERT.format(1, 2) + ".linear_fc1.weight", "1e25",
                                                    where="scale_to"),)),
    # rank 1's copy of layer 0's router weight (dense: every data-parallel rank holds it, whichever experts)
    "dense_weight": EP.with_(injections=(Injection(1, 2, "decoder.layers.0.mlp.router.weight", "nan",
                                                   where="weight", index=3),)),
    "dense_weight_rank0": EP.with_(injections=(Injection(0, 2, "decoder.layers.1.mlp.router.weight", "nan",
                                                         where="weight", index=5),)),
}
TP_JOBS = {
    # tensor-parallel rank 1 of replica 0, and rank 2 (tp0 of replica 1): the loss 0/0 on that rank alone
    "tp_loss_rank1": TP_DP.with_(injections=(Injection(1, 2, "", where="loss"),)),
    "tp_loss_rank2": TP_DP.with_(injections=(Injection(2, 2, "", where="loss"),)),
    "tp_loss_checked": TP_DP.with_(rerun_mode="validate_results",
                                   injections=(Injection(3, 2, "", where="loss"),)),
    # every rank's scaler set to +Inf (NaN) after training applied updates: every step skipped from then on
    "scale_inf": FP16.with_(injections=tuple(
        Injection(r, 3, "", "inf", where="loss_scale") for r in range(4))),
    "scale_nan": FP16.with_(distributed_optimizer=True, injections=tuple(
        Injection(r, 3, "", "nan", where="loss_scale") for r in range(4))),
}


def _reports(root, jobs):
    planted = [job.with_(gradnan={"out_dir": str(root / name)}) for name, job in jobs.items()]
    launch_many(planted)
    return {name: analyze(read_run(root / name)) for name in jobs}


@pytest.fixture(scope="module")
def expert_reports(tmp_path_factory):
    return _reports(tmp_path_factory.mktemp("experts"), EXPERT_JOBS)


@pytest.fixture(scope="module")
def tp_reports(tmp_path_factory):
    return _reports(tmp_path_factory.mktemp("tensor_parallel"), TP_JOBS)


def test_an_experts_growth_is_named_on_the_rank_that_holds_the_expert(expert_reports):
    """It said the expert 'grew a value out of line ... on rank 0', where the expert is not, and listed rank
    0 first under Origin (both ranks tie at the layer norm)."""
    report = expert_reports["expert_growth"]
    incident, text = report.incident, format_text(report)
    assert incident.verdict.cause is Cause.FORWARD_OP, text
    assert incident.origin[0]["global_rank"] == 1 and incident.rerun.grew_in["global_rank"] == 1, text
    assert EXPERT.format(1, 2) in incident.verdict.summary and "on rank 1 (" in incident.verdict.summary, text
    assert "on rank 0 (" not in incident.verdict.summary, text


@pytest.mark.parametrize("name, rank, weight", [
    ("dense_weight", 1, "decoder.layers.0.mlp.router.weight"),
    ("dense_weight_rank0", 0, "decoder.layers.1.mlp.router.weight")])
def test_one_ranks_copy_of_a_dense_weight_under_expert_parallelism_is_the_one_replica_verdict(
        expert_reports, name, rank, weight):
    """The other expert-parallel rank is its data-parallel peer for a dense weight, and read its copy,
    finite: it said no peer's copy was read."""
    report = expert_reports[name]
    verdict, text = report.incident.verdict, format_text(report)
    assert (verdict.cause, verdict.rule) == (Cause.WEIGHTS, "one_replica_weights"), text
    assert [entry["global_rank"] for entry in report.incident.origin] == [rank], text
    assert weight in verdict.summary and "No data-parallel peer's copy was read" not in verdict.summary, text


@pytest.mark.parametrize("name, rank", [("tp_loss_rank1", 1), ("tp_loss_rank2", 2), ("tp_loss_checked", 3)])
def test_one_tensor_parallel_ranks_loss_beside_its_peers_finite_one_is_the_collective(tp_reports, name, rank):
    """Every tensor-parallel rank computes the same loss: one alone non-finite is the all-reduce or that
    rank's device, not 'the loss function ... the device not at fault'."""
    report = tp_reports[name]
    verdict, text = report.incident.verdict, format_text(report)
    assert (verdict.cause, verdict.rule) == (Cause.COLLECTIVE, "tensor_parallel_loss"), text
    assert [entry["global_rank"] for entry in report.incident.origin] == [rank], text
    actions = [step.action for step in report.incident.next_steps]
    assert actions[0] is Action.CHECK_INTERCONNECT and Action.SELFTEST in actions, text
    assert "device are not at fault" not in text, text


@pytest.mark.parametrize("name, value", [("scale_inf", "inf"), ("scale_nan", "nan")])
def test_a_loss_scale_stuck_non_finite_is_the_scale_on_every_rank_never_a_parameter(tp_reports, name, value):
    """It named backward_op on output_layer.weight on every rank."""
    report = tp_reports[name]
    incident, text = report.incident, format_text(report)
    assert incident.step == 3 and incident.verdict.cause is Cause.LOSS_SCALE, text
    assert [entry["global_rank"] for entry in incident.origin] == [0, 1, 2, 3], text
    assert all(not entry["params"] and entry["loss_scale"] == value for entry in incident.origin), text
    assert report.to_json()["incident"]["verdict"]["cause"] == "loss_scale"
    assert incident.capture_settings is None or "output_layer" not in str(incident.capture_settings), text
    [step] = incident.next_steps
    assert step.action is Action.TUNE_NUMERICS and "static scale" in step.text, text


SAVED = TinyGPTJob(world_size=2, dtype="fp32", quiet=True, steps=5)
CHECKPOINT_JOBS = {
    # one exponent bit of rank 1's copy flipped before step 3; replicas compared every 2 steps: equal at 2,
    # unequal at 4. A save every step.
    "diverged": SAVED.with_(gradnan={"replica_check_every": 2}, injections=(Injection(
        1, 3, "decoder.layers.0.mlp.linear_fc1.weight", "exponent", where="bit_flip", index=3),)),
    # token 9's row of the output layer at 1e30 (finite) on both replicas before step 3
    "row": SAVED.with_(injections=tuple(
        Injection(rank, 3, "output_layer.weight", "1e30", where="row", index=9) for rank in (0, 1))),
}


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    jobs = [job.with_(gradnan={**(job.gradnan or {}), "out_dir": str(root / name)},
                      checkpoint_dir=str(root / name / "saved")) for name, job in CHECKPOINT_JOBS.items()]
    launch_many(jobs)
    return {name: root / name for name in CHECKPOINT_JOBS}


def _listed(run_dir, capsys):
    assert main(["checkpoints", str(run_dir), "--json"]) == 0
    return {save["iteration"]: save for save in json.loads(capsys.readouterr().out)}


def test_saves_since_the_last_equal_replica_check_are_not_clean_and_the_advice_names_the_one_before(
        checkpoint_runs, capsys):
    """With two replicas nobody can tell which copy a save holds: every save written after the check that
    last saw them equal (step 2) is not known clean, and the restart names the one saved before it (it
    named "older than step 4", which admitted the saves of iterations 2 and 3, the bad copy among them)."""
    listed = _listed(checkpoint_runs["diverged"], capsys)
    assert listed[1]["clean"] and not any(listed[n]["clean"] for n in (2, 3, 4, 5)), listed
    # save 2 still held equal copies (the flip came after it) but was written after the last equal check;
    # the later ones hold copies whose digests differ (issue 60)
    assert "the last replica check that saw the data-parallel replicas equal (step 2)" in \
        listed[2]["condition"], listed[2]
    assert all("its data-parallel copies differ (the weight digests of ranks 0, 1)" in listed[n]["condition"]
               for n in (3, 4, 5)), listed
    report = analyze(read_run(checkpoint_runs["diverged"]))
    assert report.incident.verdict.cause is Cause.REPLICA_DIVERGENCE, format_text(report)
    [restart] = [step for step in report.incident.next_steps if step.action is Action.RESUME]
    assert restart.text.startswith("restart from the checkpoint of iteration 1 ("), restart.text


def test_a_save_holding_a_row_far_out_of_range_is_not_clean_and_the_row_advice_names_the_clean_one(
        checkpoint_runs, capsys):
    """A row at 1e30 is finite: the save that held it was "clean", and the advice for the row named no
    clean checkpoint although one was marked."""
    listed = _listed(checkpoint_runs["row"], capsys)
    assert listed[2]["clean"] and not listed[3]["clean"], listed
    assert "row 9 of output_layer.weight (token 9)" in listed[3]["condition"], listed[3]
    report = analyze(read_run(checkpoint_runs["row"]))
    text = format_text(report)
    assert report.incident.verdict.rule == "embedding_row", text
    [restore, *_] = [step for step in report.incident.next_steps if step.action is Action.RESTORE_ROW]
    assert "the newest save known clean is the checkpoint of iteration 2 (" in restore.text, text
