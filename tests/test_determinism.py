"""The kit never changes training: losses, grad norms, step outcomes and the final weights are bitwise
identical with and without it, at the defaults, with the pre-reduction check in sync mode, with capture
armed on several modules (across activation recompute), on a run where it detects and scans an injected
NaN, and on runs whose failing step it runs again in place (the rerun), with dropout drawing from the RNG,
where fp16 skips the step and training goes on, where bf16 applies it, under expert parallelism, and
with the replica check at every step."""

from __future__ import annotations

import pytest

from gradnan.decision.replica import conclusion_of
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank, step_trace, weight_digests

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

CASES = {
    "tp2_bf16": TinyGPTJob(tp=2, dtype="bf16", steps=4),
    "dp2_fp16_distopt": TinyGPTJob(dtype="fp16", distributed_optimizer=True, steps=4),
    "tp2_bf16_pre_reduction_sync": TinyGPTJob(tp=2, dtype="bf16", steps=4, overlap_grad_reduce=True,
                                              bucket_size=6000),
    "tp2_bf16_capture_armed": TinyGPTJob(tp=2, dtype="bf16", steps=4, recompute=True),
    "pp2_fp32_nan": TinyGPTJob(pp=2, dtype="fp32", steps=4, micro_batches=2, injections=(
        Injection(1, 2, "decoder.layers.1.mlp.linear_fc2.weight", "nan", where="backward", index=3),)),
    # incidents the failing step is run again for (the rerun), with dropout drawing from the RNG: fp16
    # skips steps 2-4, the rerun runs at the escalation (4), training goes on at 5 and 6 ...
    "dp2_fp16_dropout_rerun": TinyGPTJob(dtype="fp16", steps=6, micro_batches=2,
                                         dropout=0.1, injections=tuple(
        Injection(1, step, "decoder.layers.1.mlp", "inf", where="forward") for step in (2, 3, 4))),
    # ... bf16 applies the failing step's update (Megatron has no loss scaler there); TP=2: Megatron's tracker
    "tp2_bf16_dropout_rerun": TinyGPTJob(tp=2, dtype="bf16", steps=3, micro_batches=2,
                                         dropout=0.1, injections=(
        Injection(1, 2, "decoder.layers.1.self_attention.linear_qkv.weight", "1e20", where="scale_to"),)),
    # ... and under expert parallelism, over the expert-parallel group (an expert's overflow on rank 1)
    "ep2_bf16_dropout_rerun": TinyGPTJob(dtype="bf16", experts=4, ep=2, steps=3, dropout=0.1, injections=(
        Injection(1, 2, "decoder.layers.0.mlp.experts.local_experts.2", "inf", where="forward", index=3),)),
}
RERUN_CASES = ("dp2_fp16_dropout_rerun", "tp2_bf16_dropout_rerun", "ep2_bf16_dropout_rerun")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    jobs = []
    for name, job in CASES.items():
        mode = {"tp2_bf16_pre_reduction_sync": {"pre_reduction": "sync"},
                "tp2_bf16_capture_armed": {"capture_modules": "decoder.layers.*.mlp,"
                                                              "decoder.layers.0.self_attention",
                                           "capture_retain": True},
                # the replica check at every step, through fp16 skips and the rerun
                "dp2_fp16_distopt": {"replica_check_every": 1},
                "dp2_fp16_dropout_rerun": {"replica_check_every": 1}}.get(name, {})
        jobs += [job, job.with_(gradnan={"out_dir": str(root / name), **mode})]
    results = launch_many(jobs)
    return {name: (results[2 * i], results[2 * i + 1], root / name) for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bitwise_identical_with_and_without_the_kit(outcomes, name):
    without, with_kit, _ = outcomes[name]
    assert step_trace(with_kit) == step_trace(without)
    assert weight_digests(with_kit) == weight_digests(without)
    assert len(step_trace(without)[0]) == CASES[name].steps


@pytest.mark.parametrize("name", RERUN_CASES)
def test_the_failing_step_was_really_run_again(outcomes, name):
    """Guards the comparison above: the rerun did run (and found the origin) in the incident cases."""
    without, _, run_dir = outcomes[name]
    reruns = [r for records in records_by_rank(run_dir).values() for r in records if r["kind"] == "rerun"]
    assert [conclusion_of(r) for r in reruns if r["role"] == "origin"] == ["reproducible"]
    if name.startswith("dp2_fp16"):
        assert [step.update_successful for step in without[0].steps] == [True, False, False, False,
                                                                         True, True]


def test_the_injected_run_was_really_detected(outcomes):
    """Guards the comparison above: the kit did act (scanned and recorded) in the injected case."""
    _, with_kit, run_dir = outcomes["pp2_fp32_nan"]
    assert any((run_dir / "records").glob("*.jsonl"))
    assert "nan" in step_trace(with_kit)[1][1][1]


def test_the_replica_check_at_every_step_sees_the_replicas_equal(outcomes):
    """Also through fp16 skips and the in-place rerun of the failing step: no false alarm."""
    for name in ("dp2_fp16_distopt", "dp2_fp16_dropout_rerun"):
        _, _, run_dir = outcomes[name]
        kinds = {record["kind"] for records in records_by_rank(run_dir).values() for record in records}
        assert "replica_divergence" not in kinds
