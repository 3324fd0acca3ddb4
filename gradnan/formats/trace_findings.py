"""Which op of a module call to blame: ``FirstNonFinite`` (the first op whose floating inputs are all
finite and whose output is not) and ``FirstGrowth`` (the first op before it whose output grew out of line
over its inputs), with ``read_inputs``, what an op really reads of its arguments.

Apart from ``trace`` because the training side (``gradnan.training.recorder``) and the offline replay
(``gradnan.offline.trace_replay``) both judge by these, op by op as the ops run, so "the first non-finite
op" means the same thing at record time and at replay; the trace document only stores the answer.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from .magnitude import entries_growth
from .trace_ops import returns_uninitialized


def _finite(tree: Any) -> bool:
    """Every floating tensor and Python float of a tree is free of NaN/Inf (one host read each)."""
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(value).all()):
                return False
        elif isinstance(value, float) and not math.isfinite(value):
            return False
    return True


# ``beta=0`` means the op ignores its first argument (``baddbmm(buffer, q, k, beta=0)``: Megatron's attention
# hands it a ``torch.empty`` buffer whose bytes are whatever the allocator returned)
_BETA_IGNORES_INPUT = frozenset({"addmm", "addbmm", "baddbmm", "addmv", "addr"})


def read_inputs(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
    """What op ``name`` (``aten.<op>.<overload>``) reads of its arguments: the first argument of a
    ``beta=0`` product and an ``out=`` destination are left out, so their bytes (uninitialized memory, a
    previous value) cannot make the op's inputs count as non-finite. (Ops that only select or overwrite,
    ``where``, ``masked_fill``, ``copy_``, never turn finite values non-finite, so what they skip cannot
    change which op is named.)"""
    op = name.split(".")[1] if name.count(".") >= 2 else name
    read = list(args)
    if op.rstrip("_") in _BETA_IGNORES_INPUT and read and _is_zero(kwargs.get("beta")):
        read[0] = None
    return read, {key: value for key, value in kwargs.items() if key != "out"}


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


class FirstNonFinite:
    """The first op whose floating inputs are all finite and whose output is not. A non-finite
    scalar argument counts as an input (``masked_fill(mask, -inf)`` is not to blame for its -inf); an
    argument the op does not read does not (``read_inputs``)."""

    def __init__(self, **extra: Any) -> None:
        self.found: Optional[Dict[str, Any]] = None
        self._extra = extra

    def inputs_finite(self, name: str, args: Any, kwargs: Any) -> bool:
        """Checked before the op runs, since an in-place op overwrites its input."""
        return self.found is None and _finite(read_inputs(name, args, kwargs))

    def check(self, index: int, name: str, inputs_finite: bool, out: Any) -> None:
        if inputs_finite and not returns_uninitialized(name) and not _finite(out):
            self.found = {"index": index, "op": name, **self._extra}


def _magnitudes(tree: Any, kind: str) -> List[Tuple[str, str, float]]:
    """(kind, dtype, abs-max) of every non-empty floating tensor of a tree (one host read each), and of
    every Python float (a multiplier is an input; no dtype). Integers (sizes, dimensions) are not
    magnitudes."""
    found = []
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
            found.append((kind, str(value.dtype), float(value.detach().abs().max())))
        elif isinstance(value, float):
            found.append((kind, "", abs(value)))
    return found


class FirstGrowth:
    """The first op, before the first non-finite one (``before``), whose output grew out of line over its
    floating inputs (``gradnan.formats.magnitude``: an abs-max 2^20 times its inputs', or close to its
    dtype's limit). Ops without a floating tensor input (creation ops) and ops that may return
    uninitialized memory are not judged."""

    def __init__(self, before: FirstNonFinite, **extra: Any) -> None:
        self.found: Optional[Dict[str, Any]] = None
        self._before, self._extra = before, extra

    def inputs(self, name: str, args: Any, kwargs: Any) -> Optional[List[Tuple[str, str, float]]]:
        """The magnitudes of what the op reads, taken before it runs (an in-place op overwrites its input);
        None once there is nothing left to look for."""
        if self.found is not None or self._before.found is not None or returns_uninitialized(name):
            return None
        inputs = _magnitudes(read_inputs(name, args, kwargs), "input")
        return inputs if any(dtype for _, dtype, _ in inputs) else None

    def check(self, index: int, name: str, inputs: Optional[List[Tuple[str, str, float]]], out: Any) -> None:
        if inputs is None or self._before.found is not None:
            return
        growth = entries_growth(inputs + _magnitudes(out, "output"))
        if growth is not None:
            self.found = {"index": index, "op": name, **growth.to_json(), **self._extra}
