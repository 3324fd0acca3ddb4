"""Fused kernels: work outside the dispatcher, inside a custom ``torch.autograd.Function``, is one named step
of the trace, and replay says whether the kernel or the numerics turned finite inputs into Inf/NaN.

The invisible kernels here are real: megatron-core's own fused softmax Functions, run on the CPU with a
stand-in for their CUDA extension that computes through numpy (the dispatcher never sees it), and
megatron-core's ``GeLUFunction``, which runs on the CPU as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu, fused_softmax
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func
from torch import nn

from gradnan.formats import bundle
from gradnan.formats.trace import Trace
from gradnan.formats.trace_ops import TraceError
from gradnan.offline.replay import references
from gradnan.offline.replay.command import replay_bundle
from gradnan.offline.replay.text import format_text
from gradnan.offline.replay.trace import replay
from gradnan.patches.module_hooks import ModuleHooks
from gradnan.training.error_guard import ErrorGuard
from gradnan.training.module_capture import ModuleCapture, bundle_contents
from gradnan.training.recorder import OpRecorder
from tests.conftest import UNIT_COORDS


def _numpy_softmax(x: np.ndarray, stable: bool) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True) if stable else x
    e = np.exp(shifted)
    return e / e.sum(-1, keepdims=True)


def softmax_extension(stable: bool, compute: str) -> types.ModuleType:
    """A stand-in for megatron's ``scaled_softmax_cuda`` extension, computed through numpy: ``compute`` is
    the numpy dtype the kernel works in; an unstable kernel skips the max subtraction (a kernel bug)."""
    def forward(inputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = inputs.detach().numpy().astype(compute) * np.asarray(float(scale), dtype=compute)
        with np.errstate(over="ignore", invalid="ignore"):
            return torch.from_numpy(_numpy_softmax(x, stable).astype(inputs.detach().numpy().dtype))

    return types.SimpleNamespace(forward=forward)


class _Core(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return fused_softmax.ScaledSoftmax.apply(scores, 64.0)


class Attention(nn.Module):
    """Scores from a projection, then megatron's ``ScaledSoftmax`` (its fused path) in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False, dtype=torch.float16)
        self.core = _Core()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(self.proj(x).view(1, 2, 4, 4)) * 2


def _large_scores_module() -> nn.Module:
    """Scores equal to the inputs (an identity projection), scaled by 64 in the kernel."""
    torch.manual_seed(0)
    module = Attention()
    with torch.no_grad():
        module.proj.weight.copy_(torch.eye(8, dtype=torch.float16))
    return module


def _inputs(base: float) -> torch.Tensor:
    """Finite fp16 scores from ``base`` up: from 1100, times 64, past fp16's 65504; from 300 within it
    (and exp(300 * 64) past fp32's range)."""
    return (base + torch.arange(32, dtype=torch.float32).view(4, 8)).to(torch.float16)


def capture_bundle(path, module: nn.Module, x: torch.Tensor):
    """A bundle of one call of ``module``, as the training side writes it."""
    capture = ModuleCapture("decoder.layers.0.self_attention", module, "always", ErrorGuard(True),
                            ModuleHooks()).attach()
    module(x)
    capture.detach()
    call = capture.chosen_call()
    manifest, tensors = bundle_contents(capture, call, {}, {"trigger": "always"}, lambda param: {})
    manifest.update(step=1, rank=dict(UNIT_COORDS), run={"id": None, "attempt": "0", "started": 1.7e9})
    return bundle.write(path, manifest, tensors), call


@pytest.mark.parametrize("base, stable, compute, finding, verdict", [
    (1100, True, "float16", "numerics", "precision"),     # an honest fp16 kernel: fp16 cannot hold 1100 * 64
    (300, False, "float32", "kernel_bug", "kernel_bug"),  # no max subtraction: exp(19200) overflows fp32
])
def test_an_invisible_kernel_that_overflows_is_named_and_judged_end_to_end(
        tmp_path, monkeypatch, base, stable, compute, finding, verdict):
    monkeypatch.setitem(sys.modules, "scaled_softmax_cuda", softmax_extension(stable, compute))
    written, call = capture_bundle(tmp_path / "bundle", _large_scores_module(), _inputs(base))
    fused = [op for op in call.trace.ops if "fused" in op]
    assert [op["op"] for op in fused] == ["megatron.core.fusions.fused_softmax.ScaledSoftmax"]
    assert fused[0]["fused"]["module"] == "decoder.layers.0.self_attention.core"
    assert set(fused[0]["kwargs"]) == {"inputs", "scale"} and fused[0]["kwargs"]["scale"] == 64.0
    assert call.trace.first_nonfinite == {"index": call.trace.ops.index(fused[0]), "op": fused[0]["op"]}
    assert not any(op["op"].startswith("aten.exp") for op in call.trace.ops)  # the kernel is invisible

    result = replay_bundle(written, device="cpu")
    assert result["verdict"] == verdict and result["fused"]["finding"] == finding
    assert result["runs"]["captured"]["first_nonfinite"]["fused"]["class"] == "ScaledSoftmax"
    assert not result["runs"]["float64"]["outputs_nonfinite"]  # the reference math stands in, wider
    assert result["replay_matches_saved_outputs"]
    text = format_text(result)
    assert ("the fused kernel ScaledSoftmax (megatron.core.fusions.fused_softmax, in"
            " decoder.layers.0.self_attention.core) turned finite inputs into Inf/NaN") in text
    captured = "NON-FINITE" if finding == "numerics" else "finite"
    assert (f"Fused kernel ScaledSoftmax: output NON-FINITE; reference math captured {captured}, float32"
            f" finite, float64 finite: {finding}") in text


