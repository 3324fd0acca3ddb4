"""What a replay checks before an operator runs, so that a crafted trace cannot make a kernel read or
write outside its tensors (docs/guarantees.md, "Memory-safe replay").

Kernels trust their arguments' metadata: ``_reshape_alias`` builds a view past its storage without a
check, ``fill_`` then writes past it; ``embedding_dense_backward`` indexes its output with the index
values it is given; ``native_layer_norm_backward`` reads as many means as its input has rows, whatever
the size of ``mean``. Three checks, all on metadata or on one host read of an index tensor:

- storage (generic, every operator): every tensor argument before the op runs and every tensor it
  returns stays within its storage: ``storage_offset + sum((size - 1) * stride)`` at both ends
  (negative strides included) lies in ``[0, storage elements)``. A view past its storage is refused
  where it is made, before anything reads or writes through it.
- positions (per operator, ``POSITION_RULES``): each integer tensor an operator reads as positions (an
  index, embedding ids, a loss target) lies within the dimension it indexes, read once
  (``aminmax``). Out of range is refused, never dropped.
- companions (per operator, ``COMPANION_RULES``): the tensors a kernel reads alongside its input with the
  input's geometry (a layer norm's saved mean, a batch norm's running statistics, a softmax
  backward's output) have that geometry.

``tests/test_replay_safety.py`` checks that every operator of ``REPLAY_ALLOWLIST`` with an argument
named like positions (``POSITION_ARGUMENTS``) has a rule here.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Sequence

import torch
from torch.utils._pytree import tree_flatten

from ...formats.trace_ops import TraceError

# Tensor arguments that hold positions into another tensor (by schema name; see the module docstring).
POSITION_ARGUMENTS = frozenset({"index", "indices", "target", "cu_seqlens_q", "cu_seqlens_k", "cum_seq_q",
                                "cum_seq_k", "seqlen_k", "seqused_k", "block_table"})
# Variable-length and paged attention take offsets into packed sequences; replay does not check them.
_PACKED_ATTENTION = ("cu_seqlens_q", "cu_seqlens_k", "cum_seq_q", "cum_seq_k", "seqlen_k", "seqused_k",
                     "block_table")


def check_storage(tensor: torch.Tensor, what: str) -> None:
    """``tensor`` reaches only elements of its own storage."""
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return
    lowest = highest = tensor.storage_offset()
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride
        lowest, highest = lowest + min(reach, 0), highest + max(reach, 0)
    elements = tensor.untyped_storage().nbytes() // tensor.element_size()
    if lowest < 0 or highest >= elements:
        raise TraceError(f"{what}: a view of {list(tensor.shape)} with strides {list(tensor.stride())} and"
                         f" offset {tensor.storage_offset()} reaches elements {lowest} to {highest} of a"
                         f" storage of {elements}: refused")


def check_tensors(tree: Any, what: str) -> None:
    """``check_storage`` for every tensor of a nested argument or output tree."""
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor):
            check_storage(value, what)


def _positions(index: Any, size: int, what: str, negative: bool) -> None:
    """Every value of the integer tensor ``index`` indexes a dimension of ``size``: in ``[0, size)``, or
    in ``[-size, size)`` where the operator counts from the end. One host read."""
    if not isinstance(index, torch.Tensor) or index.numel() == 0:
        return
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TraceError(f"{what} is a {index.dtype} tensor, not integer positions: refused")
    low, high = (int(value) for value in torch.aminmax(index))
    floor = -size if negative else 0
    if low < floor or high >= size:
        bad = low if low < floor else high
        raise TraceError(f"{what} holds position {bad}, outside [{floor}, {size}): refused")


def _size(tensor: Any, dim: Any, what: str) -> int:
    """The size of ``tensor`` along ``dim`` (a 0-d tensor counts as size 1 along dim 0 or -1)."""
    if not isinstance(tensor, torch.Tensor) or not isinstance(dim, int):
        raise TraceError(f"{what}: needs a tensor and an integer dim")
    shape = tuple(tensor.shape) or (1,)
    if not -len(shape) <= dim < len(shape):
        raise TraceError(f"{what}: dim {dim} is out of range for {list(tensor.shape)}: refused")
    return shape[dim]


def _along_dim(negative: bool) -> Callable[[Dict[str, Any]], None]:
    """``op(self, dim, index, ...)``: ``index`` indexes ``self`` along ``dim``."""
    def check(bound: Dict[str, Any]) -> None:
        size = _size(bound.get("self"), bound.get("dim"), "index")
        _positions(bound.get("index"), size, "index", negative)
    return check


def _advanced_indices(bound: Dict[str, Any]) -> None:
    """``self[indices]``: None skips a dimension, a boolean mask covers as many as it has (with their
    sizes), an integer tensor indexes one, counting from the end for negative values."""
    source, dim = bound.get("self"), 0
    indices = bound.get("indices")
    if not isinstance(source, torch.Tensor) or not isinstance(indices, (list, tuple)):
        raise TraceError("indices: needs a tensor and a list of indices")
    for number, index in enumerate(indices):
        if index is None:
            dim += 1
            continue
        covered = index.dim() if index.dtype in (torch.bool, torch.uint8) else 1
        if dim + covered > source.dim():
            raise TraceError(f"indices: {len(indices)} indices for a {source.dim()}-d tensor: refused")
        if covered == index.dim() and index.dtype in (torch.bool, torch.uint8):
            if list(index.shape) != list(source.shape[dim:dim + covered]):
                raise TraceError(f"indices[{number}]: a mask of {list(index.shape)} for dimensions of"
                                 f" {list(source.shape[dim:dim + covered])}: refused")
        else:
            _positions(index, source.shape[dim], f"indices[{number}]", negative=True)
        dim += covered


def _embedding(bound: Dict[str, Any]) -> None:
    _positions(bound.get("indices"), _size(bound.get("weight"), 0, "weight"), "indices", negative=False)


def _embedding_backward(bound: Dict[str, Any]) -> None:
    rows = bound.get("num_weights")
    if not isinstance(rows, int) or rows < 0:
        raise TraceError(f"num_weights {rows!r} is not a count: refused")
    _positions(bound.get("indices"), rows, "indices", negative=False)


def _loss_target(bound: Dict[str, Any]) -> None:
    """Class indices in ``[0, classes)``, or the ``ignore_index`` (which the kernel skips)."""
    scores, target = bound.get("self"), bound.get("target")
    if not isinstance(scores, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TraceError("target: needs scores and a target tensor")
    classes = _size(scores, 1 if scores.dim() >= 2 else 0, "self")
    ignored = bound.get("ignore_index")
    counted = torch.where(target == ignored, 0, target) if isinstance(ignored, int) else target
    _positions(counted, classes, "target", negative=False)


def _unpacked_attention(bound: Dict[str, Any]) -> None:
    """Variable-length or paged attention (packed offsets) is refused; the plain call carries none."""
    for name in _PACKED_ATTENTION:
        value = bound.get(name)
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            raise TraceError(f"{name}: variable-length or paged attention cannot be checked: refused")


POSITION_RULES: Dict[str, Callable[[Dict[str, Any]], None]] = {
    **dict.fromkeys(("gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
                     "index_copy"), _along_dim(negative=False)),
    "index_fill": _along_dim(negative=True),
    **dict.fromkeys(("index", "_unsafe_index", "index_put", "_unsafe_index_put"), _advanced_indices),
    "embedding": _embedding,
    **dict.fromkeys(("embedding_backward", "embedding_dense_backward"), _embedding_backward),
    **dict.fromkeys(("nll_loss", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
                     "nll_loss2d_backward"), _loss_target),
    **dict.fromkeys(("_efficient_attention_forward", "_efficient_attention_backward",
                     "_flash_attention_forward", "_flash_attention_backward",
                     "_scaled_dot_product_flash_attention_backward"), _unpacked_attention),
}
# Operators whose position-named tensors are outputs (``indices`` of sort, topk, median, max_pool) or
# values (``mse_loss``'s target): nothing they read is a position.
NO_POSITIONS_READ = frozenset({"max_pool2d_with_indices", "median", "sort", "topk", "mse_loss"})


def _shape(value: Any, expected: Sequence[int], what: str) -> None:
    if isinstance(value, torch.Tensor) and list(value.shape) != list(expected):
        raise TraceError(f"{what} is {list(value.shape)}, not the {list(expected)} the kernel reads: refused")


def _elements(value: Any, expected: int, what: str) -> None:
    if isinstance(value, torch.Tensor) and value.numel() != expected:
        raise TraceError(f"{what} has {value.numel()} elements, not the {expected} the kernel reads: refused")


def _channel_statistics(bound: Dict[str, Any]) -> None:
    """``native_batch_norm``: weight, bias and running statistics, one per channel (dim 1)."""
    source = bound.get("input")
    channels = source.shape[1] if isinstance(source, torch.Tensor) and source.dim() >= 2 else None
    for name in ("weight", "bias", "running_mean", "running_var"):
        if channels is None and isinstance(bound.get(name), torch.Tensor):
            raise TraceError(f"{name}: batch norm of a tensor without channels: refused")
        _elements(bound.get(name), channels or 0, name)


def _row_statistics(bound: Dict[str, Any]) -> None:
    """``native_layer_norm_backward``: one mean and rstd per normalized row; grad and input alike."""
    source, normalized = bound.get("input"), bound.get("normalized_shape")
    if not isinstance(source, torch.Tensor) or not isinstance(normalized, (list, tuple)):
        raise TraceError("layer norm backward: needs an input and a normalized_shape")
    _shape(bound.get("grad_out"), source.shape, "grad_out")
    width = math.prod(normalized)
    rows = source.numel() // width if width else 0
    for name in ("mean", "rstd"):
        _elements(bound.get(name), rows, name)
    for name in ("weight", "bias"):
        _shape(bound.get(name), normalized, name)


def _same_as_grad(bound: Dict[str, Any]) -> None:
    """``_softmax_backward_data``/``_log_softmax_backward_data``: the output has the gradient's shape."""
    grad = bound.get("grad_output")
    if isinstance(grad, torch.Tensor):
        _shape(bound.get("output"), grad.shape, "output")


