"""Issue 49, replica divergence: a finite bit flip in one data-parallel replica's weight, planted through
megatron-core's schedules on real gloo processes, is recorded at the next replica check with its rank, its
parameter and its first differing element, and reported as its own cause although nothing ever goes
non-finite; the same runs without the flip, hundreds of steps in bf16 and fp16, with and without the
distributed optimizer, checked at every step, record nothing."""

from __future__ import annotations

import math

import pytest

from gradnan.formats.incident import Cause, OriginBasis, RecordKind
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

pytestmark = pytest.mark.slow

HEALTHY_STEPS = 200
FC1, QKV = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_qkv.weight"


def flip(rank: int, step: int, target: str, index: int) -> Injection:
    return Injection(rank=rank, step=step, target=target, value="exponent", where="bit_flip", index=index)


# (job, the rank flipped, the check that must see it, the parameter, the element, its index)
FLIPS = {
    # in the fp32 main copy (it outlives the step): the bf16 weight takes it at step 3's update, so the
    # check of step 4 sees it
    "bf16": (dict(dtype="bf16", injections=(flip(1, 3, FC1, 37),)), 1, 4, FC1, 37, [1, 5]),
    # in the gathered parameter, which the distributed optimizer's next gather overwrites: seen at the check
    # of the step it was flipped in, before the update
    "fp16_distributed": (dict(dtype="fp16", distributed_optimizer=True, injections=(flip(2, 4, QKV, 100),)),
                         2, 4, QKV, 100, [3, 4]),
}
HEALTHY = {f"{dtype}{'_distributed' if distributed else ''}":
           dict(dtype=dtype, distributed_optimizer=distributed)
           for dtype in ("bf16", "fp16") for distributed in (False, True)}
SMALL = dict(num_layers=1, hidden_size=16, num_heads=2, seq_length=8, micro_batch_size=1)  # hundreds of steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    base = TinyGPTJob(world_size=3, steps=6)
    jobs = [base.with_(**spec, gradnan={"out_dir": str(root / name), "replica_check_every": 2})
            for name, (spec, *_) in FLIPS.items()]
    jobs += [base.with_(**spec, **SMALL, steps=HEALTHY_STEPS, quiet=True,
                        gradnan={"out_dir": str(root / f"healthy_{name}"), "replica_check_every": 1})
             for name, spec in HEALTHY.items()]
    outcomes = launch_many(jobs)
    names = list(FLIPS) + [f"healthy_{name}" for name in HEALTHY]
    return {name: (root / name, outcome) for name, outcome in zip(names, outcomes)}


def _records(run_dir):
    files = read_run(run_dir)
    assert not files.problems, files.problems
    return list(files.all_records())


@pytest.mark.parametrize("name", list(FLIPS))
def test_a_flipped_bit_is_recorded_at_the_next_check_with_rank_parameter_and_element(runs, name):
    run_dir, outcome = runs[name]
    _, rank, check, target, flat, index = FLIPS[name]
    assert outcome[rank].injected  # planted
    for result in outcome.values():  # nothing ever went non-finite
        assert all(step.loss is not None and math.isfinite(step.loss) for step in result.steps)
        assert all(step.grad_norm is None or math.isfinite(step.grad_norm) for step in result.steps)
    records = _records(run_dir)
    assert [(r["kind"], r["rank"]["global_rank"], r["step"]) for r in records] == [
        (RecordKind.REPLICA_DIVERGENCE, rank, check)]
    record = records[0]
    assert (record["replicas"], record["agreeing"], record["differing_ranks"]) == (3, 2, [rank])
    assert record["read_at_step"] == check  # read at the step's grad norm, before the update
    first = record["diverged"][0]
    assert (first["name"], first["flat"], first["index"]) == (target, flat, index)
    assert record["diverged_total"] == 1
    # its exponent's lowest bit: twice or half the value (in the main copy, one update and a rounding since)
    assert abs(math.log2(first["value"] / first["majority_value"])) > 0.5


@pytest.mark.parametrize("name", list(FLIPS))
def test_the_report_names_the_divergence_as_its_own_cause(runs, name):
    run_dir, _ = runs[name]
    _, rank, check, target, _, index = FLIPS[name]
    incident = analyze(read_run(run_dir)).incident
    assert incident is not None and incident.step == check
    assert incident.verdict.cause is Cause.REPLICA_DIVERGENCE
    assert incident.origin_basis is OriginBasis.REPLICA_CHECK
    assert [entry["global_rank"] for entry in incident.origin] == [rank]
    assert f"{target}[{', '.join(map(str, index))}]" in incident.verdict.summary
    assert [step.action.value for step in incident.next_steps] == ["drain", "selftest", "resume"]


@pytest.mark.parametrize("name", list(HEALTHY))
def test_no_false_alarm_over_hundreds_of_checked_steps(runs, name):
    run_dir, outcome = runs[f"healthy_{name}"]
    assert all(len(result.steps) == HEALTHY_STEPS for result in outcome.values())
    assert _records(run_dir) == []
    assert analyze(read_run(run_dir)).incident is None