def test_gradnan_replay_names_the_kernel_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "scaled_softmax_cuda", softmax_extension(False, "float32"))
    written, _ = capture_bundle(tmp_path / "bundle", _large_scores_module(), _inputs(300))
    result = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(written), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Verdict: kernel_bug: the fused kernel ScaledSoftmax" in result.stdout
    assert "a bug in the kernel" in result.stdout


class Exp(torch.autograd.Function):
    """A kernel the kit has no reference for, computed outside the dispatcher."""

    @staticmethod
    def forward(ctx, x):
        with np.errstate(over="ignore"):
            return torch.from_numpy(np.exp(x.detach().numpy()))

    @staticmethod
    def backward(ctx, grad):
        return grad


def record(module, *args, digests=True):
    recorder = OpRecorder(digests=digests)
    recorder.mark_inputs(list(args), "args")
    recorder.mark_inputs(dict(module.named_parameters()), "param")
    with recorder:
        out = module(*args)
    return recorder.result(out), out


class _ExpModule(nn.Module):
    def forward(self, x):
        return Exp.apply(x * 2) + 1


def test_an_unknown_kernel_is_named_as_opaque():
    trace, out = record(_ExpModule(), torch.full((3,), 50.0, dtype=torch.float16))
    assert trace.first_nonfinite["op"] == f"{__name__}.Exp"
    result = replay(Trace.from_json(json.loads(json.dumps(trace.to_json())), trace.leaves))
    assert result.first_nonfinite["fused"] == {"class": "Exp", "class_module": __name__, "module": None,
                                               "reference": None, "reference_nonfinite": None,
                                               "finding": "opaque"}
    assert torch.equal(result.outputs, out)


def test_function_apply_is_wrapped_only_while_recording_and_put_back_exactly():
    original = vars(torch.autograd.Function)["apply"]
    recorder = OpRecorder()
    with recorder:
        assert vars(torch.autograd.Function)["apply"] is not original
    assert vars(torch.autograd.Function)["apply"] is original
    with pytest.raises(RuntimeError), OpRecorder():
        raise RuntimeError("the module failed")
    assert vars(torch.autograd.Function)["apply"] is original


def test_a_function_whose_visible_ops_explain_the_inf_is_not_a_fused_step():
    """megatron-core's ``GeLUFunction`` runs on the CPU through dispatched ops: those are named."""
    class BiasGelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4, dtype=torch.float16))

        def forward(self, x):
            return fused_bias_gelu.bias_gelu_impl(x * 300, self.bias)

    trace, out = record(BiasGelu(), torch.full((4,), 300.0, dtype=torch.float16))
    assert not any("fused" in op for op in trace.ops)
    assert trace.first_nonfinite["op"].startswith("aten.")
    assert torch.equal(replay(trace).outputs, out)


def test_a_kernel_writing_in_place_saves_what_it_wrote():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.detach().numpy()[...] *= 2
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class M(nn.Module):
        def forward(self, x):
            y = x + 1
            return Double.apply(y) + 0

    trace, out = record(M(), torch.ones(3))
    assert [op["op"] for op in trace.ops if "fused" in op] == [f"{__name__}.{Double.__qualname__}"]
    assert torch.equal(replay(trace).outputs, out)


def test_a_fused_entry_is_version_2_and_a_version_1_trace_may_not_hold_one():
    trace, _ = record(_ExpModule(), torch.ones(3), digests=False)
    document = json.loads(json.dumps(trace.to_json()))
    assert document["version"] == 2
    plain, _ = record(nn.Linear(2, 2), torch.ones(2), digests=False)
    assert plain.to_json()["version"] == 1
    with_digests, _ = record(_ExpModule(), torch.ones(3))
    assert with_digests.to_json()["version"] == 4  # what capture writes: the fused entry's outputs too
    assert len(with_digests.digests) == len(with_digests.ops)
    with pytest.raises(TraceError, match="malformed entry"):
        Trace.from_json({**document, "version": 1}, trace.leaves)
    fused = next(op for op in document["ops"] if "fused" in op)
    for key, value in (("class", "os.system"), ("module", 3), ("class", "Exp;rm")):
        fused["fused"] = {**fused["fused"], key: value}
        with pytest.raises(TraceError, match="malformed fused entry"):
            Trace.from_json(document, trace.leaves)


