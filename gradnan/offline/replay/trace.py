"""Replay a recorded module call (``gradnan.formats.trace``) without the module's code.

``replay`` runs the ops again on copies of the leaves, in the captured dtype or with every floating
tensor (and every floating dtype argument) in float32/float64, forward and optionally backward, and
names the first op whose floating inputs were all finite and whose output was not, and, before it, the
first op whose output grew out of line over its inputs (``FirstGrowth``: the magnitude path).

What a replay cannot do, by construction:
- Collectives (``c10d``, ``_c10d_functional``: they do dispatch under the mode, e.g. ``allreduce_``
  with its ProcessGroup as an opaque argument) replay as identity: a single process sees only its
  own shard's partial result. A collective that changes shapes (all-gather over several ranks) cannot.
- Ops of other namespaces (``torch.library`` custom ops) are not executed: their outputs are saved
  as leaves, so the replay continues from the recorded values and no gradient flows through them.
- Work done outside the dispatcher inside a custom ``torch.autograd.Function`` (Transformer Engine,
  Megatron's fused softmax, apex, flash-attention) is a ``fused`` entry: in the captured dtype its saved
  output stands (what the kernel computed); in float32/float64 the kit's reference math for the class
  (``gradnan.offline.replay.references``) computes it in that precision where there is one. Either way a fused
  entry whose inputs were finite and whose output is not is named like an op, and in the captured run
  ``judge`` adds whether the reference goes non-finite too (kernel bug or numerics). A pybind call outside
  any Function is still not seen: its results become leaves where recorded ops consume them.
- Random ops draw from the current generator: a replay reproduces dropout only if the caller restores
  the RNG state of the recording first. An argument that cannot be written as JSON (a Generator)
  marks its op ``opaque``; such an op does not replay.
- Control flow is frozen: Python numbers read from tensors during the call are recorded as constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...formats.trace import HALF_TO_FLOAT, Trace, digest, digests_of, is_fused, tensors_in
from ...formats.trace_findings import FirstGrowth, FirstNonFinite
from ...formats.trace_ops import (
    TraceError,
    cast_dtype,
    child_encodings,
    decode,
    op_inputs,
    op_name,
    refs,
    replayable_op,
    returns_uninitialized,
)
from .checks import check_call, check_tensors
from .limits import trace_too_long
from .references import compute, judge


class _Watch(TorchDispatchMode):
    """Counts the ops dispatched (a backward's), checks each before it runs (``check_call``; at most
    ``max_ops`` of them) and finds the first non-finite one among them."""

    def __init__(self, max_ops: Optional[int] = None) -> None:
        super().__init__()
        self.count = 0
        self.first = FirstNonFinite(phase="backward")
        self.max_ops = max_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            if self.max_ops is not None and self.count >= self.max_ops:
                raise TraceError(f"the backward runs more than the {self.max_ops} ops a replay allows"
                                 " (--max-ops): refused")
            check_call(func, args, kwargs)
        except TraceError as error:
            raise TraceError(f"backward op {self.count} ({op_name(func)}): {error}") from None
        finite = self.first.inputs_finite(op_name(func), args, kwargs)
        out = func(*args, **kwargs)
        self.first.check(self.count, op_name(func), finite, out)
        self.count += 1
        return out


@dataclass
class ReplayResult:
    """The replayed output tree, the first non-finite op (forward, then backward: ``index`` into the
    trace's ops, or into the ops the backward dispatched), the requested leaf gradients, and the first
    forward op that grew a value out of line before any went non-finite; where asked for, the digests
    of every forward op's outputs (``gradnan.formats.trace.digest``), as the capture took them, and, in the
    captured dtype, those of each fused entry's reference math (by op index; null without a reference)."""

    outputs: Any
    first_nonfinite: Optional[Dict[str, Any]]
    grads: Dict[str, Optional[torch.Tensor]]
    first_growth: Optional[Dict[str, Any]] = None
    digests: Optional[List[List[Dict[str, Any]]]] = None
    reference_digests: Optional[Dict[int, Optional[List[Dict[str, Any]]]]] = None


def _replay_leaves(leaves: Dict[str, torch.Tensor], dtype: Optional[torch.dtype], device: torch.device,
                   grad_names: Sequence[str]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Private copies of the leaves (the trace is never mutated) and the graph leaves to differentiate."""
    for name in grad_names:
        if name not in leaves or not leaves[name].is_floating_point():
            raise TraceError(f"cannot differentiate {name!r}: not a floating leaf of the trace")
    env, graph_leaves = {}, {}
    for name, tensor in leaves.items():
        with torch.no_grad():
            copy = _copied(tensor, device, cast_dtype(tensor.dtype, dtype))
        if name in grad_names:
            graph_leaves[name] = copy.requires_grad_()
            copy = _copied(copy, device, copy.dtype)  # in-place ops on a graph leaf are illegal (on real
            # activations they are not): a copy that autograd connects to it
        env[name] = copy
    return env, graph_leaves


def _copied(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A copy by ``empty_like`` and ``copy_`` (differentiable): the replay's own copies go through no
    ``detach``, ``clone`` or ``_to_copy``, operators a trace records, so that an environment whose
    operator is changed differs first where the trace calls it."""
    return torch.empty_like(tensor, device=device, dtype=dtype).copy_(tensor)


def _from_env(env: Dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def lookup(name: str) -> torch.Tensor:
        if name not in env:
            raise TraceError(f"tensor {name!r} is used before anything produced it")
        return env[name]
    return lookup


def _bind(encoded: Any, value: Any, env: Dict[str, torch.Tensor], only: Optional[Set[str]] = None) -> None:
    """Name the tensors an op returned at replay as the trace named them at record time (``only``: just
    these names)."""
    if isinstance(encoded, dict) and "t" in encoded:
        if not isinstance(value, torch.Tensor):
            raise TraceError("returned something else than a tensor at replay")
        if only is None or encoded["t"] in only:
            env[encoded["t"]] = value
        return
    children = child_encodings(encoded)
    if children:
        if not isinstance(value, (list, tuple)) or len(value) != len(children):
            raise TraceError("returned a different structure at replay")
        for child, item in zip(children, value):
            _bind(child, item, env, only)


def _replay_collective(op: Dict[str, Any], env: Dict[str, torch.Tensor]) -> None:
    """Identity: each output takes the value of the input in its position (a no-op for an in-place
    all-reduce; a copy into the destination for ``_allgather_base_(out, in)``; a clone for a
    functional collective)."""
    inputs, outputs = refs(op_inputs(op)), refs(op["out"])
    sources = [name for name in inputs if name not in outputs] or inputs
    if len(outputs) > len(sources):
        raise TraceError("a collective with more outputs than inputs cannot replay as identity")
    for target, source in zip(outputs, sources):
        value = _from_env(env)(source)
        if target == source:
            continue
        if target in env and env[target].shape != value.shape:
            raise TraceError(f"a collective from {list(value.shape)} to {list(env[target].shape)} "
                             "cannot replay as identity")
        env[target] = env[target].copy_(value) if target in env else value.clone()


def _replay_fused(index: int, op: Dict[str, Any], env: Dict[str, torch.Tensor], first: FirstNonFinite,
                  dtype: Optional[torch.dtype], device: torch.device, leaf_names: Set[str],
                  references: Optional[Dict[int, Any]] = None) -> None:
    """A fused entry: its saved outputs (leaves) stand in the captured dtype, its reference math's replace
    them in a cast run where there is one; named where its inputs are finite and its outputs not.
    ``references``: in the captured dtype, the digests of its reference math's outputs go there (by op
    index; null where no reference covers the call), to compare the kernel with them."""
    lookup = _from_env(env)
    args = decode(op["args"], lookup, dtype, device)
    kwargs = {key: decode(value, lookup, dtype, device) for key, value in op["kwargs"].items()}
    finite = first.inputs_finite(op["op"], args, kwargs)
    saved = decode(op["out"], lookup)
    if dtype is not None:
        computed = compute(op, args, kwargs, saved, dtype)
        if computed is not None:
            _bind(op["out"], computed, env, leaf_names)
    elif references is not None:
        with torch.no_grad():
            computed = compute(op, args, kwargs, saved)
        references[index] = None if computed is None else digests_of(computed)
    found = first.found
    first.check(index, op["op"], finite, decode(op["out"], lookup))
    now = first.found
    if now is not None and now is not found:
        now["fused"] = dict(op["fused"])
        if dtype is None:
            now["fused"].update(judge(op, args, kwargs, saved))


def _replay_op(index: int, op: Dict[str, Any], env: Dict[str, torch.Tensor], first: FirstNonFinite,
               growth: FirstGrowth, dtype: Optional[torch.dtype], device: torch.device,
               leaf_names: Set[str], references: Optional[Dict[int, Any]] = None,
               uninitialized_fill: Optional[int] = None) -> None:
    if is_fused(op):
        _replay_fused(index, op, env, first, dtype, device, leaf_names, references)
        return
    if op.get("collective"):
        _replay_collective(op, env)
        return
    if op.get("external"):
        return  # its outputs are leaves, already in ``env``
    if op.get("opaque"):
        raise TraceError("takes an argument that was not recorded (see 'opaque'): cannot replay")
    func = replayable_op(op["op"])
    lookup = _from_env(env)
    args = decode(op["args"], lookup, dtype, device)
    kwargs = {key: decode(value, lookup, dtype, device) for key, value in op["kwargs"].items()}
    if dtype is not None and op["op"] in HALF_TO_FLOAT:
        args[2] = False
    check_call(func, args, kwargs)
    finite = first.inputs_finite(op["op"], args, kwargs)
    magnitudes = growth.inputs(op["op"], args, kwargs)
    out = func(*args, **kwargs)
    check_tensors(out, "the result")
    if returns_uninitialized(op["op"]):
        _poison(out, uninitialized_fill)
    first.check(index, op["op"], finite, out)
    growth.check(index, op["op"], magnitudes, out)
    _bind(op["out"], out, env)


def _poison(created: Any, fill: Optional[int] = None) -> None:
    """Fill what an ``empty``-like op returned with NaN (integers with 0), or with ``fill`` where given:
    the replay's answer never depends on what the allocator held, and an op that really reads the garbage
    reads NaN, every time, on every machine. (An op that ignores it, ``baddbmm(..., beta=0)``, is not
    blamed: ``read_inputs``.) A second fill tells which outputs depend on the garbage
    (``command.garbage_dependent``)."""
    for tensor in tensors_in(created):
        with torch.no_grad():
            if fill is not None:
                tensor.fill_(fill)
            else:
                tensor.fill_(math.nan if tensor.is_floating_point() or tensor.is_complex() else 0)


def _output_grads(encoded: Any, grads: Any) -> Iterator[Tuple[str, Any]]:
    """(output tensor name, its gradient) pairs, walking the encoded outputs and ``grads`` together."""
    if isinstance(encoded, dict) and "t" in encoded:
        yield encoded["t"], grads
        return
    if isinstance(encoded, dict) and isinstance(encoded.get("dict"), dict):
        if not isinstance(grads, dict) or set(grads) != set(encoded["dict"]):
            raise TraceError("grad_outputs do not have the outputs' structure")
        for key, child in encoded["dict"].items():
            yield from _output_grads(child, grads[key])
        return
    children = child_encodings(encoded)
    if children:
        if not isinstance(grads, (list, tuple)) or len(grads) != len(children):
            raise TraceError("grad_outputs do not have the outputs' structure")
        for child, grad in zip(children, grads):
            yield from _output_grads(child, grad)


def _backward(outputs: Any, env: Dict[str, torch.Tensor], grad_outputs: Any,
              graph_leaves: Dict[str, torch.Tensor], dtype: Optional[torch.dtype], device: torch.device,
              max_ops: Optional[int]) -> Tuple[Dict[str, Optional[torch.Tensor]], Optional[Dict[str, Any]]]:
    """Leaf gradients for the given output gradients, and the first non-finite backward op."""
    pairs = [(env[name], grad.detach().to(device=device, dtype=cast_dtype(grad.dtype, dtype)))
             for name, grad in _output_grads(outputs, grad_outputs)
             if isinstance(grad, torch.Tensor) and env[name].requires_grad]
    if not pairs or not graph_leaves:
        return dict.fromkeys(graph_leaves), None
    with _Watch(max_ops) as watch:
        grads = torch.autograd.grad([out for out, _ in pairs], list(graph_leaves.values()),
                                    grad_outputs=[grad for _, grad in pairs], allow_unused=True)
    return dict(zip(graph_leaves, grads)), watch.first.found


def output_tree(trace: Trace, values: Callable[[int], Any]) -> Any:
    """The module's output structure with ``values(i)`` in place of its i-th tensor, in the order the
    outputs list them (e.g. the gradients captured for them, to pass as ``grad_outputs``)."""
    positions = iter(range(len(refs(trace.outputs))))
    return decode(trace.outputs, lambda name: values(next(positions)))


def replay(trace: Trace, dtype: Optional[torch.dtype] = None, grad_outputs: Any = None,
           grad_leaves: Sequence[str] = (), device: Optional[torch.device] = None,
           max_ops: Optional[int] = None, digests: bool = False,
           uninitialized_fill: Optional[int] = None) -> ReplayResult:
    """Re-execute ``trace.ops`` on copies of ``trace.leaves``.

    ``dtype``: every floating leaf and floating dtype argument becomes it (an fp16 computation becomes an
    fp64 one). ``grad_leaves``: the leaves to differentiate (all floating leaves when ``grad_outputs`` is
    given and this is empty). ``grad_outputs``: the output tree's gradients (tensors or None), cast like
    the leaves; the backward then runs and the leaf gradients come back. ``device``: where to replay (the
    leaves' device by default); every device argument maps to it. Autocast is off: its casts are
    recorded ops already. ``max_ops``: the most ops the forward (the trace, checked before anything runs)
    and the backward (counted as it runs) may each run. Every op is checked before it runs
    (``checks``). Errors of the ops themselves come back as TraceError naming the op. ``digests``:
    take the digest of every forward op's outputs as it runs, to compare with the capture's (and, in the
    captured dtype, of each fused entry's reference math). ``uninitialized_fill``: what ``empty``-like ops
    return (NaN, integers 0, by default: ``_poison``)."""
    refusal = None if max_ops is None else trace_too_long(len(trace.ops), max_ops)
    if refusal is not None:
        raise TraceError(refusal)
    check_tensors([trace.leaves, grad_outputs], "a leaf or incoming gradient")
    device = torch.device(device) if device is not None else next(
        (t.device for t in trace.leaves.values()), torch.device("cpu"))
    if grad_outputs is not None and not grad_leaves:
        grad_leaves = [name for name, t in trace.leaves.items() if t.is_floating_point()]
    env, graph_leaves = _replay_leaves(trace.leaves, dtype, device, grad_leaves)
    forward = FirstNonFinite(phase="forward")
    growth = FirstGrowth(forward, phase="forward")
    leaf_names = set(trace.leaves)
    taken: Optional[List[List[Dict[str, Any]]]] = [] if digests else None
    references: Optional[Dict[int, Any]] = {} if digests and dtype is None else None
    with torch.autocast(device.type, enabled=False), torch.set_grad_enabled(bool(graph_leaves)):
        for index, op in enumerate(trace.ops):
            try:
                _replay_op(index, op, env, forward, growth, dtype, device, leaf_names, references,
                           uninitialized_fill)
            except TraceError as error:
                raise TraceError(f"op {index} ({op.get('op')}): {error}") from None
            except (RuntimeError, TypeError, IndexError, ValueError, OverflowError, MemoryError) as error:
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise TraceError(f"op {index} ({op.get('op')}) failed at replay: {first_line}") from error
            if taken is not None:
                taken.append([digest(env[name]) for name in refs(op["out"])])
        outputs = decode(trace.outputs, _from_env(env))
        grads: Dict[str, Optional[torch.Tensor]] = {}
        backward = None
        if grad_outputs is not None:
            grads, backward = _backward(trace.outputs, env, grad_outputs, graph_leaves, dtype, device,
                                        max_ops)
    return ReplayResult(outputs=outputs, first_nonfinite=forward.found or backward, grads=grads,
                        first_growth=growth.found, digests=taken, reference_digests=references)
