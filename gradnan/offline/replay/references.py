"""Reference math for the fused kernels the kit knows, to tell a kernel bug from numerics at replay.

A ``fused`` trace entry (``gradnan.formats.trace``) is a custom ``torch.autograd.Function`` whose kernel
the dispatcher did not see: replay has its saved output, not its computation. Where the Function's class
(by ``__qualname__``) is in ``REFERENCES``, its semantics are written here as plain torch over the
arguments its ``forward`` took by name (the tensors and the saved non-tensor arguments, ``scale``,
``interleaved``...). ``judge`` runs that math on the kernel's inputs in the captured dtype, in float32 and
in float64: finite in the captured dtype means the kernel itself went wrong (``kernel_bug``); non-finite
there and finite wider means the dtype cannot hold the computation (``numerics``); non-finite in every
precision means the inputs are bad for it (``bad_input``). A class not listed, or called with arguments
its reference does not cover (packed sequences, dropout, a bias), is ``opaque``: named, not decided.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from ...formats.trace import REPLAY_PRECISIONS, has_nonfinite

_MASKED = -10000.0  # what Megatron's masked softmax kernels (and its unfused mask function) put in


class NoReference(Exception):
    """The Function was called in a way its reference does not cover."""


def _scaled_softmax(inputs: torch.Tensor, scale: float = 1.0, **_: Any) -> torch.Tensor:
    """Megatron's ``ScaledSoftmax``: softmax(inputs * scale) over the last dimension."""
    return torch.softmax(inputs * scale, dim=-1)


def _scaled_masked_softmax(inputs: torch.Tensor, mask: Optional[torch.Tensor], scale: float = 1.0,
                           **_: Any) -> torch.Tensor:
    """Megatron's ``ScaledMaskedSoftmax``: positions where ``mask`` is true get -10000 after scaling."""
    scaled = inputs * scale
    if mask is not None:
        scaled = scaled.masked_fill(mask.bool(), _MASKED)
    return torch.softmax(scaled, dim=-1)