# --- the references against megatron-core's own unfused code ---------------------------------------


def _op(name):
    return {"fused": {"class": name}}


def _reference(name, like, dtype=None, **kwargs):
    return references.compute(_op(name), [], kwargs, like, dtype)


def _torch_softmax(mask_type, scale):
    return fused_softmax.FusedScaleMaskSoftmax(False, False, mask_type, False, attention_mask_func, True,
                                                scale).forward_torch_softmax


def test_softmax_references_match_megatrons_unfused_path():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 8, 8) * 4
    mask = torch.rand(2, 1, 8, 8) > 0.7
    causal = _reference("ScaledUpperTriangMaskedSoftmax", scores.view(6, 8, 8), inputs=scores.view(6, 8, 8),
                        scale=0.5)
    upper = torch.ones(8, 8, dtype=torch.bool).triu(1)  # megatron's default causal mask, built on the CPU
    expected = _torch_softmax(AttnMaskType.causal, 0.5)(scores, upper)
    torch.testing.assert_close(causal.view(2, 3, 8, 8), expected)
    torch.testing.assert_close(_reference("ScaledMaskedSoftmax", scores, inputs=scores, mask=mask, scale=0.5),
                               _torch_softmax(AttnMaskType.padding, 0.5)(scores, mask))
    torch.testing.assert_close(_reference("ScaledSoftmax", scores, inputs=scores, scale=0.5),
                               _torch_softmax(AttnMaskType.padding, 0.5)(scores, None))


def test_activation_references_match_megatrons_functions():
    torch.manual_seed(0)
    y, bias, weights = torch.randn(6, 16), torch.randn(16), torch.rand(6, 1)
    torch.testing.assert_close(_reference("GeLUFunction", y, input=y, bias=bias),
                               fused_bias_gelu.GeLUFunction.apply(y, bias))
    half = torch.empty(6, 8)
    torch.testing.assert_close(_reference("BiasSwiGLUFunction", half, input=y, bias=bias),
                               fused_bias_swiglu.bias_swiglu(y, bias))
    torch.testing.assert_close(_reference("SwiGLUFunction", half, input=y), fused_bias_swiglu.swiglu(y))
    torch.testing.assert_close(_reference("WeightedSwiGLUFunction", half, input=y, weights=weights),
                               fused_bias_swiglu.weighted_swiglu(y, weights))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reference_matches_megatrons_unfused_rotary_embedding(interleaved):
    torch.manual_seed(0)
    t, freqs = torch.randn(8, 2, 3, 16), torch.randn(8, 1, 1, 12)
    expected = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    torch.testing.assert_close(_reference("FusedRoPEFunc", t, t=t, freqs=freqs, interleaved=interleaved),
                               expected)
    bshd = t.transpose(0, 1)
    torch.testing.assert_close(_reference("FusedRoPEFunc", bshd, t=bshd, freqs=freqs, tensor_format="bshd",
                                          interleaved=interleaved), expected.transpose(0, 1))
    assert _reference("FusedRoPEFunc", t, t=t, freqs=freqs, tensor_format="thd") is None


@pytest.mark.parametrize("causal", [False, True])
def test_attention_references_match_torch_sdpa(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 2, 4, 8), torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8)  # sbhd, 2 kv groups
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=causal, scale=0.3, enable_gqa=True)
    te = _reference("FusedAttnFunc", torch.empty(5, 2, 32), q=q, k=k, v=v, attn_scale=0.3,
                    qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal" if causal else "no_mask")
    torch.testing.assert_close(te, expected.permute(2, 0, 1, 3).reshape(5, 2, 32))
    bshd = [x.transpose(0, 1) for x in (q, k, v)]
    flash = _reference("FlashAttnFunc", bshd[0], q=bshd[0], k=bshd[1], v=bshd[2], softmax_scale=0.3,
                       causal=causal)
    torch.testing.assert_close(flash, expected.permute(0, 2, 1, 3))
    assert _reference("FlashAttnFunc", bshd[0], q=bshd[0], k=bshd[1], v=bshd[2], dropout_p=0.1) is None


def test_a_reference_that_overflows_in_bf16_not_fp32_is_numerics():
    """bf16's largest value (3.3895e38) times 1.00309 is 3.40e38: past what bf16 rounds to a finite value
    (3.3962e38), within fp32's range (3.4028e38)."""
    scores = torch.tensor([[torch.finfo(torch.bfloat16).max, 0.0]], dtype=torch.bfloat16)
    saved = torch.full((1, 2), float("nan"), dtype=torch.bfloat16)
    judged = references.judge(_op("ScaledSoftmax"), [], {"inputs": scores, "scale": 1.00309}, saved)
    assert judged == {"reference": "ScaledSoftmax", "finding": "numerics",
                      "reference_nonfinite": {"captured": True, "float32": False, "float64": False}}
