"""Issue 23, case 3, the pure parts: the largest gradient and whether a rank's own float32 norm overflows,
the bucket statistic, the rerun's conclusion, the origin and verdict offline, and the record check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradnan.decision.replica import conclude, strongest
from gradnan.errors import InputError
from gradnan.formats.incident import Conclusion, OriginBasis
from gradnan.formats.maps import ParamSlot
from gradnan.formats.records import FLOAT32_SQUARE_LIMIT, from_json
from gradnan.formats.wording import describe_largest
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import RunFiles
from gradnan.offline.incident.report import format_text
from gradnan.training.incidents import at_norm
from gradnan.training.offenders import largest_gradient
from gradnan.training.rerun_pass import norm_overflowed, observation
from gradnan.training.scan import abs_max


def _slot(index, shape, shard=None):
    numel = math.prod(shape)
    return ParamSlot(index, f"layer.{index}.weight", shape, "torch.float32", numel, 0, 1.0, 1.0, False, 0,
                     shard, "torch.float32")


def test_the_largest_gradient_is_named_by_parameter_element_and_signed_value():
    grads = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0.5, -7.0, 6.0])]
    largest = largest_gradient([_slot(0, (2, 2)), _slot(1, (3,))], grads)
    assert largest == {"id": 1, "name": "layer.1.weight", "flat": 1, "index": [1], "value": -7.0,
                       "overflows": False}


def test_a_shard_offset_is_added_and_a_missing_gradient_skipped():
    largest = largest_gradient([_slot(0, (2, 3), shard=(3, 6)), _slot(1, (4,))],
                               [torch.tensor([0.0, 9.0, 1.0]), None])
    assert (largest["flat"], largest["index"]) == (4, [1, 1])
    assert largest_gradient([_slot(0, (4,))], [None]) is None


@pytest.mark.parametrize("values, overflows", [
    ([1e30], True),  # one element squares past float32
    ([1e19] * 4, True),  # none does alone; their sum of squares does, as Megatron's norm would
    ([1e18] * 4, False),
])
def test_overflows_follows_the_float32_sum_of_squares(values, overflows):
    assert largest_gradient([_slot(0, (len(values),))], [torch.tensor(values)])["overflows"] is overflows


def test_the_bucket_statistic_is_the_abs_max_and_propagates_nan_and_inf():
    assert abs_max(torch.tensor([1.0, -5.0, 2.0])).item() == 5.0
    assert math.isnan(abs_max(torch.tensor([1.0, float("nan")])).item())
    assert math.isinf(abs_max(torch.tensor([1.0, float("-inf")])).item())
    assert abs_max(torch.tensor([1e30], dtype=torch.bfloat16)).item() >= FLOAT32_SQUARE_LIMIT
    assert abs_max(torch.tensor([1e30], dtype=torch.bfloat16)).dtype == torch.float32


def test_at_norm_says_whether_a_rank_holds_a_nan_an_overflow_or_neither():
    big = {"name": "w", "index": [0], "value": 1e30, "overflows": True}
    assert at_norm({"params": [{"name": "w"}], "largest_grad": None}) == "nonfinite"
    assert at_norm({"params": [], "largest_grad": big}) == "overflow"
    assert at_norm({"params": [], "largest_grad": {**big, "overflows": False}}) == "finite"
    assert at_norm({"params": [], "largest_grad": {**big, "overflows": False},
                    "pre_reduction": "overflow"}) == "overflow"


def test_the_rerun_concludes_norm_overflow_only_when_no_rank_held_a_nonfinite_gradient():
    assert norm_overflowed(1.0, 0.0) and not norm_overflowed(1.0, 1.0) and not norm_overflowed(0.0, 0.0)
    def concluded(reproduced, loss, overflow):
        return conclude(observation(float(reproduced), loss, 0.0, float(overflow), 0.0, -1.0, None))

    assert concluded(False, 0.0, True) is Conclusion.NORM_OVERFLOW
    assert concluded(False, 0.0, False) is Conclusion.AFTER_COLLECTIVE
    assert concluded(True, 0.0, True) is Conclusion.REPRODUCIBLE
    assert concluded(False, 1.0, True) is Conclusion.TRANSIENT
    assert strongest([Conclusion.AFTER_COLLECTIVE, Conclusion.NORM_OVERFLOW]) is Conclusion.NORM_OVERFLOW
    assert "the grad norm overflowed although every gradient is finite" in Conclusion.NORM_OVERFLOW.headline


def _record(kind, rank, dp_size=2, **extra):
    coords = {"global_rank": rank, "tp": 0, "pp": 0, "dp": rank, "dp_size": dp_size, "host": "h",
              "device": "cpu"}
    return {"schema": "gradnan.record", "version": 1, "kind": kind, "step": 4, "rank": coords, "params": [],
            "params_total": 0, **extra}


def _largest(value, overflows=True):
    return {"id": 2, "name": "decoder.layers.1.mlp.linear_fc2.weight", "flat": 9, "index": [0, 9],
            "value": value, "overflows": overflows}


def _analyze(*records):
    return analyze(RunFiles(Path("/run"), records={Path("/run/records/r.jsonl"): list(records)}))


def test_offline_the_rank_that_had_it_before_the_collective_is_the_origin():
    averaged = _largest(5e29)  # after the collective both replicas hold the average
    report = _analyze(
        _record("nonfinite_grad_norm", 0, grad_norm="inf", pre_reduction="clean", largest_grad=averaged),
        _record("nonfinite_grad_norm", 1, grad_norm="inf", pre_reduction="overflow", largest_grad=averaged),
        _record("pre_reduction", 1, norm_overflow=True, largest_grad=_largest(1e30)))
    incident = report.incident
    assert incident.origin_basis is OriginBasis.NORM_OVERFLOW
    assert [e["global_rank"] for e in incident.origin] == [1]
    assert [v["global_rank"] for v in incident.receivers] == [0]
    assert incident.verdict.cause.value == "norm_overflow"
    assert incident.verdict.summary.startswith(
        "exploding gradients: the grad norm overflowed although every gradient is finite: rank 1"
        " (tp0 pp0 dp1, h cpu) held the largest gradient before the data-parallel collective,"
        " decoder.layers.1.mlp.linear_fc2.weight[0, 9] = 1e+30")
    text = format_text(report)
    assert "largest gradient before the data-parallel collective: decoder.layers.1.mlp.linear_fc2.weight" \
           "[0, 9] = 1e+30 (finite)" in text


def test_offline_without_a_pre_reduction_check_the_overflowing_holder_is_the_origin():
    report = _analyze(
        _record("nonfinite_grad_norm", 0, dp_size=1, grad_norm="inf", pre_reduction="unchecked",
                largest_grad=_largest(0.3, overflows=False)),
        _record("nonfinite_grad_norm", 1, dp_size=1, grad_norm="inf", pre_reduction="unchecked",
                largest_grad=_largest(1e30)))
    incident = report.incident
    assert [e["global_rank"] for e in incident.origin] == [1]
    assert "before the data-parallel collective" not in incident.verdict.summary
    assert incident.verdict.cause.value == "norm_overflow"


def test_offline_a_norm_without_a_largest_gradient_stays_unknown():
    report = _analyze(_record("nonfinite_grad_norm", 0, grad_norm="nan", pre_reduction="clean"))
    assert report.incident.origin_basis is OriginBasis.NONE
    assert report.incident.verdict.cause.value == "undetermined"


def test_the_reader_checks_largest_grad():
    from_json(_record("nonfinite_grad_norm", 0, largest_grad=_largest(1e30)), "r")
    with pytest.raises(InputError, match="largest_grad"):
        from_json(_record("nonfinite_grad_norm", 0, largest_grad={"name": "w", "value": 1.0}), "r")
    assert describe_largest(_largest(-2.5)) == "decoder.layers.1.mlp.linear_fc2.weight[0, 9] = -2.5"
