"""How a trace writes one aten operation down: its name, checked against the operators a replay may
execute (``REPLAY_ALLOWLIST``), and its arguments and outputs as JSON (``encode``, and ``decode``, the
strict validator of untrusted traces), with ``TraceError`` for whatever is malformed or refused.

A replay executes only the operators of ``REPLAY_ALLOWLIST`` (and their in-place ``_`` variants): pure
tensor computation, shape and creation. Nothing a trace names can open a file, share memory with one,
talk to another process or reach the allocator's settings (``aten.from_file``, ``set_``, ``_copy_from``
of a storage, collectives): such an entry is refused before any op runs. Apart from ``trace`` (the
document) because this is the boundary every untrusted name and value crosses, and the recorder writes
with it.
"""

import math
import re
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..errors import InputError

# The aten operators a replay may execute (by packet name, every overload): pure computation on the
# replay's own tensors. docs/guarantees.md lists them (tests/test_untrusted.py checks the two agree).
REPLAY_ALLOWLIST = frozenset("""
    _efficient_attention_backward _efficient_attention_forward _flash_attention_backward
    _flash_attention_forward _foreach_add _foreach_mul _fused_dropout _has_compatible_shallow_copy_type
    _local_scalar_dense _log_softmax _log_softmax_backward_data _masked_scale _reshape_alias
    _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
    _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
    _softmax _softmax_backward_data _to_copy _to_dense _unsafe_index _unsafe_view abs absolute acos
    acosh add addbmm addcdiv addcmul addmm addmv addr alias all amax amin aminmax any arange argmax
    argmin as_strided asin asinh atan atan2 atanh avg_pool1d avg_pool2d avg_pool2d_backward baddbmm
    bernoulli bitwise_and bitwise_not bitwise_or bitwise_xor bmm bucketize cat ceil clamp clamp_max
    clamp_min clip clone constant_pad_nd contiguous conv1d conv2d convolution convolution_backward copy
    cos cosh count_nonzero cumprod cumsum deg2rad dense_dim detach diag diagonal diagonal_backward div
    dot dropout elu elu_backward embedding embedding_backward embedding_dense_backward empty empty_like
    empty_permuted empty_strided eq erf erfc erfinv exp exp2 expand expand_as expand_copy expm1
    exponential_ eye fill fix flatten flip floor floor_divide fmax fmin fmod frac full full_like gather
    ge gelu gelu_backward geometric_ glu gt hardsigmoid hardswish hardtanh hardtanh_backward hypot index
    index_add index_copy index_fill index_put index_select is_contiguous is_same_size isfinite isinf
    isnan isneginf isposinf layer_norm le leaky_relu lerp lgamma lift_fresh lift_fresh_copy linear
    linspace log log10 log1p log2 log_sigmoid_backward log_sigmoid_forward log_softmax logaddexp
    logcumsumexp logical_and logical_not logical_or logical_xor logit logsumexp lt masked_fill
    masked_scatter masked_select matmul max max_pool2d_with_indices maximum mean median min minimum mish
    mm mse_loss mul mv nan_to_num narrow native_batch_norm native_dropout native_dropout_backward
    native_group_norm native_group_norm_backward native_layer_norm native_layer_norm_backward ne neg
    new_empty new_empty_strided new_full new_ones new_zeros nll_loss nll_loss2d_backward
    nll_loss2d_forward nll_loss_backward nll_loss_forward nonzero norm normal numel ones ones_like
    permute permute_copy pow prod rad2deg rand rand_like randint randint_like randn randn_like random_
    randperm reciprocal relu remainder repeat repeat_interleave reshape rms_norm roll round rsqrt rsub
    scalar_tensor scaled_dot_product_attention scatter scatter_add scatter_reduce select select_backward
    select_copy select_scatter sgn sigmoid sigmoid_backward sign silu silu_backward sin sinh size slice
    slice_backward slice_copy slice_scatter softmax softplus softplus_backward sort sparse_dim split
    split_copy split_with_sizes sqrt square squeeze squeeze_copy stack std stride sub sum sum_to_size
    sym_numel sym_size sym_storage_offset sym_stride t t_copy tanh tanh_backward threshold
    threshold_backward to topk transpose transpose_copy tril triu true_divide trunc type_as unbind
    unfold uniform unsqueeze unsqueeze_copy var var_mean view view_as view_copy where xlogy zero zeros
    zeros_like
""".split())


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


# Ops that return uninitialized memory: garbage that happens to be NaN is nobody's fault (and a replay
# fills what they return with NaN: ``returns_uninitialized``).
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided", "resize_"})


_OP_NAME = re.compile(r"(\w+)\.(\w+)\.(\w+)")


