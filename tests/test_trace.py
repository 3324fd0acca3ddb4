"""Op traces: record a module call, replay it without the module, bitwise; find the first NaN/Inf op."""

from __future__ import annotations

import copy
import gc
import json
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradnan.formats.trace import SCHEMA as TRACE
from gradnan.formats.trace import Trace, digest
from gradnan.formats.trace_findings import FirstNonFinite
from gradnan.formats.trace_ops import TraceError
from gradnan.offline.replay.command import garbage_dependent, op_digests
from gradnan.offline.replay.comparison import compare, format_comparison, output_difference
from gradnan.offline.replay.trace import replay
from gradnan.training.recorder import OpRecorder


def record(module, *args, **kwargs):
    """The trace of one call, with the inputs and parameters named, and the call's real outputs."""
    recorder = OpRecorder()
    recorder.mark_inputs(list(args), "args")
    recorder.mark_inputs(kwargs, "kwargs")
    recorder.mark_inputs(dict(module.named_parameters()), "param")
    with recorder:
        outputs = module(*args, **kwargs)
    return recorder.result(outputs), outputs


def real_grads(module, inputs, outputs, grad_output):
    """The module's own autograd gradients, by the names the recorder gives them."""
    outputs.backward(grad_output)
    grads = {f"args.{i}": x.grad for i, x in enumerate(inputs) if x.requires_grad}
    grads.update({f"param.{name}": p.grad for name, p in module.named_parameters()})
    return grads


