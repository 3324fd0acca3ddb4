"""Issue 14: the failing step itself, run again in place on real megatron-core (gloo, 2 processes). At the
first incident every rank runs the step's forward pass again over the same micro-batches from the same
RNG state; the module where a value first went non-finite is named on its rank (tensor-parallel peers
that only received it are receivers), captured into a bundle whose replay reproduces it, and the failing
micro-batch is kept; a fault the rerun does not meet again is called transient, a forward pass clean
in both passes points at backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradnan.decision.replica import conclusion_of
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report, format_text
from gradnan.offline.replay.command import replay_bundle
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank, rerun_block, step_trace

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

ATTENTION = "decoder.layers.1.self_attention"
QKV = f"{ATTENTION}.linear_qkv.weight"
CORE = f"{ATTENTION}.core_attention"
BASE = TinyGPTJob(world_size=2, steps=3, micro_batches=2, quiet=True)

SCENARIOS = {
    # a batch drives layer 1's attention scores past bf16's range on rank 1 at step 2, once; the scratch
    # buffer Megatron's attention hands baddbmm (beta=0, never read) holds NaN, as uninitialized memory may
    "bf16_one_off_dp2": BASE.with_(dtype="bf16",
                                   injections=(Injection(1, 2, QKV, "1e20", where="scale_to"),
                                               Injection(1, 2, "", "nan", where="memory_buffer"))),
    # the same overflow in fp16 on tensor-parallel rank 1, persistent from step 2: its loss is non-finite,
    # so that first skip is the incident (issue 23), not the escalation of the skips at step 4
    "fp16_persistent_tp2": BASE.with_(tp=2, dtype="fp16", steps=4, injections=(
        Injection(1, 2, QKV, "300", where="scale_to"),)),
    "bf16_second_stage_pp2": BASE.with_(pp=2, dtype="bf16", num_layers=2, injections=(
        Injection(1, 2, QKV, "1e20", where="scale_to"),)),
    # the interleaved schedule: rank 1 holds layers 1 and 3 (two model chunks)
    "bf16_interleaved_pp2": BASE.with_(pp=2, vpp=2, dtype="bf16", num_layers=4, injections=(
        Injection(1, 2, "decoder.layers.3.self_attention.linear_qkv.weight", "1e20", where="scale_to"),)),
    "bf16_transient_dp2": BASE.with_(dtype="bf16", injections=(
        Injection(1, 2, f"{ATTENTION}.core_attention", "inf", where="forward", transient=True),)),
    "bf16_gradient_nan_dp2": BASE.with_(dtype="bf16", injections=(
        Injection(1, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan", where="backward", index=3),)),
    # a corruption after the gradient all-reduce on one replica (a bad card): only that replica's norm is
    # non-finite (the plain optimizer reduces it over the model-parallel group), only it reruns
    # a grad norm returned as a device tensor (core 0.18+ with TE) is read after the update: no rerun
    "bf16_norm_as_tensor_dp2": BASE.with_(dtype="bf16", norm_as_tensor=True, injections=(
        Injection(1, 2, QKV, "1e20", where="scale_to"),)),
    # MoE with expert parallelism: the experts' token exchange spans the data-parallel replicas. A dense
    # gradient corrupted after the collective on replica 1 makes only its norm non-finite (the experts' part
    # finite): replica 0 never meets the incident, so no rerun (an expert's non-finite gradient brings every
    # replica in: tests/test_cause_matrix.py)
    "moe_ep2_not_rerun": BASE.with_(dtype="bf16", experts=4, ep=2, injections=(
        Injection(1, 2, "decoder.layers.1.self_attention.linear_qkv.weight", "nan", where="main_grad",
                  index=3),)),
    "fp32_after_collective_dp2": BASE.with_(injections=(
        Injection(1, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan", where="main_grad", index=3),)),
    # Megatron's RerunStateMachine in validate_results mode (Megatron-LM's default): it reruns the step on a
    # NaN loss and exits before the optimizer; gradnan rides on it
    "validate_results_reproducible": BASE.with_(dtype="bf16", rerun_mode="validate_results", injections=(
        Injection(1, 2, QKV, "1e20", where="scale_to"),)),
    "validate_results_transient": BASE.with_(dtype="bf16", rerun_mode="validate_results", injections=(
        Injection(1, 2, CORE, "inf", where="forward", transient=True),)),
}


# the rerun itself fails on rank 1 (its forward pass raises without gradients): logged, training unchanged
FAILING_RERUN = BASE.with_(dtype="bf16", injections=(
    Injection(1, 2, QKV, "1e20", where="scale_to"),
    Injection(1, 2, f"{ATTENTION}.linear_proj", "0", where="fails_without_grad")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerun")
    jobs = [job.with_(gradnan={"out_dir": str(root / name)}) for name, job in SCENARIOS.items()]
    jobs += [FAILING_RERUN,
             FAILING_RERUN.with_(gradnan={"out_dir": str(root / "failing_rerun"), "strict": False})]
    results = launch_many(jobs)
    return {**{name: root / name for name in SCENARIOS},
            "failing_rerun": (root / "failing_rerun", results[-2:])}


def reruns(run_dir):
    """rank -> its rerun record."""
    found = {}
    for rank, records in records_by_rank(run_dir).items():
        mine = [r for r in records if r["kind"] == "rerun"]
        assert len(mine) <= 1, "one rerun per run"
        if mine:
            found[rank] = mine[0]
    return found


def test_a_one_off_bf16_overflow_is_named_at_the_failing_step_with_its_bundle_and_batch(runs):
    found = reruns(runs["bf16_one_off_dp2"])
    origin = found[1]
    assert (origin["step"], origin["role"], origin["module"], origin["micro_batch"]) == (2, "origin", CORE, 0)
    assert conclusion_of(origin) == "reproducible" and origin["trigger"] == "nonfinite_grad_norm"
    # rank 0 (the other replica) was clean and so were its own gradients: they came in through the all-reduce
    assert found[0]["role"] == "clean" and conclusion_of(found[0]) == "after_collective"
    manifest = json.loads((runs["bf16_one_off_dp2"] / "bundles").glob("*/*/manifest.json")
                          .__next__().read_text())
    assert origin["bundle"].endswith("step0000002_" + CORE)
    assert (manifest["step"], manifest["trigger"], manifest["micro_batch"]) == (2, "rerun", 0)
    batch = torch.load(origin["batch"]["path"], weights_only=True)
    assert sorted(batch) == ["attention_mask", "labels", "position_ids", "tokens"]
    assert batch["tokens"].shape == (2, 16)


def test_the_failing_steps_bundle_replays_and_names_the_first_operator(runs):
    """Whatever the allocator left in the buffer ``baddbmm`` ignores (here NaN), the operator is named, in
    the capture's trace and in the replay."""
    origin = reruns(runs["bf16_one_off_dp2"])[1]
    manifest = json.loads((Path(origin["bundle"]) / "manifest.json").read_text())
    assert manifest["trace"]["first_nonfinite"]["op"] == "aten.baddbmm.default"
    result = replay_bundle(Path(origin["bundle"]))
    assert result["verdict"] == "precision" and result["reproduces"]
    assert result["runs"]["captured"]["first_nonfinite"]["op"].startswith("aten.baddbmm")


