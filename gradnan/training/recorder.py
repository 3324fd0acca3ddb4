"""Record one module call as a list of aten operations (``gradnan.formats.trace``), for capture.

``OpRecorder`` is a ``TorchDispatchMode``: it sees every operator below autograd (and below autocast, so
the casts autocast inserts are recorded too) and writes each one down as JSON, and clones, once, every
tensor an op consumed that no recorded op produced (inputs, parameters, buffers). That is what makes
Megatron's tensor-parallel shards replayable in a plain process: no module has to be rebuilt.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..formats.trace import (
    COLLECTIVE_NAMESPACES,
    FirstNonFinite,
    Trace,
    TraceError,
    allowed_in_replay,
    encode,
    nodes,
    op_inputs,
    op_name,
)


class OpRecorder(TorchDispatchMode):
    """While active, records every op dispatched:
    ``with OpRecorder() as recorder: out = module(*args, **kwargs)``."""

    def __init__(self) -> None:
        super().__init__()
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # never keeps an activation alive
        self._marked: Set[str] = set()
        self._produced: Set[str] = set()
        self._leaves: Dict[str, torch.Tensor] = {}
        self._ops: List[Dict[str, Any]] = []
        self._count = 0
        self._first = FirstNonFinite()
        self.broken: Optional[str] = None  # why recording stopped, if it had to

    def mark_inputs(self, tree: Any, prefix: str) -> None:
        """Name the tensors of an input tree before running (``args.0``, ``kwargs.mask``,
        ``param.weight``) so that the leaves have stable names; other values are ignored."""
        if isinstance(tree, torch.Tensor):
            if prefix in self._marked:
                raise ValueError(f"input name {prefix!r} given twice")
            if tree not in self._names:
                self._names[tree] = prefix
                self._marked.add(prefix)
        elif isinstance(tree, (list, tuple)):
            for position, item in enumerate(tree):
                self.mark_inputs(item, f"{prefix}.{position}")
        elif isinstance(tree, dict):
            for key, item in tree.items():
                self.mark_inputs(item, f"{prefix}.{key}")

    def result(self, outputs: Any) -> Trace:
        """The Trace, after the with-block, with ``outputs`` (the module's return tree) as references;
        TraceError if recording failed part-way (the ops themselves ran normally)."""
        if self.broken is not None:
            raise TraceError(f"recording stopped: {self.broken}")
        encoded = encode(outputs, self._input_name)
        return Trace(ops=list(self._ops), leaves=dict(self._leaves), outputs=encoded,
                     first_nonfinite=self._first.found)

    def _fresh(self, tensor: torch.Tensor, prefix: str) -> str:
        name = f"{prefix}{self._count}"
        self._count += 1
        self._names[tensor] = name
        return name

    def _input_name(self, tensor: torch.Tensor) -> str:
        """A consumed tensor's name; one no op produced becomes a leaf, cloned before anything mutates it."""
        name = self._names.get(tensor) or self._fresh(tensor, "t")
        if name not in self._produced and name not in self._leaves:
            self._leaves[name] = tensor.detach().clone()
        return name

    def _output_name(self, tensor: torch.Tensor) -> str:
        """An in-place op returns its input under the input's name; anything else is new."""
        name = self._names.get(tensor)
        if name is None:
            name = self._fresh(tensor, "%")
            self._produced.add(name)
        return name

    def _external_output(self, tensor: torch.Tensor) -> str:
        """An op that is never executed at replay: its output is saved as a leaf."""
        name = self._fresh(tensor, "%")
        self._produced.add(name)
        self._leaves[name] = tensor.detach().clone()
        return name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.broken is not None:
            return func(*args, **kwargs)
        try:
            entry, finite = self._begin(func, args, kwargs)
        except Exception as exc:  # the recording must never break the op it records
            self.broken = f"{type(exc).__name__}: {exc}"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._first.check(len(self._ops), entry["op"], finite, out)
            entry["out"] = encode(out, self._external_output if entry.get("external") else self._output_name)
            self._ops.append(entry)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
        return out

    def _begin(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        name = op_name(func)
        namespace = func.namespace
        entry: Dict[str, Any] = {"op": name}
        if namespace in COLLECTIVE_NAMESPACES:
            entry["collective"] = True
        elif namespace != "aten" or not allowed_in_replay(func.__name__.split(".")[0]):
            entry["external"] = True  # not executed at replay: its outputs become leaves
        entry["args"] = [encode(value, self._input_name) for value in args]
        entry["kwargs"] = {key: encode(value, self._input_name) for key, value in kwargs.items()}
        if any("opaque" in node for node in nodes(op_inputs(entry))):
            entry["opaque"] = True
        return entry, self._first.inputs_finite(name, args, kwargs)
