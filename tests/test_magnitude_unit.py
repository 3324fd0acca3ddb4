"""Issue 23, case 5, unit level: the magnitude path's pure decisions (``gradnan.formats.magnitude``), on
synthetic module frames (``training.frames.first_growth``), frames as manifests write them, and op traces
replayed (``FirstGrowth``); and how the replay judges a module whose inputs already grew upstream."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradnan.decision.causes import decide
from gradnan.decision.evidence import Evidence
from gradnan.decision.facts import Fact
from gradnan.errors import InputError
from gradnan.formats.incident import Conclusion
from gradnan.formats.magnitude import GROWTH_FACTOR, LIMIT_MARGIN, first_grown_frame, grew, magnitude_text
from gradnan.formats.records import DTYPE_MAX, from_json
from gradnan.formats.wording import growth_log, growth_path
from gradnan.offline.replay.command import _growth, _upstream
from gradnan.offline.replay.text import growth_text
from gradnan.offline.replay.trace import replay
from gradnan.training.frames import Frame, first_growth
from gradnan.training.recorder import OpRecorder

BF16, FP16 = "torch.bfloat16", "torch.float16"


def test_a_jump_of_2_to_the_20_over_every_input_and_weight_is_growth_and_less_is_not():
    assert grew(3.0, 3.0 * GROWTH_FACTOR * 1.01, BF16) is not None
    assert grew(3.0, 3.0 * GROWTH_FACTOR * 0.99, BF16) is None
    found = grew(2.90625, 3.9e28, BF16)
    assert found is not None and not found.near_limit
    # tiny inputs normalised to a few units (a LayerNorm of 1e-7 values) are no growth: the floor of 1
    assert grew(1e-7, 3.0, BF16) is None and grew(None, 3.0, BF16) is None
    assert grew(3.0, math.inf, BF16) is None and grew(3.0, math.nan, BF16) is None


def test_coming_within_16x_of_the_dtypes_limit_is_growth_unless_an_input_already_was():
    assert grew(3.0, DTYPE_MAX[FP16] / LIMIT_MARGIN, FP16).near_limit
    assert grew(3.0, DTYPE_MAX[FP16] / LIMIT_MARGIN / 2, FP16) is None  # 2047 in fp16: healthy
    assert grew(60000.0, 60000.0, FP16) is None  # passing on a weight already there (a transpose)
    assert grew(3.0, DTYPE_MAX[BF16] / 8, BF16).near_limit


def frame(call, module, cls, weights=(), inputs=(), outputs=(), dtype=BF16):
    """A traced call with the given abs-max values (abs-min 0); None: an integer input, not measured."""
    entries = ([("weight", w) for w in weights] + [("input", x) for x in inputs]
               + [("output", y) for y in outputs])
    return Frame(step=2, module=module, cls=cls, call=call, names=[f"e{i}" for i in range(len(entries))],
                 kinds=[kind for kind, _ in entries], dtypes=[dtype] * len(entries),
                 stats=list(range(len(entries))),
                 values=[None if value is None else (0.0, value) for _, value in entries])


def healthy_layer(start=0):
    return [frame(start, "decoder.layers.0.input_layernorm", "LayerNorm", (1.0, 0.001), (0.097,), (2.97,)),
            frame(start + 1, "decoder.layers.0.mlp.linear_fc1", "ColumnParallelLinear", (0.076, 0.001),
                  (2.9,), (0.43, 0.001)),
            frame(start + 2, "embedding", "Embedding", (0.08,), (None,), (0.08,))]


def test_the_first_call_whose_output_grew_is_named_the_deepest_before_its_parent():
    frames = healthy_layer() + [
        frame(3, "decoder.layers.0.mlp", "MLP", (), (2.90625,), (3.9e28, 0.001)),
        frame(4, "decoder.layers.0", "TransformerLayer", (), (0.097, None), (3.9e28,)),
        frame(5, "decoder.layers.1.input_layernorm", "LayerNorm", (1.0, 0.001), (3.9e28,), (math.nan,))]
    grown, growth = first_growth(frames)
    assert (grown.module, growth.inputs_abs_max, growth.output_abs_max) == ("decoder.layers.0.mlp", 2.90625,
                                                                             3.9e28)
    assert first_growth(healthy_layer()) is None


def test_growth_after_the_first_nonfinite_call_is_aftermath_and_not_named():
    frames = healthy_layer() + [
        frame(3, "decoder.layers.0.mlp", "MLP", (), (2.9,), (math.inf,)),
        frame(4, "decoder.layers.1.mlp", "MLP", (), (2.9,), (3.9e28,))]
    assert first_growth(frames) is None


def test_frames_as_manifests_write_them_are_judged_alike_and_malformed_entries_ignored():
    written = [f.to_json() for f in healthy_layer()]
    grown = frame(3, "decoder.layers.0.mlp", "MLP", (), (2.9,), (3.9e28,)).to_json()
    nonfinite = frame(4, "x", "X", (), ("nan",), (1e30,)).to_json()
    nonfinite["entries"][0]["abs_max"] = "nan"
    odd = {"module": "odd", "class": "Odd", "entries": [{"kind": "output", "dtype": [], "abs_max": "big"}]}
    assert first_grown_frame(written + [odd, nonfinite]) is None
    found, growth = first_grown_frame(written + [odd, grown])
    assert found["module"] == "decoder.layers.0.mlp" and growth.output_abs_max == 3.9e28


class Grows(nn.Module):
    """exp of 30 (1.1e13: grown), then squared twice: 1.2e26, then past bf16's range (inf)."""

    def forward(self, x):
        y = torch.exp(x)
        y = y * y
        return y * y