def test_fp16_persistent_overflow_origin_on_tp1_and_tp0_is_a_receiver(runs):
    found = reruns(runs["fp16_persistent_tp2"])
    assert found[1]["role"] == "origin" and found[1]["module"] == CORE
    assert found[1]["trigger"] == "loss_scale_overflow" and found[1]["step"] == 2  # the fault's first step
    assert found[0]["role"] == "receiver" and found[0]["module"] != CORE
    assert found[1]["bundle"] and not found[0]["bundle"]
    bundles = sorted(p.parent.name
                     for p in (runs["fp16_persistent_tp2"] / "bundles").glob("*/*/manifest.json"))
    assert bundles == ["step0000002_" + CORE]  # no later capture of what tp0 only received


def test_an_overflow_on_the_second_pipeline_stage_is_named_there(runs):
    found = reruns(runs["bf16_second_stage_pp2"])
    assert found[1]["role"] == "origin" and found[1]["module"] == CORE and found[1]["micro_batch"] == 0
    assert found[0]["role"] == "clean"
    assert found[0]["batch"]["micro_batch"] == 0  # the first stage holds the data: it keeps the batch


def test_the_interleaved_schedule_is_run_again_too(runs):
    found = reruns(runs["bf16_interleaved_pp2"])
    assert (found[1]["role"], found[1]["module"], found[1]["micro_batch"]) == (
        "origin", "decoder.layers.3.self_attention.core_attention", 0)
    assert found[1]["bundle"]


def test_a_fault_the_rerun_does_not_meet_again_is_transient(runs):
    found = reruns(runs["bf16_transient_dp2"])
    assert all(record["role"] == "clean" for record in found.values())
    assert (conclusion_of(found[1]), conclusion_of(found[0])) == ("transient", "after_collective")
    report = build_report(read_run(runs["bf16_transient_dp2"]))
    assert report["incident"]["rerun"]["conclusion"] == "transient"
    assert report["incident"]["verdict"]["cause"] == "device"


def test_a_nan_planted_in_a_gradient_leaves_the_forward_pass_clean(runs):
    found = reruns(runs["bf16_gradient_nan_dp2"])
    assert (conclusion_of(found[1]), conclusion_of(found[0])) == ("backward", "after_collective")
    report = build_report(read_run(runs["bf16_gradient_nan_dp2"]))
    assert report["incident"]["rerun"]["conclusion"] == "backward"
    assert report["incident"]["verdict"]["cause"] == "backward_op"
    assert "the step's forward pass and its loss were finite when run again" in report["incident"]["verdict"][
        "summary"]


