"""Healthy steps pay no host sync for the kit: per step, the same number of host-syncing tensor calls
(item, tolist, bool/float/int conversions, numpy) with the kit at its defaults as without it, on real
megatron-core (DP=2, bf16, overlapped reduction with several buckets). ``pre_reduction="sync"`` adds one
read per bucket group per step, and none per parameter; frame tracing one read per step in all, however
many module calls and tensors it measures. The run-up ring (on at the defaults) adds none either, also
once it wraps around; nor does checking what pipeline stages send and receive (PP=2, 1F1B)."""

from __future__ import annotations

import pytest

from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import TinyGPTJob

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

JOB = TinyGPTJob(dtype="bf16", steps=4, overlap_grad_reduce=True, bucket_size=6000, count_host_syncs=True)
TENSOR_NORM = JOB.with_(norm_as_tensor=True)  # the grad norm as a tensor, as core 0.18+ with TE returns it
PIPELINE = TinyGPTJob(pp=2, dtype="bf16", steps=4, micro_batches=2, count_host_syncs=True)


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    jobs = [JOB, JOB.with_(gradnan={"out_dir": str(root / "defaults")}),
            JOB.with_(gradnan={"out_dir": str(root / "sync"), "pre_reduction": "sync"}),
            JOB.with_(gradnan={"out_dir": str(root / "frames"), "frames": "detect"}),
            JOB.with_(gradnan={"out_dir": str(root / "trace"), "frames": "trace", "trace_steps": "1-4"}),
            JOB.with_(gradnan={"out_dir": str(root / "runup_wraps"), "runup_steps": 2}),
            TENSOR_NORM, TENSOR_NORM.with_(gradnan={"out_dir": str(root / "tensor_norm")}),
            PIPELINE, PIPELINE.with_(gradnan={"out_dir": str(root / "pipeline")})]
    outcomes = launch_many(jobs)
    return [{rank: [s.host_syncs for s in result.steps] for rank, result in outcome.items()}
            for outcome in outcomes], outcomes[0][0].bucket_groups


def test_defaults_add_no_host_sync_on_healthy_steps(counts):
    (without, defaults, *_), _ = counts
    assert defaults == without
    assert all(count > 0 for count in without[0])  # the counter does see Megatron's own syncs


def test_a_grad_norm_given_as_a_tensor_is_checked_without_a_host_sync(counts):
    (*_, tensor_without, tensor_defaults, _, _), _ = counts
    assert tensor_defaults == tensor_without
    assert all(count > 0 for count in tensor_without[0])


def test_sync_mode_adds_one_read_per_bucket_group_not_per_parameter(counts):
    (without, _, sync, *_), bucket_groups = counts
    assert bucket_groups > 1  # several buckets, each its own group, so "per group" is really tested
    for rank in without:
        assert [s - w for s, w in zip(sync[rank][1:], without[rank][1:])] == [bucket_groups] * (JOB.steps - 1)


def test_frame_tracing_reads_once_per_step_not_per_tensor(counts):
    (without, _, _, detect, trace, *_), _ = counts
    for rank in without:  # dozens of module calls and over a hundred tensors measured per step
        assert [d - w for d, w in zip(detect[rank], without[rank])] == [1] * JOB.steps
        assert [t - w for t, w in zip(trace[rank], without[rank])] == [1] * JOB.steps


def test_the_runup_ring_adds_no_host_sync_also_when_it_wraps_around(counts):
    """``runup_steps=2`` over 4 steps: every row is overwritten, its index counted on the host."""
    (without, _, _, _, _, wraps, *_), _ = counts
    assert wraps == without


def test_the_pipeline_links_are_checked_without_a_host_sync(counts):
    """Every activation and gradient a stage sends or receives gets its largest magnitude on the device."""
    (*_, pipeline_without, pipeline_defaults), _ = counts
    assert pipeline_defaults == pipeline_without
    assert all(count > 0 for count in pipeline_without[0])