class Halves(nn.Module):
    def forward(self, x):
        return (x * 0.5) + x


def recorded(module, x):
    recorder = OpRecorder()
    recorder.mark_inputs([x], "args")
    with recorder:
        outputs = module(x)
    return recorder.result(outputs)


def test_replay_names_the_first_operator_that_grew_before_the_first_nonfinite_one():
    result = replay(recorded(Grows(), torch.tensor([3.0, 30.0], dtype=torch.bfloat16)))
    assert result.first_nonfinite["op"] == "aten.mul.Tensor" and result.first_nonfinite["index"] == 2
    growth = result.first_growth
    assert (growth["index"], growth["op"], growth["inputs_abs_max"]) == (0, "aten.exp.default", 30.0)
    assert growth["output_abs_max"] > 1e13 and growth["dtype"] == BF16
    assert replay(recorded(Halves(), torch.tensor([3.0, -2.0], dtype=torch.bfloat16))).first_growth is None
    text = growth_text({"where": "operator", **growth})
    assert text == "grew out of line at aten.exp.default (30 -> 1.07e13)"


def manifest(frames, grew_in=None, module="decoder.layers.1.input_layernorm"):
    return {"module": {"path": module}, "frames": frames, **({"grew_in": grew_in} if grew_in else {})}


GROWN_INPUT = {"leaf": "args.0", "abs_max": 3.9e28, "dtype": BF16}


def test_replay_blames_the_upstream_growth_when_the_inputs_already_were_out_of_line():
    frames = [f.to_json() for f in healthy_layer()] + [
        frame(3, "decoder.layers.0.mlp", "MLP", (), (2.90625,), (3.9e28,)).to_json(),
        frame(4, "decoder.layers.1.input_layernorm", "LayerNorm", (1.0,), (3.9e28,), (math.nan,)).to_json()]
    growth = _growth(manifest(frames), None, GROWN_INPUT)
    assert (growth["where"], growth["module"]) == ("upstream", "decoder.layers.0.mlp")
    assert growth["output_abs_max"] == 3.9e28
    assert growth_text(growth) == ("the module's inputs were already out of line (args.0 abs-max 3.9e28): the"
                                   " value grew before this module, in decoder.layers.0.mlp (MLP) (2.91 ->"
                                   " 3.9e28)")
    # inputs of a few units: the module's own operator is to blame, whatever grew upstream
    assert _growth(manifest(frames), None, {**GROWN_INPUT, "abs_max": 3.0}) is None
    # the frames show no growth (the demo's 1e21 attention inputs from 1e20 weights): the operator's
    assert _growth(manifest(frames[:3]), None, {**GROWN_INPUT, "abs_max": 1e21}) is None
    # no frames, but inputs near the dtype's limit: upstream, unnamed
    near = _growth(manifest([]), None, {**GROWN_INPUT, "abs_max": 3e37})
    assert near["where"] == "upstream" and near["module"] is None
    assert growth_text(near).endswith("the value grew before this module")


