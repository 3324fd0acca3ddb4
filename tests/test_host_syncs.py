"""Healthy steps pay no host sync for the kit: per step, the same number of host-syncing tensor calls
(item, tolist, bool/float/int conversions, numpy) with the kit at its defaults as without it, on real
megatron-core (DP=2, bf16, overlapped reduction with several buckets). ``pre_reduction="sync"`` adds one
read per bucket group per step, and none per parameter; frame tracing one read per step in all, however
many module calls and tensors it measures. The run-up ring (on at the defaults) adds none either, also
once it wraps around; nor does the replica check, checked at every step, its result read at the step's grad
norm or, with a norm given as a tensor, at the next check; nor does checking what pipeline stages send and
receive (PP=2, 1F1B)."""

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
    """Each job's host syncs per rank per step, by the job's name here, and the bucket groups of the first."""
    root = tmp_path_factory.mktemp("syncs")

    def kit(job, name, **options):
        return job.with_(gradnan={"out_dir": str(root / name), **options})

    jobs = {"without": JOB, "defaults": kit(JOB, "defaults"), "sync": kit(JOB, "sync", pre_reduction="sync"),
            "detect": kit(JOB, "frames", frames="detect"),
            "trace": kit(JOB, "trace", frames="trace", trace_steps="1-4"),
            "wraps": kit(JOB, "runup_wraps", runup_steps=2),
            "tensor_without": TENSOR_NORM, "tensor_defaults": kit(TENSOR_NORM, "tensor_norm"),
            "replicas": kit(JOB, "replicas", replica_check_every=1),
            "replicas_tensor_norm": kit(TENSOR_NORM, "replicas_tensor_norm", replica_check_every=1),
            "pipeline_without": PIPELINE, "pipeline_defaults": kit(PIPELINE, "pipeline")}
    outcomes = launch_many(list(jobs.values()))
    syncs = {name: {rank: [s.host_syncs for s in result.steps] for rank, result in outcome.items()}
             for name, outcome in zip(jobs, outcomes)}
    return syncs, outcomes[0][0].bucket_groups


def test_defaults_add_no_host_sync_on_healthy_steps(counts):
    syncs, _ = counts
    assert syncs["defaults"] == syncs["without"]
    assert all(count > 0 for count in syncs["without"][0])  # the counter does see Megatron's own syncs


def test_a_grad_norm_given_as_a_tensor_is_checked_without_a_host_sync(counts):
    syncs, _ = counts
    assert syncs["tensor_defaults"] == syncs["tensor_without"]
    assert all(count > 0 for count in syncs["tensor_without"][0])


def test_sync_mode_adds_one_read_per_bucket_group_not_per_parameter(counts):
    syncs, bucket_groups = counts
    without, sync = syncs["without"], syncs["sync"]
    assert bucket_groups > 1  # several buckets, each its own group, so "per group" is really tested
    for rank in without:
        assert [s - w for s, w in zip(sync[rank][1:], without[rank][1:])] == [bucket_groups] * (JOB.steps - 1)


def test_frame_tracing_reads_once_per_step_not_per_tensor(counts):
    syncs, _ = counts
    without = syncs["without"]
    for rank in without:  # dozens of module calls and over a hundred tensors measured per step
        assert [d - w for d, w in zip(syncs["detect"][rank], without[rank])] == [1] * JOB.steps
        assert [t - w for t, w in zip(syncs["trace"][rank], without[rank])] == [1] * JOB.steps


def test_the_runup_ring_adds_no_host_sync_also_when_it_wraps_around(counts):
    """``runup_steps=2`` over 4 steps: every row is overwritten, its index counted on the host."""
    syncs, _ = counts
    assert syncs["wraps"] == syncs["without"]


def test_the_replica_check_adds_no_host_sync_even_at_every_step(counts):
    """``replica_check_every=1``: every step digests the weights, starts the all-reduce and reads the last
    one, with the norm read as a number (at it) and as a tensor (at the next check)."""
    syncs, _ = counts
    assert syncs["replicas"] == syncs["without"]
    assert syncs["replicas_tensor_norm"] == syncs["tensor_without"]


def test_the_pipeline_links_are_checked_without_a_host_sync(counts):
    """Every activation and gradient a stage sends or receives gets its largest magnitude on the device."""
    syncs, _ = counts
    assert syncs["pipeline_defaults"] == syncs["pipeline_without"]
    assert all(count > 0 for count in syncs["pipeline_without"][0])
