"""Record one module call as a list of aten operations (``gradnan.formats.trace``), for capture.

``OpRecorder`` is a ``TorchDispatchMode``: it sees every operator below autograd (and below autocast, so
the casts autocast inserts are recorded too) and writes each one down as JSON, and clones, once, every
tensor an op consumed that no recorded op produced (inputs, parameters, buffers). That is what makes
Megatron's tensor-parallel shards replayable in a plain process: no module has to be rebuilt.

Kernels called outside the dispatcher (Transformer Engine, Megatron's fused softmax, apex, flash-attention)
run inside a custom ``torch.autograd.Function``: while recording, ``Function.apply`` is wrapped (through the
undo log, put back exactly on exit), and a Function whose outputs no recorded op inside it produced becomes
one ``fused`` entry: its class, the module it ran in, its inputs, and its outputs saved as values. Ops the
dispatcher does see inside it are recorded as usual, before it.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from ..formats.trace import Trace, digests_of, fused_name, tensors_in
from ..formats.trace_findings import FirstNonFinite
from ..formats.trace_ops import (
    COLLECTIVE_NAMESPACES,
    TraceError,
    allowed_in_replay,
    encode,
    nodes,
    op_inputs,
    op_name,
)
from ..patches.undo_log import Patcher
from .probe import enclosing_module


class OpRecorder(TorchDispatchMode):
    """While active, records every op dispatched:
    ``with OpRecorder() as recorder: out = module(*args, **kwargs)``."""

    def __init__(self, module_names: Callable[[], Dict[int, str]] = dict, digests: bool = True) -> None:
        """``module_names()``: module id -> global name, to say which module a fused Function ran in.
        ``digests``: take the digest of every op's outputs as it runs (``gradnan.formats.trace.digest``:
        one host copy of each), so that a later replay can be compared with the capture op by op."""
        super().__init__()
        self._digests: Optional[List[List[Dict[str, Any]]]] = [] if digests else None
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # never keeps an activation alive
        self._marked: Set[str] = set()
        self._produced: Dict[str, int] = {}  # name -> index of the entry that produced it
        self._leaves: Dict[str, torch.Tensor] = {}
        self._ops: List[Dict[str, Any]] = []
        self._count = 0
        self._first = FirstNonFinite()
        self.broken: Optional[str] = None  # why recording stopped, if it had to
        self._module_names = module_names
        self._thread = threading.get_ident()
        self._patches = Patcher()

    def __enter__(self) -> "OpRecorder":
        function = torch.autograd.Function
        self._patches.set(function, "apply", classmethod(self._boundary(vars(function)["apply"])))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.undo()

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
                     first_nonfinite=self._first.found,
                     digests=None if self._digests is None else list(self._digests))

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
            self._produced[name] = len(self._ops)
        return name

    def _external_output(self, tensor: torch.Tensor) -> str:
        """An op that is never executed at replay: its output is saved as a leaf."""
        name = self._fresh(tensor, "%")
        self._produced[name] = len(self._ops)
        self._leaves[name] = tensor.detach().clone()
        return name

    def _boundary(self, original: classmethod) -> Callable[..., Any]:
        """``Function.apply`` that records the Function as a fused entry where its work was not seen."""
        recorder = self

        def apply(cls, *args: Any, **kwargs: Any) -> Any:
            call = original.__get__(None, cls)
            if recorder.broken is not None or threading.get_ident() != recorder._thread:
                return call(*args, **kwargs)
            try:
                with _disable_current_modes():  # its own checks and clones are not the model's ops
                    entry, finite, start = recorder._begin_fused(cls, args, kwargs)
            except Exception as exc:  # the recording must never break the Function it records
                recorder.broken = f"{type(exc).__name__}: {exc}"
                return call(*args, **kwargs)
            out = call(*args, **kwargs)
            try:
                with _disable_current_modes():
                    recorder._end_fused(entry, finite, start, out)
            except Exception as exc:
                recorder.broken = f"{type(exc).__name__}: {exc}"
            return out

        return apply

    def _begin_fused(self, cls: Type[torch.autograd.Function], args: Any,
                     kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool, int]:
        """The entry of a Function about to run, its arguments named by its ``forward``'s signature (so a
        reference can take them by name), whether they are finite (before the call: a kernel may write in
        place), and the index its inner ops start at."""
        entry = {"op": fused_name(cls), "fused": {"class": cls.__qualname__, "class_module": cls.__module__,
                                                  "module": enclosing_module(self._module_names)}}
        return (*self._with_arguments(entry, *_bound(cls, args, kwargs)), len(self._ops))

    def _end_fused(self, entry: Dict[str, Any], finite: bool, start: int, out: Any) -> None:
        """Record the Function unless recorded ops inside it produced all its outputs (then they say it
        all); an output they did not produce (made by a kernel, or changed in place) is saved as a value."""
        def explained(tensor: torch.Tensor) -> bool:
            return self._produced.get(self._names.get(tensor), -1) >= start

        if all(explained(tensor) for tensor in tensors_in(out)):
            return
        entry["out"] = encode(out, lambda t: self._names[t] if explained(t) else self._external_output(t))
        self._first.check(len(self._ops), entry["op"], finite, out)
        self._append(entry, out)

    def _append(self, entry: Dict[str, Any], out: Any) -> None:
        """An entry of the trace, with the digests of what it returned (taken before anything changes it)."""
        if self._digests is not None:
            self._digests.append(digests_of(out))
        self._ops.append(entry)

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
            self._append(entry, out)
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
        return self._with_arguments(entry, args, kwargs)

    def _with_arguments(self, entry: Dict[str, Any], args: Any,
                        kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        """``entry`` with its arguments written down (tensors by name; ``opaque`` where one cannot be), and
        whether they are finite, read before the call (it may write into them)."""
        entry["args"] = [encode(value, self._input_name) for value in args]
        entry["kwargs"] = {key: encode(value, self._input_name) for key, value in kwargs.items()}
        if any("opaque" in node for node in nodes(op_inputs(entry))):
            entry["opaque"] = True
        return entry, self._first.inputs_finite(entry["op"], args, kwargs)


def _bound(cls: Type[torch.autograd.Function], args: Any,
           kwargs: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
    """A Function's arguments by the names of its ``forward`` (without ``ctx``, unless it has a
    ``setup_context``); as given where the signature does not bind them."""
    try:
        signature = inspect.signature(cls.forward)
        with_ctx = not torch.autograd.function._is_setup_context_defined(cls.setup_context)
        bound = signature.bind(*((None,) if with_ctx else ()), *args, **kwargs)
    except (TypeError, ValueError):
        return list(args), dict(kwargs)
    arguments = dict(bound.arguments)
    if with_ctx:
        arguments.pop(next(iter(signature.parameters)))
    return [], arguments