def test_the_manifests_grew_in_is_preferred_and_its_own_module_is_not_upstream():
    grew_in = {"module": "decoder.layers.0.mlp", "class": "MLP", "call": 18, "micro_batch": 0,
               "inputs_abs_max": 2.9, "output_abs_max": 3.9e28, "dtype": BF16, "near_limit": False}
    assert _upstream(manifest([], grew_in))["module"] == "decoder.layers.0.mlp"
    assert _upstream(manifest([], grew_in, module="decoder.layers.0.mlp")) is None
    assert _upstream(manifest([], {**grew_in, "call": "x"})) is None  # malformed: not trusted


GREW_IN = {"module": "decoder.layers.0.mlp", "class": "MLP", "call": 18, "micro_batch": 0,
           "inputs_abs_max": 2.90625, "output_abs_max": 3.899511123748948e28, "dtype": BF16,
           "near_limit": False}


def test_the_wording_of_the_magnitude_path_in_the_log_headline_and_verdict():
    assert magnitude_text(3.899511123748948e28) == "3.9e28" and magnitude_text(2.90625) == "2.91"
    assert magnitude_text(1.5e-7) == "1.5e-7" and magnitude_text(None) == "none"
    assert growth_log(GREW_IN, "decoder.layers.1.input_layernorm", "LayerNorm") == (
        "values first grew out of line in decoder.layers.0.mlp (MLP) (2.91 -> 3.9e28), then went non-finite"
        " in decoder.layers.1.input_layernorm (LayerNorm)")
    assert growth_path(GREW_IN, "decoder.layers.1.input_layernorm", "LayerNorm") == (
        "decoder.layers.0.mlp (MLP) grew a value to 3.9e28 (from 2.91), which went non-finite in"
        " decoder.layers.1.input_layernorm (LayerNorm)")
    near = {**GREW_IN, "output_abs_max": 6e4, "dtype": FP16, "near_limit": True}
    assert growth_log(near, None, None).endswith("(2.91 -> 6e4, within 16x of the float16 limit)")
    summary = decide(Evidence(step=2, iteration=None, labels={1: "rank 1"}, rerun=Conclusion.REPRODUCIBLE,
                              rerun_module="decoder.layers.1.input_layernorm", rerun_origins=(1,),
                              micro_batch=0, grew_in=GREW_IN,
                              observed=frozenset({Fact.RERUN, Fact.STATES}))).summary
    assert ("in decoder.layers.1.input_layernorm, after decoder.layers.0.mlp (MLP) grew a value out of line"
            " (2.91 -> 3.9e28) on rank 1, micro-batch 0") in summary


def rerun_record(**extra):
    return {"schema": "gradnan.record", "version": 1, "kind": "rerun", "step": 2, "iteration": None,
            "time": 1.0, "rank": {"global_rank": 1, "world_size": 2, "host": "h", "device": "cpu"},
            "run": {"id": "r", "start": 1.0}, "params": [], "params_total": 0, "role": "origin",
            "conclusion": "reproducible", "module": "m", "class": "C", "call": 3, "micro_batch": 0,
            "output_abs_max": "nan", "frames_traced": 20, "bundle": None, "batch": None, **extra}


def test_the_records_reader_accepts_grew_in_optional_and_refuses_a_malformed_one():
    from_json(rerun_record(), "f:1")  # written before the field existed
    from_json(rerun_record(grew_in=None), "f:1")
    from_json(rerun_record(grew_in=GREW_IN), "f:1")
    for bad in ({**GREW_IN, "output_abs_max": "inf"}, {**GREW_IN, "call": None}, {**GREW_IN, "near_limit": 1},
                "decoder.layers.0.mlp"):
        with pytest.raises(InputError, match="grew_in"):
            from_json(rerun_record(grew_in=bad), "f:1")