def _attention_backward(bound: Dict[str, Any]) -> None:
    """CPU flash attention backward: ``out`` and ``grad_out`` shaped like the forward's output,
    ``logsumexp`` one per query row."""
    query, value = bound.get("query"), bound.get("value")
    if not isinstance(query, torch.Tensor) or not isinstance(value, torch.Tensor) or query.dim() < 2:
        raise TraceError("attention backward: needs query and value tensors")
    output = [*query.shape[:-1], value.shape[-1]]
    _shape(bound.get("out"), output, "out")
    _shape(bound.get("grad_out"), output, "grad_out")
    _shape(bound.get("logsumexp"), query.shape[:-1], "logsumexp")


COMPANION_RULES: Dict[str, Callable[[Dict[str, Any]], None]] = {
    "native_batch_norm": _channel_statistics,
    "native_layer_norm_backward": _row_statistics,
    "_softmax_backward_data": _same_as_grad,
    "_log_softmax_backward_data": _same_as_grad,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
}


def bind(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments of a call by their schema names."""
    names = [argument.name for argument in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def check_call(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """Everything checked before ``func(*args, **kwargs)`` runs; TraceError (one line) to refuse it."""
    check_tensors([args, kwargs], "an argument")
    packet = func._schema.name.split("::")[-1].removesuffix("_")  # an in-place variant: its operator's rules
    rules = [table[packet] for table in (POSITION_RULES, COMPANION_RULES) if packet in table]
    if rules:
        bound = bind(func, args, kwargs)
        for rule in rules:
            rule(bound)