class TraceError(InputError, ValueError):
    """A malformed trace or an op that may not be replayed; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def encode(value: Any, name_of: Callable[[torch.Tensor], str]) -> Any:
    """JSON for one argument or output tree; tensors become ``{"t": name_of(tensor)}``."""
    if isinstance(value, torch.Tensor):
        return {"t": name_of(value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(float(value))}
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, tuple):
        return {"tuple": [encode(item, name_of) for item in value]}
    if isinstance(value, list):
        return [encode(item, name_of) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: encode(item, name_of) for key, item in value.items()}}
    for kind, tag in ((torch.dtype, "dtype"), (torch.device, "device"), (torch.layout, "layout"),
                      (torch.memory_format, "memory_format")):
        if isinstance(value, kind):
            return {tag: str(value).removeprefix("torch.")}
    return {"opaque": type(value).__name__}


def child_encodings(encoded: Any) -> List[Any]:
    if isinstance(encoded, list):
        return encoded
    if isinstance(encoded, dict) and isinstance(encoded.get("tuple"), list):
        return encoded["tuple"]
    if isinstance(encoded, dict) and isinstance(encoded.get("dict"), dict):
        return list(encoded["dict"].values())
    return []


def nodes(encoded: Any) -> Iterator[Dict[str, Any]]:
    """Every tagged node (``{"t": ...}``, ``{"opaque": ...}``, ...) of an encoding."""
    if isinstance(encoded, dict):
        yield encoded
    for child in child_encodings(encoded):
        yield from nodes(child)


def refs(encoded: Any) -> List[str]:
    """The tensor names an encoding refers to, in order."""
    return [node["t"] for node in nodes(encoded) if isinstance(node.get("t"), str)]


def op_inputs(op: Dict[str, Any]) -> List[Any]:
    return list(op["args"]) + list(op["kwargs"].values())


def _torch_constant(name: Any, kind: type) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) and re.fullmatch(r"[a-z]\w*", name) else None
    if not isinstance(value, kind):
        raise TraceError(f"unknown {kind.__name__} {name!r}")
    return value


def cast_dtype(dtype: torch.dtype, to: Optional[torch.dtype]) -> torch.dtype:
    """The replay dtype for a floating dtype, when there is one; every other dtype stays."""
    return to if to is not None and dtype.is_floating_point else dtype


# a value nested deeper is refused: far deeper than any module's arguments or outputs, and the same bound
# on every interpreter (Python 3.12 parses and walks 900 levels without reaching its recursion limit)
MAX_NESTING = 64


def decode(encoded: Any, tensor_of: Callable[[str], Any], dtype: Optional[torch.dtype] = None,
           device: Optional[torch.device] = None, depth: int = 0) -> Any:
    """The Python value of an encoding; strict, since it is also the validator of untrusted traces.
    ``dtype`` replaces floating dtype arguments and ``device`` every device argument."""
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    if depth >= MAX_NESTING:
        raise TraceError("a value nested too deeply")
    if isinstance(encoded, list):
        return [decode(item, tensor_of, dtype, device, depth + 1) for item in encoded]
    if not (isinstance(encoded, dict) and len(encoded) == 1):
        raise TraceError(f"malformed value {repr(encoded)[:80]}")
    (tag, value), = encoded.items()
    if tag == "t" and isinstance(value, str):
        return tensor_of(value)
    if tag == "float" and value in ("nan", "inf", "-inf"):
        return float(value)
    if tag == "tuple" and isinstance(value, list):
        return tuple(decode(item, tensor_of, dtype, device, depth + 1) for item in value)
    if tag == "dict" and isinstance(value, dict):
        return {key: decode(item, tensor_of, dtype, device, depth + 1) for key, item in value.items()}
    if tag == "dtype":
        return cast_dtype(_torch_constant(value, torch.dtype), dtype)
    if tag in ("layout", "memory_format"):
        return _torch_constant(value, getattr(torch, tag))
    if tag == "device" and isinstance(value, str):
        try:
            parsed = torch.device(value)
        except RuntimeError:
            raise TraceError(f"malformed device {value!r}") from None
        return device if device is not None else parsed
    if tag == "opaque" and isinstance(value, str):
        return None  # never passed to an op: replay refuses ops marked opaque
    raise TraceError(f"malformed value {repr(encoded)[:80]}")


def allowed_in_replay(packet: str) -> bool:
    """On ``REPLAY_ALLOWLIST``, or the in-place variant (``add_``) of an operator that is."""
    return packet in REPLAY_ALLOWLIST or (packet.endswith("_") and packet[:-1] in REPLAY_ALLOWLIST)


def replayable_op(name: Any) -> Any:
    """The aten ``OpOverload`` a name denotes, if replay may run it (``REPLAY_ALLOWLIST``); nothing else
    can be reached from a trace."""
    match = _OP_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or match[1] != "aten" or not allowed_in_replay(match[2]):
        raise TraceError(f"op {repr(name)[:80]} is not on the replay allowlist (pure-computation aten"
                         " operators only, docs/guarantees.md): refused")
    overload = getattr(getattr(torch.ops.aten, match[2], None), match[3], None)
    if not isinstance(overload, torch._ops.OpOverload):
        raise TraceError(f"op {name!r} does not exist in this torch")
    return overload


def op_packet(name: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    return name.split(".")[1]


def returns_uninitialized(name: str) -> bool:
    """``aten.empty.memory_format`` and its kin: what they return is whatever the allocator held."""
    return op_packet(name) in _UNINITIALIZED


def op_name(func: Any) -> str:
    return f"{func.namespace}.{func.__name__}"