def _causal(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal, aligned to the bottom right (the last query sees every key)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def _scaled_upper_triang_masked_softmax(inputs: torch.Tensor, scale: float = 1.0, **_: Any) -> torch.Tensor:
    """Megatron's ``ScaledUpperTriangMaskedSoftmax`` on [batches, sq, sk]: a causal mask (key after query
    excluded) after scaling."""
    scaled = inputs * scale
    sq, sk = scaled.shape[-2:]
    return torch.softmax(scaled.masked_fill(_causal(sq, sk, scaled.device), -math.inf), dim=-1)


def _bias_gelu(input: torch.Tensor, bias: torch.Tensor, **_: Any) -> torch.Tensor:
    """Megatron's ``GeLUFunction`` (``bias_gelu_impl``): the tanh approximation of GeLU of input + bias."""
    x = bias + input
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(y, 2, -1)
    return F.silu(first) * second


def _bias_swiglu(input: torch.Tensor, bias: torch.Tensor, **_: Any) -> torch.Tensor:
    """Megatron's ``BiasSwiGLUFunction``: SiLU(first half) * second half of input + bias."""
    return _swiglu(input + bias)


def _plain_swiglu(input: torch.Tensor, **_: Any) -> torch.Tensor:
    """Megatron's ``SwiGLUFunction``."""
    return _swiglu(input)


def _weighted_swiglu(input: torch.Tensor, weights: torch.Tensor, **_: Any) -> torch.Tensor:
    """Megatron's ``WeightedSwiGLUFunction`` (mixture-of-experts probabilities as weights)."""
    return _swiglu(input) * weights


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rope(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", interleaved: bool = False,
          cu_seqlens: Any = None, start_positions: Any = None, **_: Any) -> torch.Tensor:
    """Rotary position embedding (Transformer Engine's and apex's ``FusedRoPEFunc``, as Megatron's
    ``fused_apply_rotary_pos_emb`` calls it): ``freqs`` [s, 1, 1, d] rotates the first d channels of
    ``t`` ([s, b, h, D] or, ``bshd``, [b, s, h, D]); packed sequences (``thd``) are not covered."""
    if tensor_format not in ("sbhd", "bshd") or cu_seqlens is not None or start_positions is not None:
        raise NoReference(f"rotary embedding in {tensor_format!r} format")
    seq_dim = 1 if tensor_format == "bshd" else 0
    freqs = freqs[: t.shape[seq_dim]]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    rotated, passed = t[..., : freqs.shape[-1]], t[..., freqs.shape[-1]:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    return torch.cat((rotated * cos + _rotate_half(rotated, interleaved) * sin, passed), dim=-1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: Optional[float],
               causal: bool) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, as ``torch.nn.functional.scaled_dot_product_attention``
    computes it without dropout, in the inputs' dtype; ``layout`` ``sbhd`` or ``bshd``, grouped-query
    heads repeated; the result in the inputs' layout."""
    if layout not in ("sbhd", "bshd"):
        raise NoReference(f"attention in {layout!r} layout")
    to_bhsd = (1, 2, 0, 3) if layout == "sbhd" else (0, 2, 1, 3)
    q, k, v = (x.permute(*to_bhsd) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if causal:
        scores = scores.masked_fill(_causal(scores.shape[-2], scores.shape[-1], scores.device), -math.inf)
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(2, 0, 1, 3) if layout == "sbhd" else out.permute(0, 2, 1, 3)


def _te_fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: Optional[float] = None,
                        dropout_p: float = 0.0, qkv_layout: str = "sbhd_sbhd_sbhd",
                        attn_mask_type: str = "causal", attn_bias_type: str = "no_bias",
                        window_size: Any = None, **_: Any) -> torch.Tensor:
    """Transformer Engine's ``FusedAttnFunc`` (``DotProductAttention`` / ``FusedAttention``), for separate
    q, k, v in ``sbhd`` or ``bshd``, no dropout, no bias, no window."""
    layouts = qkv_layout.split("_")
    if (len(set(layouts)) != 1 or dropout_p or attn_bias_type != "no_bias"
            or attn_mask_type not in ("no_mask", "causal", "causal_bottom_right")
            or window_size not in (None, (-1, -1), [-1, -1], (-1, 0), [-1, 0])):
        raise NoReference(f"fused attention with {qkv_layout}, {attn_mask_type}, dropout {dropout_p}")
    return _attention(q, k, v, layouts[0], attn_scale, attn_mask_type != "no_mask")


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     softmax_scale: Optional[float] = None, causal: bool = False, window_size: Any = (-1, -1),
                     softcap: float = 0.0, alibi_slopes: Any = None, **_: Any) -> torch.Tensor:
    """flash-attention's ``FlashAttnFunc`` ([b, s, h, d]), no dropout, window, softcap or ALiBi."""
    if dropout_p or softcap or alibi_slopes is not None or tuple(window_size or (-1, -1)) != (-1, -1):
        raise NoReference("flash attention with dropout, a window, softcap or ALiBi")
    return _attention(q, k, v, "bshd", softmax_scale, bool(causal))


Reference = Callable[..., Any]
# Function class ``__qualname__`` -> its reference math, over the arguments of its ``forward`` by name
REFERENCES: Dict[str, Reference] = {
    "ScaledSoftmax": _scaled_softmax,
    "ScaledMaskedSoftmax": _scaled_masked_softmax,
    "ScaledUpperTriangMaskedSoftmax": _scaled_upper_triang_masked_softmax,
    "GeLUFunction": _bias_gelu,
    "BiasSwiGLUFunction": _bias_swiglu,
    "SwiGLUFunction": _plain_swiglu,
    "WeightedSwiGLUFunction": _weighted_swiglu,
    "FusedRoPEFunc": _rope,
    "FusedAttnFunc": _te_fused_attention,
    "FlashAttnFunc": _flash_attention,
}


def _cast(value: Any, dtype: Optional[torch.dtype]) -> Any:
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def compute(op: Dict[str, Any], args: Any, kwargs: Dict[str, Any], like: Any,
            dtype: Optional[torch.dtype] = None) -> Optional[Any]:
    """The reference output of a fused entry on these (decoded) arguments, floating tensors cast to
    ``dtype`` first, each output tensor shaped like the saved one in ``like`` (a kernel may return its
    result flattened); None where no reference covers the call."""
    reference = REFERENCES.get(op["fused"]["class"])
    if reference is None or args:
        return None
    try:
        result = reference(**tree_map(lambda value: _cast(value, dtype), kwargs))
    except NoReference:
        return None
    return _shaped_like(result, like)


def _shaped_like(result: Any, like: Any) -> Optional[Any]:
    if isinstance(like, torch.Tensor):
        if not isinstance(result, torch.Tensor) or result.numel() != like.numel():
            return None
        return result.reshape(like.shape)
    if isinstance(like, (list, tuple)) and isinstance(result, (list, tuple)) and len(result) == len(like):
        shaped = [_shaped_like(value, model) for value, model in zip(result, like)]
        return None if any(value is None for value in shaped) else type(like)(shaped)
    return None


def judge(op: Dict[str, Any], args: Any, kwargs: Dict[str, Any], saved: Any) -> Dict[str, Any]:
    """Kernel or numerics, for a fused entry whose finite inputs (as replayed in the captured dtype) gave a
    non-finite ``saved`` output: which precisions the reference goes non-finite in, and the finding."""
    nonfinite: Dict[str, bool] = {}
    for label, dtype in REPLAY_PRECISIONS:
        with torch.no_grad():
            result = compute(op, args, kwargs, saved, dtype)
        if result is None:
            return {"reference": None, "reference_nonfinite": None, "finding": "opaque"}
        nonfinite[label] = any(has_nonfinite(value) for value in tree_flatten(result)[0])
    if not nonfinite["captured"]:
        finding = "kernel_bug"
    elif not (nonfinite["float32"] and nonfinite["float64"]):
        finding = "numerics"
    else:
        finding = "bad_input"
    return {"reference": op["fused"]["class"], "reference_nonfinite": nonfinite, "finding": finding}
