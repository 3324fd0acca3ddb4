"""Issue 36, unit level: what a rank reads of its weights and optimizer state at an incident
(``gradnan.training.weights``), on tensors built here."""

from __future__ import annotations

import math

import pytest
import torch

from gradnan.events import ParamTensors, StepState
from gradnan.formats.maps import ParamSlot
from gradnan.testing.measure import OperatorCounter
from gradnan.training import weights as weights_module
from gradnan.training.weights import finite_flag, state_fields, weights_digest


def slot(number: int, name: str, shape, shard=None) -> ParamSlot:
    numel = math.prod(shape)
    return ParamSlot(id=number, name=name, shape=tuple(shape), dtype="torch.bfloat16", numel=numel, group=0,
                     wd_mult=1.0, lr_mult=1.0, is_expert=False, optimizer=0, shard=shard,
                     main_dtype="torch.float32", order=number)


def state(weight: torch.Tensor, main: torch.Tensor, moments) -> StepState:
    other = torch.ones(3, dtype=torch.bfloat16)
    return StepState([("a.weight", weight), ("b.bias", other)],
                     [slot(0, "a.weight", weight.shape), slot(1, "b.bias", other.shape)],
                     [ParamTensors(weight, main, moments), ParamTensors(other, None, {})])


def test_a_bad_weight_its_main_copy_and_a_bad_moment_are_each_named_with_their_counts():
    weight = torch.ones(2, 4, dtype=torch.bfloat16)
    weight[1, 2] = float("nan")
    main = weight.float()
    exp_avg = torch.zeros(2, 4)
    exp_avg.view(-1)[:2] = float("inf")
    exp_avg_sq = torch.ones(2, 4)
    exp_avg_sq.view(-1)[3] = -1.0
    found, extra = state_fields(state(weight, main, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}),
                                {"a.weight": 7}, None)
    assert [(p["name"], p["copy"], p["id"], p["nan"], p["first_bad_index"]) for p in found] == [
        ("a.weight", "model", 7, 1, [1, 2]), ("a.weight", "main", 0, 1, [1, 2])]
    assert [(f["state"], f["nan"], f["inf"], f["negative"]) for f in extra["optimizer_state"]] == [
        ("exp_avg", 0, 2, 0), ("exp_avg_sq", 0, 0, 1)]
    assert extra["optimizer_state_total"] == 2 and extra["optimizer_state_checked"] == 2
    assert extra["params_checked"] == 2 and extra["launch_weights_finite"] is None


def test_a_healthy_state_names_nothing():
    weight = torch.ones(2, 4, dtype=torch.bfloat16)
    found, extra = state_fields(state(weight, weight.float(), {"exp_avg_sq": torch.zeros(2, 4)}), {},
                                torch.tensor(True))
    assert found == [] and extra["optimizer_state"] == [] and extra["launch_weights_finite"] is True


def test_a_negative_moment_is_read_where_it_can_explain_a_bad_weight():
    """The signs are read for the parameters whose stepped copy is non-finite only: a negative moment
    beside finite weights has made nothing non-finite yet (its NaN/Inf would still be named)."""
    weight = torch.ones(2, 4, dtype=torch.bfloat16)
    exp_avg_sq = -torch.ones(2, 4)
    _, extra = state_fields(state(weight, weight.float(), {"exp_avg_sq": exp_avg_sq}), {}, None)
    assert extra["optimizer_state"] == []
    main = weight.float()
    main[0, 0] = float("inf")
    _, extra = state_fields(state(weight, main, {"exp_avg_sq": exp_avg_sq}), {}, None)
    assert [(f["state"], f["negative"]) for f in extra["optimizer_state"]] == [("exp_avg_sq", 8)]
    exp_avg_sq[1, 1] = float("nan")
    _, extra = state_fields(state(weight, weight.float(), {"exp_avg_sq": exp_avg_sq}), {}, None)
    assert [(f["state"], f["nan"], f["negative"]) for f in extra["optimizer_state"]] == [("exp_avg_sq", 1, 0)]


def test_the_digest_tells_equal_weights_from_ones_that_differ_by_one_bit():
    weights = [("a", torch.arange(8, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    copy = [(name, tensor.clone()) for name, tensor in weights]
    assert weights_digest(weights) == weights_digest(list(reversed(copy)))  # by name, not by order
    copy[0][1].view(torch.int32)[5] ^= 1
    assert weights_digest(weights) != weights_digest(copy)


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 24])
def test_every_flipped_bit_of_every_weight_changes_the_digest_however_weights_are_chunked(chunk):
    """Weights of three dtypes and odd shapes (a 0-dim one, a transposed one), summed in runs of
    ``chunk`` elements: a flip of the sign, of an exponent bit or of the lowest mantissa bit of any
    element changes the digest; an equal copy does not."""
    weights = [("emb", torch.randn(5, 3, dtype=torch.bfloat16)), ("gain", torch.tensor(2.0)),
               ("proj", torch.randn(4, 6).t()), ("scale", torch.randn(9, dtype=torch.float16)),
               ("bias", torch.zeros(7))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights_module, "DIGEST_CHUNK_ELEMENTS", chunk)
        reference = weights_digest(weights)
        assert weights_digest([(name, tensor.clone()) for name, tensor in weights]) == reference
        for position, (_, tensor) in enumerate(weights):
            width = tensor.element_size() * 8
            for element in range(tensor.numel()):
                for bit in (0, width - 2, width - 1):
                    copy = [(name, value.clone().contiguous()) for name, value in weights]
                    bits = copy[position][1].view(-1).view({2: torch.int16, 4: torch.int32}[width // 8])
                    bits[element] ^= (1 << bit) if bit < width - 1 else -(1 << bit)
                    assert weights_digest(copy) != reference, (position, element, bit)


def test_the_digest_of_hundreds_of_weights_takes_a_few_operators():
    """245 separate weights (a 20-layer GPT's): a few kernels, not two per tensor."""
    weights = [(f"w{index}", torch.ones(64, 3, dtype=torch.bfloat16)) for index in range(245)]
    with OperatorCounter() as ops:
        weights_digest(weights)
    assert ops.total < 10


def test_the_launch_flag_is_a_device_flag_of_every_weight():
    huge = torch.tensor([3e38, 1.0], dtype=torch.bfloat16)  # finite, its square is not
    assert bool(finite_flag([("a", huge), ("b", torch.zeros(2))]))
    assert not bool(finite_flag([("a", huge), ("b", torch.tensor([0.0, float("-inf")]))]))
    assert finite_flag([]) is None