def test_riding_on_megatrons_own_rerun_in_validate_results_mode(runs):
    found = reruns(runs["validate_results_reproducible"])
    assert (found[1]["trigger"], found[1]["megatron"], conclusion_of(found[1])) == (
        "megatron_validation", "reproducible", "reproducible")
    assert (found[1]["role"], found[1]["module"], found[1]["step"]) == ("origin", CORE, 2)
    assert found[1]["bundle"]
    transient = reruns(runs["validate_results_transient"])
    # Megatron's conclusion is job-wide; each replica's own is from its own loss: rank 0's was finite
    assert {rank: (r["megatron"], conclusion_of(r)) for rank, r in transient.items()} == {
        0: ("transient", "after_collective"), 1: ("transient", "transient")}


def test_a_corruption_on_one_replica_reruns_that_replica_alone(runs):
    found = reruns(runs["fp32_after_collective_dp2"])
    assert (found[1]["step"], conclusion_of(found[1])) == (2, "after_collective")
    # rank 0's replica first failed at step 3 (rank 1's NaN update reached it through the all-reduce)
    assert (found[0]["step"], conclusion_of(found[0])) == (3, "after_collective")


def test_a_rerun_that_fails_is_logged_and_training_goes_on_unchanged(runs):
    run_dir, (without, with_kit) = runs["failing_rerun"]
    assert step_trace(with_kit) == step_trace(without)
    assert 1 not in reruns(run_dir)  # nothing concluded from a pass that did not finish
    assert [r["kind"] for r in records_by_rank(run_dir)[1] if r["step"] == 2] == [
        "pre_reduction", "nonfinite_grad_norm", "state"]


def test_a_norm_read_after_the_update_is_not_rerun(runs):
    records = [r for rs in records_by_rank(runs["bf16_norm_as_tensor_dp2"]).values() for r in rs]
    assert any(r["kind"] == "nonfinite_grad_norm" and r["step"] == 2 for r in records)
    assert not [r for r in records if r["kind"] == "rerun"]


def test_expert_parallelism_without_every_replica_is_not_rerun(runs):
    """Replica 1 alone meets step 2; at step 3 its NaN weights reach every expert, so both replicas meet it:
    rank 0, at its first incident, asks to run the step again, rank 1, after its own, says no in the same
    vote, and nobody waits (the job completed)."""
    by_rank = records_by_rank(runs["moe_ep2_not_rerun"])
    assert {rank: sorted({r["step"] for r in rs if r["kind"] == "nonfinite_grad_norm"})
            for rank, rs in by_rank.items()} == {0: [3], 1: [2, 3]}
    assert not [r for rs in by_rank.values() for r in rs if r["kind"] == "rerun"]


def test_the_report_headline_names_the_module_rank_micro_batch_and_conclusion(runs):
    analysis = analyze(read_run(runs["fp16_persistent_tp2"]))
    report = analysis.to_json()
    rerun = report["incident"]["rerun"]
    assert (rerun["module"], rerun["global_rank"], rerun["micro_batch"]) == (CORE, 1, 0)
    assert [r["global_rank"] for r in rerun["receivers"]] == [0]
    text = format_text(analysis)
    headline = "\n".join(rerun_block(text))
    assert f"Forward origin (step 2 run again in place): {CORE}" in headline, text
    assert "on rank 1 (tp1 pp0 dp0)" in headline and "micro-batch 0: REPRODUCIBLE" in headline, text
    assert "received it from there (not origins): rank(s) 0" in headline, text
    assert [entry["global_rank"] for entry in report["incident"]["origin"]] == [1]


def test_a_diagnostic_pass_sets_megatrons_validation_and_timers_aside_then_restores_them(monkeypatch):
    """Megatron's ``RerunStateMachine`` and the model config, edited through the undo log for the pass
    only, exception included: the very same objects afterwards."""
    from megatron.core import rerun_state_machine
    from megatron.core.transformer import TransformerConfig

    from gradnan.patches.schedules import diagnostic_pass

    machine = rerun_state_machine.RerunStateMachine()  # its default mode raises on a rejected result
    monkeypatch.setattr(rerun_state_machine, "_GLOBAL_RERUN_STATE_MACHINE", machine)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    timers, sync = object(), lambda *args: None
    config.timers, config.param_sync_func = timers, sync
    attributes = dict(vars(machine))
    with pytest.raises(RuntimeError, match="inside the pass"):
        with diagnostic_pass(config, []):
            nan = torch.tensor(float("nan"))
            assert machine.validate_result(result=nan, rejection_func=torch.isnan,
                                           message="loss is NaN") is None
            assert machine.is_unexpectedly_large(torch.tensor(1e30), 1.0) is False
            assert config.timers is None and config.param_sync_func is None
            raise RuntimeError("inside the pass")
    assert vars(machine).keys() == attributes.keys()
    assert all(vars(machine)[name] is value for name, value in attributes.items())
    assert config.timers is timers and config.param_sync_func is sync