class Attention(nn.Module):
    """Single-head softmax attention; masked positions get -inf (a legitimate non-finite value)."""

    def __init__(self, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, attention_mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(attention_mask, float("-inf"))
        return self.proj(torch.softmax(scores, dim=-1) @ v)


class InPlaceViews(nn.Module):
    """In-place ops on activations and on views of them, transposes and reshapes."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.shift = nn.Parameter(torch.randn(width))

    def forward(self, x):
        h = self.linear(x)
        flat = h.view(-1)
        flat[::2].mul_(0.5)  # through a view: must reach ``h`` at replay too
        h.relu_()
        h = h.transpose(0, 1).reshape(-1)  # flattening a transpose copies
        h = h.view(x.shape[1], -1).t()
        return h.add_(self.shift) * 2


def modules():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return {"linear": nn.Linear(8, 8), "layernorm": nn.LayerNorm(8), "mlp": mlp,
            "attention": Attention(8), "inplace_views": InPlaceViews(8)}


def call_inputs(name, dtype):
    x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    kwargs = ({"attention_mask": torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)} if name == "attention"
              else {})
    return x, kwargs


MODULE_NAMES = list(modules())


# --- replay equals the module -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODULE_NAMES)
def test_replay_outputs_equal_module_outputs_bitwise(name, dtype):
    module = modules()[name].to(dtype)
    x, kwargs = call_inputs(name, dtype)
    trace, outputs = record(module, x, **kwargs)
    result = replay(trace)
    assert result.outputs.dtype == dtype
    assert torch.equal(result.outputs, outputs)
    assert trace.first_nonfinite is None and result.first_nonfinite is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODULE_NAMES)
def test_replay_gradients_equal_module_gradients(name, dtype):
    module = modules()[name].to(dtype)
    x, kwargs = call_inputs(name, dtype)
    trace, outputs = record(module, x, **kwargs)
    grad_output = torch.randn_like(outputs)
    expected = real_grads(module, [x], outputs, grad_output)
    result = replay(trace, grad_outputs=grad_output, grad_leaves=sorted(expected))
    assert set(result.grads) == set(expected)
    for leaf, grad in expected.items():
        assert torch.equal(result.grads[leaf], grad), leaf  # the same ops, so the same backward


def test_leaves_are_the_named_inputs_only_and_op_names_are_overloads():
    module = nn.Linear(8, 4)
    trace, _ = record(module, torch.randn(3, 8))
    assert set(trace.leaves) == {"args.0", "param.weight", "param.bias"}  # no activation is stored
    assert [op["op"] for op in trace.ops] == ["aten.t.default", "aten.addmm.default"]


def test_attention_mask_is_a_named_kwarg_leaf_and_its_inf_is_not_blamed():
    module = modules()["attention"]
    x, kwargs = call_inputs("attention", torch.float32)
    trace, _ = record(module, x, **kwargs)
    assert torch.equal(trace.leaves["kwargs.attention_mask"], kwargs["attention_mask"])
    assert any(op["op"] == "aten.masked_fill.Scalar" and {"float": "-inf"} in op["args"] for op in trace.ops)
    assert trace.first_nonfinite is None


def test_leaf_is_cloned_before_the_module_mutates_it_and_replay_leaves_the_trace_intact():
    class MutatesInput(nn.Module):
        def forward(self, x):
            return x.mul_(2) + 1

    x = torch.arange(4.0)
    trace, outputs = record(MutatesInput(), x)
    assert torch.equal(trace.leaves["args.0"], torch.arange(4.0))
    assert torch.equal(replay(trace).outputs, outputs)
    assert torch.equal(replay(trace, grad_outputs=torch.ones(4)).grads["args.0"], torch.full((4,), 2.0))
    assert torch.equal(trace.leaves["args.0"], torch.arange(4.0))


def test_output_tree_with_tuples_dicts_none_and_an_unconsumed_input():
    class Tree(nn.Module):
        def forward(self, x, y):
            return (x * 3, None, {"sum": x.sum(), "passthrough": y, "count": 2})

    x, y = torch.randn(3, requires_grad=True), torch.randn(2)
    trace, outputs = record(Tree(), x, y)
    assert "args.1" in trace.leaves  # returned without an op consuming it: still needed
    result = replay(trace, grad_outputs=(torch.ones(3), None, {"sum": torch.tensor(1.0), "passthrough": None,
                                                                 "count": None}), grad_leaves=["args.0"])
    product, none, extra = result.outputs
    assert torch.equal(product, outputs[0]) and none is None and extra["count"] == 2
    assert torch.equal(extra["passthrough"], y) and torch.equal(extra["sum"], outputs[2]["sum"])
    assert torch.equal(result.grads["args.0"], torch.full((3,), 4.0))
    with pytest.raises(TraceError, match="structure"):
        replay(trace, grad_outputs=(torch.ones(3), None))


def test_recorder_keeps_no_activation_alive():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    recorder = OpRecorder()
    with recorder:
        hidden = module[0](x)
        outputs = module[1](hidden)
    trace = recorder.result(outputs)
    alive = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert alive() is None
    assert torch.equal(replay(trace).outputs, outputs)


# --- the first non-finite op ------------------------------------------------------------------


def overflowing_linear():
    """fp16 tops out at 65504; 4 * 300 * 300 = 360000 overflows in the matmul."""
    module = nn.Linear(4, 2).half()
    with torch.no_grad():
        module.weight.fill_(300.0)
        module.bias.zero_()
    return module, torch.full((3, 4), 300.0, dtype=torch.float16)


def test_fp16_overflow_names_the_matmul_at_record_and_at_replay_not_in_float64():
    module, x = overflowing_linear()
    trace, outputs = record(module, x)
    assert not torch.isfinite(outputs).any()
    first = trace.first_nonfinite
    assert first is not None and first["op"] == "aten.addmm.default"
    assert trace.ops[first["index"]]["op"] == first["op"]
    same = replay(trace)
    assert same.first_nonfinite == {**first, "phase": "forward"}
    assert torch.equal(same.outputs, outputs)
    wide = replay(trace, dtype=torch.float64)
    assert wide.first_nonfinite is None
    assert torch.equal(wide.outputs, torch.full((3, 2), 360000.0, dtype=torch.float64))


def test_an_input_that_is_already_nan_blames_no_op():
    module = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    x = torch.randn(2, 4)
    x[0, 1] = float("nan")
    trace, outputs = record(module, x)
    assert torch.isnan(outputs).any()
    assert trace.first_nonfinite is None
    assert replay(trace).first_nonfinite is None


def test_a_nonfinite_backward_is_named_with_its_phase():
    class Sqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return torch.sqrt(x) * self.scale  # finite at 0; its derivative is not

    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    trace, outputs = record(Sqrt(), x)
    assert torch.isfinite(outputs).all() and trace.first_nonfinite is None
    result = replay(trace, grad_outputs=torch.ones(3), grad_leaves=["args.0"])
    assert result.first_nonfinite is not None
    assert result.first_nonfinite["phase"] == "backward" and result.first_nonfinite["op"] == "aten.div.Tensor"
    assert torch.isinf(result.grads["args.0"][0])
    assert replay(trace).first_nonfinite is None  # no backward asked, none watched


def test_ops_returning_uninitialized_memory_are_never_blamed():
    """``torch.empty`` may hold any bit pattern, NaN included: that is garbage, not an overflow."""
    garbage = torch.tensor([float("nan")])
    empty, exp = FirstNonFinite(), FirstNonFinite()
    empty.check(0, "aten.empty.memory_format", True, garbage)
    exp.check(0, "aten.exp.default", True, garbage)
    assert empty.found is None and exp.found == {"index": 0, "op": "aten.exp.default"}


# --- dtypes, RNG, ops that are not executed ---------------------------------------------------


def test_cast_replay_maps_floating_dtype_arguments():
    class Upcasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.linear(x).float(), dim=-1).to(torch.bfloat16)

    module = Upcasts().to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    trace, outputs = record(module, x)
    assert any(op["kwargs"].get("dtype") == {"dtype": "float32"} for op in trace.ops)
    wide = replay(trace, dtype=torch.float64)
    assert wide.outputs.dtype == torch.float64
    assert torch.allclose(wide.outputs, outputs.double(), atol=1e-2)
    assert not torch.equal(wide.outputs, outputs.double())  # really computed wider, not copied


def test_cast_replay_drops_half_to_float():
    """CUDA's F.softmax(fp16, dtype=float32) is ``_softmax(x, dim, half_to_float=True)``: legal for fp16
    only."""
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float16)
    ops = [{"op": "aten._softmax.default", "args": [{"t": "x"}, -1, True], "kwargs": {}, "out": {"t": "%0"}}]
    trace = Trace(ops=ops, leaves={"x": x}, outputs={"t": "%0"}, first_nonfinite=None)
    result = replay(trace, dtype=torch.float64)
    assert torch.allclose(result.outputs, torch.softmax(x.double(), -1))


def test_dropout_replays_only_from_the_restored_rng_state():
    module = nn.Dropout(0.5).train()
    x = torch.randn(1000)
    torch.manual_seed(3)
    trace, outputs = record(module, x)
    assert any(op["op"].startswith("aten.bernoulli") for op in trace.ops)
    torch.manual_seed(3)
    assert torch.equal(replay(trace).outputs, outputs)
    assert not torch.equal(replay(trace).outputs, outputs)


def test_an_op_with_an_opaque_argument_is_marked_and_refused_at_replay():
    class Noise(nn.Module):
        def forward(self, x):
            return x + torch.rand(x.shape, generator=torch.Generator().manual_seed(0))

    trace, _ = record(Noise(), torch.zeros(3))
    marked = [op for op in trace.ops if op.get("opaque")]
    assert [op["op"] for op in marked] == ["aten.rand.generator"]
    assert {"opaque": "Generator"} in marked[0]["kwargs"].values()
    with pytest.raises(TraceError, match="opaque") as info:
        replay(trace)
    assert "\n" not in str(info.value)


@torch.library.custom_op("gradnan_test::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_is_not_executed_its_output_is_a_leaf():
    class UsesCustomOp(nn.Module):
        def forward(self, x):
            return _triple(x + 1) - 1

    x = torch.randn(4)
    trace, outputs = record(UsesCustomOp(), x)
    external = [op for op in trace.ops if op.get("external")]
    assert [op["op"] for op in external] == ["gradnan_test.triple.default"]
    produced = external[0]["out"]["t"]
    assert torch.equal(trace.leaves[produced], (x + 1) * 3)
    document = json.loads(json.dumps(trace.to_json()))
    assert torch.equal(replay(Trace.from_json(document, trace.leaves)).outputs, outputs)


# --- collectives ------------------------------------------------------------------------------


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's row-parallel reduction: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        partial = self.linear(x)
        reduced = _ReduceFromTensorParallel.apply(partial)
        gathered = torch.distributed._functional_collectives.all_reduce(reduced, "sum", dist.group.WORLD)
        return torch.nn.functional.gelu(gathered)


def test_collectives_are_recorded_and_replay_as_identity(world_of_one):
    module = RowParallel()
    x = torch.randn(3, 4, requires_grad=True)
    trace, outputs = record(module, x)
    collectives = [op["op"] for op in trace.ops if op.get("collective")]
    assert "c10d.allreduce_.default" in collectives and "_c10d_functional.all_reduce.default" in collectives
    document = json.loads(json.dumps(trace.to_json(), allow_nan=False))
    loaded = Trace.from_json(document, trace.leaves)
    grad_output = torch.randn_like(outputs)
    expected = real_grads(module, [x], outputs, grad_output)
    result = replay(loaded, grad_outputs=grad_output, grad_leaves=sorted(expected))
    assert torch.equal(result.outputs, outputs)
    for leaf, grad in expected.items():
        assert torch.allclose(result.grads[leaf], grad), leaf


def _replayed_as(trace, name):
    """The parts of a ``replay_bundle(..., digests=True)`` document that a comparison reads, for ``trace``
    replayed here in its captured dtype, as environment ``name``."""
    rank = {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0, "host": "h", "device": "cpu"}
    replayed = replay(trace, device="cpu", digests=True)
    refilled = replay(trace, device="cpu", digests=True, uninitialized_fill=1).digests
    return {"bundle": "b", "module": {"path": "m", "class": "RowParallel"}, "step": 1, "rank": rank,
            "digests": op_digests(trace, replayed.digests, replayed.reference_digests,
                                  garbage_dependent(trace, replayed.digests, refilled)),
            "environment": {"python": name, "versions": {}}, "verdict": "healthy", "summary": "",
            "runs": {"captured": {"first_nonfinite": None}}}


def test_against_the_capture_a_collective_is_skipped_and_what_follows_it_is_flagged_as_after_it(world_of_one):
    trace, _ = record(RowParallel(), torch.randn(3, 4))
    collective = next(index for index, op in enumerate(trace.ops) if op.get("collective"))
    # what a tensor-parallel peer's partial sum makes of the capture: the all-reduce's output and after
    for entry in trace.digests[collective:]:
        for item in entry:
            item["hash"] = "0" * 32
    document = compare([_replayed_as(trace, "A"), _replayed_as(trace, "B")], {}, "cpu", None)
    against_capture, _, between = document["pairs"]  # capture vs A, capture vs B, A vs B
    assert against_capture["after_collective"] == collective
    assert against_capture["first_difference"]["index"] > collective  # the collective itself is not compared
    assert between["first_difference"] is None and between["compared"] == len(trace.ops)
    text = format_comparison(document)
    assert f"(after the collective at op #{collective}, which replays as identity" in text


def test_a_tolerance_in_ulps_forgives_one_ulp_and_not_a_non_finite_value():
    x = torch.linspace(-3, 3, 64, dtype=torch.bfloat16)
    nudged = x.clone()
    nudged[-1] = 3 + 2 ** -6  # the abs-max, 3, one bf16 ulp up
    assert output_difference([digest(x)], [digest(nudged)], None) == "output 0: its bytes differ"
    assert output_difference([digest(x)], [digest(nudged)], 1) is None
    assert "abs_max 3 against 3.02, more than 0 ulps" in output_difference([digest(x)], [digest(nudged)], 0)
    broken = x.clone()
    broken[0] = math.inf
    assert output_difference([digest(x)], [digest(broken)], 100) == "output 0: 0 non-finite against 1"
    assert "float32" in output_difference([digest(x)], [digest(x.float())], 100)


def test_a_collective_that_changes_shapes_is_refused():
    ops = [{"op": "aten.empty.memory_format", "args": [[4]], "kwargs": {}, "out": {"t": "%0"}},
           {"op": "c10d._allgather_base_.default", "collective": True, "opaque": True,
            "args": [{"t": "%0"}, {"t": "x"}, {"opaque": "ScriptObject"}, False, -1], "kwargs": {},
            "out": {"tuple": [{"t": "%0"}, {"opaque": "ScriptObject"}]}}]
    trace = Trace(ops=ops, leaves={"x": torch.ones(2)}, outputs={"t": "%0"}, first_nonfinite=None)
    with pytest.raises(TraceError, match="identity"):
        replay(trace)
    trace.leaves["x"] = torch.arange(4.0)
    assert torch.equal(replay(trace).outputs, torch.arange(4.0))  # world size 1: a copy


# --- JSON round trip and refusals -------------------------------------------------------------


def saved_and_loaded(trace, tmp_path):
    document = json.loads(json.dumps(trace.to_json(), allow_nan=False))
    torch.save(trace.leaves, tmp_path / "leaves.pt")
    return document, torch.load(tmp_path / "leaves.pt", weights_only=True)


def test_round_trip_through_json_and_weights_only_load(tmp_path):
    module = modules()["attention"].to(torch.bfloat16)
    x, kwargs = call_inputs("attention", torch.bfloat16)
    trace, outputs = record(module, x, **kwargs)
    document, leaves = saved_and_loaded(trace, tmp_path)
    loaded = Trace.from_json(document, {**leaves, "rng.cpu": torch.get_rng_state()})
    assert set(loaded.leaves) == set(trace.leaves)  # unrelated tensors beside the leaves are left out
    assert torch.equal(replay(loaded, device="cpu").outputs, outputs)


def _set(path, value):
    def mutate(document):
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


REFUSALS = {
    "future version": (_set(["version"], TRACE.version + 1), "newer"),
    "other schema": (_set(["schema"], "gradnan.bundle"), "not a gradnan.trace"),
    "version true": (_set(["version"], True), "version"),
    "extra key": (_set(["code"], "print(1)"), "exactly the keys"),
    "builtins.eval": (_set(["ops", 0, "op"], "builtins.eval"), "not on the replay allowlist"),
    "os.system": (_set(["ops", 0, "op"], "os.system.default"), "not on the replay allowlist"),
    "aten dunder": (_set(["ops", 0, "op"], "aten.__class__.default"), "not on the replay allowlist"),
    "allowed op, no such overload": (_set(["ops", 0, "op"], "aten.mm.nonesuch"), "does not exist"),
    "aten.from_file": (_set(["ops", 0, "op"], "aten.from_file.default"), "not on the replay allowlist"),
    "missing tensor": (_set(["ops", 0, "args", 0], {"t": "%99"}), "no leaf or earlier op"),
    "reference not a string": (_set(["ops", 0, "args", 0], {"t": 5}), "malformed value"),
    "unknown tag": (_set(["ops", 0, "args", 0], {"pickle": "x"}), "malformed value"),
    "args not a list": (_set(["ops", 0, "args"], "x"), "must be a list"),
    "unknown dtype": (_set(["ops", 1, "kwargs", "dtype"], {"dtype": "__class__"}), "unknown dtype"),
    "bad device": (_set(["ops", 1, "kwargs", "device"], {"device": "toaster:9"}), "malformed device"),
    "unknown op key": (_set(["ops", 0, "python"], "x"), "malformed entry"),
    "fake collective": (_set(["ops", 0, "collective"], True), "not a c10d op"),
    "unmarked opaque": (_set(["ops", 0, "args", 1], {"opaque": "Generator"}), "'opaque' must mark"),
    "leaf shape": (_set(["leaves", "args.0", "shape"], [9]), "is not the"),
    "missing leaf": (_set(["leaves", "ghost"], {"shape": [], "dtype": "float32"}), "missing"),
    "output reference": (_set(["outputs"], {"t": "ghost"}), "the outputs use"),
    "first_nonfinite": (_set(["first_nonfinite"], {"index": "0"}), "first_nonfinite"),
    "digests of another length": (_set(["digests"], []), "one entry per op"),
    "digest hash not hex": (_set(["digests", 0, 0, "hash"], "x" * 32), "digests of op 0"),
    "digest count": (_set(["digests", 0, 0, "nonfinite"], -1), "digests of op 0"),
    "digest magnitude inf": (_set(["digests", 0, 0, "abs_max"], math.inf), "digests of op 0"),
    "digest dtype": (_set(["digests", 0, 0, "dtype"], "__class__"), "digests of op 0"),
    "digest extra key": (_set(["digests", 0, 0, "code"], 1), "digests of op 0"),
    "digests in a version 2 trace": (_set(["version"], 2), "exactly the keys"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_from_json_refuses_malformed_documents_with_one_line(case, tmp_path):
    class Casts(nn.Module):
        def forward(self, x):
            return (x + 1).to(torch.float64)

    trace, _ = record(Casts(), torch.randn(2))
    document, leaves = saved_and_loaded(trace, tmp_path)
    assert Trace.from_json(copy.deepcopy(document), leaves).ops == document["ops"]  # the intact one passes
    mutate, message = REFUSALS[case]
    mutate(document)
    with pytest.raises(TraceError, match=message) as info:
        Trace.from_json(document, leaves)
    assert "\n" not in str(info.value)


def test_each_op_records_the_digest_of_its_outputs_and_a_replay_takes_the_same():
    module = modules()["mlp"].to(torch.bfloat16)
    x, _ = call_inputs("mlp", torch.bfloat16)
    x.data[0, 0] = math.inf
    trace, outputs = record(module, x)
    assert trace.to_json()["version"] == TRACE.version == 4
    assert len(trace.digests) == len(trace.ops)
    last = trace.digests[-1][0]  # the module's output, as the recorder saw it
    assert last == digest(outputs) and last["dtype"] == "bfloat16" and last["shape"] == [6, 8]
    values = outputs.detach()
    assert last["nonfinite"] > 0 and last["abs_max"] == float(values[torch.isfinite(values)].abs().max())
    again = replay(trace, device="cpu", digests=True).digests
    assert again == trace.digests
    widened = replay(trace, dtype=torch.float32, device="cpu", digests=True).digests
    assert widened[-1][0]["hash"] != last["hash"] and widened[-1][0]["dtype"] == "float32"


def test_a_digest_tells_apart_one_bit_and_nan_from_inf():
    x = torch.tensor([1.0, 2.0, math.nan], dtype=torch.float16)
    flipped = x.clone()
    flipped.view(torch.int16)[0] ^= 1
    assert digest(x)["hash"] != digest(flipped)["hash"]
    assert digest(x)["nonfinite"] == digest(flipped)["nonfinite"] == 1
    assert digest(x)["hash"] != digest(torch.tensor([1.0, 2.0, math.inf], dtype=torch.float16))["hash"]
    assert digest(x[:2])["abs_max"] == 2.0 and digest(torch.arange(3))["abs_max"] is None


def test_a_trace_recorded_without_digests_is_still_version_1_or_2(tmp_path):
    recorder = OpRecorder(digests=False)
    module, x = nn.Linear(2, 2), torch.randn(1, 2)
    recorder.mark_inputs([x], "args")
    recorder.mark_inputs(dict(module.named_parameters()), "param")
    with recorder:
        out = module(x)
    trace = recorder.result(out)
    document, leaves = saved_and_loaded(trace, tmp_path)
    assert document["version"] == 1 and "digests" not in document
    assert Trace.from_json(document, leaves).digests is None


def test_from_json_refuses_a_leaf_of_another_dtype(tmp_path):
    trace, _ = record(nn.Linear(2, 2), torch.randn(1, 2))
    document, leaves = saved_and_loaded(trace, tmp_path)
    leaves["param.weight"] = leaves["param.weight"].double()
    with pytest.raises(TraceError, match="param.weight"):
        Trace.from_json(document, leaves)


class _Call(nn.Module):
    """One tensor expression as a module, so the recorder sees exactly its ops."""

    def __init__(self, expression):
        super().__init__()
        self.expression = expression

    def forward(self, *tensors):
        return self.expression(*tensors)


NAN, HUGE = float("nan"), 3e38
ATTRIBUTION_CASES = {
    # an argument the op does not read holds NaN (uninitialized memory, a destination about to be
    # overwritten): the op that overflows is still named
    "baddbmm beta=0": (lambda buffer, q: torch.baddbmm(buffer, q, q, beta=0.0, alpha=HUGE),
                       [torch.full((1, 2, 2), NAN), torch.ones(1, 2, 2)], "aten.baddbmm.default"),
    "addmm beta=0": (lambda buffer, a: torch.addmm(buffer, a, a, beta=0, alpha=HUGE),
                     [torch.full((2, 2), NAN), torch.ones(2, 2)], "aten.addmm.default"),
    "out= destination": (lambda buf, a: torch.mul(a, HUGE * 10, out=buf),
                         [torch.full((2,), NAN), torch.ones(2)], "aten.mul.out"),
    # the same op reading its NaN: the NaN came in, the op did not make it
    "baddbmm beta=1 reads its input": (lambda buffer, q: torch.baddbmm(buffer, q, q, beta=1.0),
                                       [torch.full((1, 2, 2), NAN), torch.ones(1, 2, 2)], None),
}


@pytest.mark.parametrize("case", ATTRIBUTION_CASES)
def test_attribution_reads_only_what_the_op_reads(case):
    """The first non-finite op is decided by what each op reads, in the capture's trace and in replay,
    so the answer does not depend on what an ignored buffer happened to hold."""
    expression, inputs, expected = ATTRIBUTION_CASES[case]
    trace, _ = record(_Call(expression), *inputs)
    assert (trace.first_nonfinite or {}).get("op") == expected
    replayed = replay(Trace.from_json(json.loads(json.dumps(trace.to_json())), trace.leaves))
    assert (replayed.first_nonfinite or {}).get("op") == expected


def _replayed(trace):
    return replay(Trace.from_json(json.loads(json.dumps(trace.to_json())), trace.leaves))


def test_replay_fills_uninitialized_memory_with_nan_so_the_answer_does_not_depend_on_the_allocator():
    """A buffer made by ``torch.empty`` inside the call holds NaN at replay, on every machine: the op
    that ignores it (``beta=0``) is still named, and a computation that really reads it is always NaN."""
    ignored, _ = record(_Call(lambda q: torch.baddbmm(torch.empty(1, 2, 2), q, q, beta=0.0, alpha=HUGE)),
                        torch.ones(1, 2, 2))
    assert _replayed(ignored).first_nonfinite["op"] == "aten.baddbmm.default"
    read, _ = record(_Call(lambda x: torch.empty(2) + x), torch.ones(2))
    result = _replayed(read)
    assert torch.isnan(result.outputs).all() and result.first_nonfinite is None


def _buffered(q):
    """Megatron's attention in small: a buffer from ``torch.empty``, sliced and viewed, handed to
    ``baddbmm(beta=0)`` (which writes without reading it); another slice read (garbage in, garbage out)
    and a third written whole by ``copy_`` before it is read."""
    buffer = torch.empty(12)
    scores = torch.baddbmm(buffer[0:4].view(1, 2, 2), q, q, beta=0.0)
    read = buffer[4:8] + 1
    written = buffer[8:12].copy_(q.view(4))
    return scores, read, written * 2


def test_uninitialized_memory_is_followed_through_views_until_an_operator_writes_it():
    trace, _ = record(_Call(_buffered), torch.ones(1, 2, 2))
    replayed = replay(trace, device="cpu", digests=True).digests
    refilled = replay(trace, device="cpu", digests=True, uninitialized_fill=1).digests
    flags = dict(enumerate(garbage_dependent(trace, replayed, refilled)))
    ops = [op["op"] for op in trace.ops]
    assert ops == ["aten.empty.memory_format", "aten.slice.Tensor", "aten.view.default",
                   "aten.baddbmm.default", "aten.slice.Tensor", "aten.add.Tensor", "aten.slice.Tensor",
                   "aten.view.default", "aten.copy_.default", "aten.mul.Tensor"]
    assert [index for index, flag in flags.items() if flag] == [0, 1, 2, 4, 5, 6]


def test_against_the_capture_uninitialized_memory_is_not_compared_whatever_the_allocator_held():
    """The capture's digests of the buffer, its views and what was computed from it are whatever the
    allocator held: made to differ from the replays' (NaN) here, they are still not compared, nor marked
    in the table; everything else is, and nothing differs."""
    trace, _ = record(_Call(_buffered), torch.ones(1, 2, 2))
    for index in (0, 1, 2, 4, 5, 6):
        for item in trace.digests[index]:
            item.update(hash="1" * 32, canonical_hash="1" * 32, abs_max=3e38)
    document = compare([_replayed_as(trace, "A")], {}, "cpu", None)
    assert document["first_difference"] is None and document["pairs"][0]["compared"] == 4
    assert [op["index"] for op in document["operators"] if op["uninitialized"]] == [0, 1, 2, 4, 5, 6]
    text = format_comparison(document)
    assert ("Not compared: #0 aten.empty.memory_format, #1 aten.slice.Tensor, #2 aten.view.default,"
            " #4 aten.slice.Tensor, #5 aten.add.Tensor, #6 aten.slice.Tensor: uninitialized memory") in text
    trace.digests[9][0]["hash"] = "2" * 32  # a real difference after them is still found
    document = compare([_replayed_as(trace, "A")], {}, "cpu", None)
    assert document["first_difference"]["index"] == 9
    rows = [line for line in format_comparison(document).splitlines() if "aten." in line and "max" in line]
    assert [row.split()[0] for row in rows if "*" in row] == ["9"]  # (uninitialized) rows are not marked


def _nan_bits(values, pattern):
    """``values`` (bf16) with every NaN written as the 16-bit ``pattern``."""
    bits = values.clone().view(torch.int16)
    bits[torch.isnan(values)] = pattern
    return bits.view(torch.bfloat16)


def test_nans_that_differ_in_their_bit_patterns_alone_are_told_apart_from_other_values():
    values = torch.tensor([1.0, math.nan, -2.0, math.nan], dtype=torch.bfloat16)
    negative, quiet = _nan_bits(values, -1), _nan_bits(values, 0x7FC0)  # 0xffff against 0x7fc0
    one, other = digest(negative), digest(quiet)
    assert one["hash"] != other["hash"] and one["canonical_hash"] == other["canonical_hash"]
    assert digest(values[:1])["canonical_hash"] == digest(values[:1])["hash"]  # no NaN: the same
    assert output_difference([one], [other], None) is None
    assert output_difference([one], [other], None, nan_patterns=True) == (
        "output 0: the bit patterns of its NaNs differ, and nothing else")
    changed = quiet.clone()
    changed[0] = 1.5
    assert output_difference([one], [digest(changed)], None) == "output 0: its bytes differ"
    old = {key: value for key, value in one.items() if key != "canonical_hash"}  # read from a v3 trace
    assert output_difference([old], [other], None) == "output 0: its bytes differ"


def test_a_comparison_reports_nan_pattern_differences_apart_and_counts_them_when_asked():
    trace, _ = record(_Call(lambda x: torch.log(x) * 2), torch.tensor([1.0, -1.0, 2.0]).to(torch.bfloat16))
    log = trace.ops.index(next(op for op in trace.ops if op["op"] == "aten.log.default"))
    for index in range(log, len(trace.ops)):  # the capture's NaN was another pattern from log on
        trace.digests[index][0]["hash"] = "3" * 32
    ignored = compare([_replayed_as(trace, "A")], {}, "cpu", None)
    assert ignored["first_difference"] is None and ignored["nan_patterns_counted"] is False
    assert ignored["pairs"][0]["nan_patterns"] == {"index": log, "op": "aten.log.default"}
    text = format_comparison(ignored)
    assert (f"capture vs A: no operator differs; before it, the NaNs of op #{log} aten.log.default differ"
            " in their bit patterns alone") in text
    assert any(line.split()[0] == str(log) and "~" in line for line in text.splitlines() if "max" in line)
    counted = compare([_replayed_as(trace, "A")], {}, "cpu", None, nan_patterns=True)
    assert counted["first_difference"]["index"] == log
    assert counted["pairs"][0]["first_difference"]["why"].endswith("its NaNs differ, and nothing else")


def test_a_version_3_trace_has_digests_without_canonical_hash_and_version_4_with_it(tmp_path):
    trace, _ = record(nn.Linear(2, 2), torch.randn(1, 2))
    document, leaves = saved_and_loaded(trace, tmp_path)
    assert document["version"] == 4 and all("canonical_hash" in item for entry in document["digests"]
                                            for item in entry)
    old = copy.deepcopy(document)
    old["version"] = 3
    for entry in old["digests"]:
        for item in entry:
            del item["canonical_hash"]
    assert Trace.from_json(old, leaves).to_json()["version"] == 3
    old["version"] = 4
    with pytest.raises(TraceError, match="canonical_hash"):
        Trace.from_json(old, leaves)
    document["version"] = 3
    with pytest.raises(TraceError, match="per output tensor"):
        Trace.from_json(document, leaves)
