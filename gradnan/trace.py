"""Record one module call as a list of aten operations, and replay it later without the module's code.

``OpRecorder`` is a ``TorchDispatchMode``: it sees every operator below autograd (and below autocast, so
the casts autocast inserts are recorded too) and writes each one down as JSON — its overload name
(``aten.addmm.default``), its arguments with tensors as references, the names of its outputs — and
clones, once, every tensor an op consumed that no recorded op produced (inputs, parameters, buffers).
A ``Trace`` is therefore JSON plus a flat ``name -> tensor`` dict: saved with ``torch.save`` and loaded
with ``weights_only=True``, nothing in it is pickled code. That is what makes Megatron's tensor-parallel
shards replayable in a plain process: no module has to be rebuilt.

``replay`` runs the ops again on copies of the leaves, in the captured dtype or with every floating
tensor (and every floating dtype argument) in float32/float64, forward and optionally backward, and
names the first op whose floating inputs were all finite and whose output was not. Op names are looked
up only in ``torch.ops.aten`` and ``torch.ops.prims``: a trace can name no other code.

What a replay cannot do, by construction:
- Collectives (``c10d``, ``_c10d_functional``: they do dispatch under the mode, e.g. ``allreduce_``
  with its ProcessGroup as an opaque argument) replay as identity: a single process sees only its
  own shard's partial result. A collective that changes shapes (all-gather over several ranks) cannot.
- Ops of other namespaces (``torch.library`` custom ops) are not executed: their outputs are saved
  as leaves, so the replay continues from the recorded values and no gradient flows through them.
  Work done outside the dispatcher (pybind kernels, e.g. Transformer Engine's) is not seen at all:
  its results simply become leaves where recorded ops consume them.
- Random ops draw from the current generator: a replay reproduces dropout only if the caller restores
  the RNG state of the recording first. An argument that cannot be written as JSON (a Generator)
  marks its op ``opaque``; such an op does not replay.
- Control flow is frozen: Python numbers read from tensors during the call are recorded as constants.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

TRACE_SCHEMA = "gradnan.trace"
TRACE_VERSION = 1

REPLAYABLE_NAMESPACES = ("aten", "prims")
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# Ops that return uninitialized memory: garbage that happens to be NaN is nobody's fault.
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided", "resize_"})
# ``half_to_float`` is legal for a float16 input only; a replay cast to another dtype drops it.
_HALF_TO_FLOAT = frozenset({"aten._softmax.default", "aten._log_softmax.default"})
_OP_NAME = re.compile(r"(\w+)\.(\w+)\.(\w+)")
_OP_KEYS = frozenset({"op", "collective", "external", "opaque", "args", "kwargs", "out"})
_DOCUMENT_KEYS = frozenset({"schema", "version", "ops", "outputs", "first_nonfinite", "leaves"})


class TraceError(ValueError):
    """A malformed trace or an op that may not be replayed; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --- encoding ---------------------------------------------------------------------------------


def _encode(value: Any, name_of: Callable[[torch.Tensor], str]) -> Any:
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
        return {"tuple": [_encode(item, name_of) for item in value]}
    if isinstance(value, list):
        return [_encode(item, name_of) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _encode(item, name_of) for key, item in value.items()}}
    for kind, tag in ((torch.dtype, "dtype"), (torch.device, "device"), (torch.layout, "layout"),
                      (torch.memory_format, "memory_format")):
        if isinstance(value, kind):
            return {tag: str(value).removeprefix("torch.")}
    return {"opaque": type(value).__name__}


def _children(encoded: Any) -> List[Any]:
    if isinstance(encoded, list):
        return encoded
    if isinstance(encoded, dict) and isinstance(encoded.get("tuple"), list):
        return encoded["tuple"]
    if isinstance(encoded, dict) and isinstance(encoded.get("dict"), dict):
        return list(encoded["dict"].values())
    return []


def _nodes(encoded: Any) -> Iterator[Dict[str, Any]]:
    """Every tagged node (``{"t": ...}``, ``{"opaque": ...}``, ...) of an encoding."""
    if isinstance(encoded, dict):
        yield encoded
    for child in _children(encoded):
        yield from _nodes(child)


def _refs(encoded: Any) -> List[str]:
    """The tensor names an encoding refers to, in order."""
    return [node["t"] for node in _nodes(encoded) if isinstance(node.get("t"), str)]


def _op_inputs(op: Dict[str, Any]) -> List[Any]:
    return list(op["args"]) + list(op["kwargs"].values())


def _torch_constant(name: Any, kind: type) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) and re.fullmatch(r"[a-z]\w*", name) else None
    if not isinstance(value, kind):
        raise TraceError(f"unknown {kind.__name__} {name!r}")
    return value


def _cast(dtype: torch.dtype, to: Optional[torch.dtype]) -> torch.dtype:
    """The replay dtype for a floating dtype, when there is one; every other dtype stays."""
    return to if to is not None and dtype.is_floating_point else dtype


def _decode(encoded: Any, tensor_of: Callable[[str], Any], dtype: Optional[torch.dtype] = None,
            device: Optional[torch.device] = None) -> Any:
    """The Python value of an encoding; strict, since it is also the validator of untrusted traces.
    ``dtype`` replaces floating dtype arguments and ``device`` every device argument."""
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    if isinstance(encoded, list):
        return [_decode(item, tensor_of, dtype, device) for item in encoded]
    if not (isinstance(encoded, dict) and len(encoded) == 1):
        raise TraceError(f"malformed value {repr(encoded)[:80]}")
    (tag, value), = encoded.items()
    if tag == "t" and isinstance(value, str):
        return tensor_of(value)
    if tag == "float" and value in ("nan", "inf", "-inf"):
        return float(value)
    if tag == "tuple" and isinstance(value, list):
        return tuple(_decode(item, tensor_of, dtype, device) for item in value)
    if tag == "dict" and isinstance(value, dict):
        return {key: _decode(item, tensor_of, dtype, device) for key, item in value.items()}
    if tag == "dtype":
        return _cast(_torch_constant(value, torch.dtype), dtype)
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


def _replayable(name: Any) -> Any:
    """The aten/prims ``OpOverload`` a name denotes; nothing else can be reached from a trace."""
    match = _OP_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or match[1] not in REPLAYABLE_NAMESPACES:
        raise TraceError(f"op {repr(name)[:80]} is not an aten or prims op: refused")
    packet = getattr(getattr(torch.ops, match[1]), match[2], None)
    overload = getattr(packet, match[3], None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    if not isinstance(overload, torch._ops.OpOverload):
        raise TraceError(f"op {name!r} does not exist in this torch")
    return overload


def _op_name(func: Any) -> str:
    return f"{func.namespace}.{func.__name__}"


# --- the first non-finite op ------------------------------------------------------------------


def _finite(tree: Any) -> bool:
    """Every floating tensor and Python float of a tree is free of NaN/Inf (one host read each)."""
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(value).all()):
                return False
        elif isinstance(value, float) and not math.isfinite(value):
            return False
    return True


class _FirstNonFinite:
    """The first op whose floating inputs are all finite and whose output is not. A non-finite
    scalar argument counts as an input (``masked_fill(mask, -inf)`` is not to blame for its -inf)."""

    def __init__(self, **extra: Any) -> None:
        self.found: Optional[Dict[str, Any]] = None
        self._extra = extra

    def inputs_finite(self, args: Any, kwargs: Any) -> bool:
        """Checked before the op runs, since an in-place op overwrites its input."""
        return self.found is None and _finite((args, kwargs))

    def check(self, index: int, name: str, inputs_finite: bool, out: Any) -> None:
        if inputs_finite and name.split(".")[1] not in _UNINITIALIZED and not _finite(out):
            self.found = {"index": index, "op": name, **self._extra}


class _Watch(TorchDispatchMode):
    """Counts the ops dispatched (a backward's) and finds the first non-finite one among them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.first = _FirstNonFinite(phase="backward")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        finite = self.first.inputs_finite(args, kwargs)
        out = func(*args, **kwargs)
        self.first.check(self.count, _op_name(func), finite, out)
        self.count += 1
        return out


# --- the trace and its recording ------------------------------------------------------------


@dataclass
class Trace:
    """One module call: ``ops`` (JSON, in execution order), the tensors they started from, the
    encoded return tree and the first op that turned finite inputs into a NaN/Inf at record time."""

    ops: List[Dict[str, Any]]
    leaves: Dict[str, torch.Tensor]
    outputs: Any
    first_nonfinite: Optional[Dict[str, Any]]

    def to_json(self) -> Dict[str, Any]:
        return {
            "schema": TRACE_SCHEMA,
            "version": TRACE_VERSION,
            "ops": self.ops,
            "outputs": self.outputs,
            "first_nonfinite": self.first_nonfinite,
            "leaves": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for name, t in self.leaves.items()},
        }

    @staticmethod
    def from_json(document: Dict[str, Any], leaves: Dict[str, torch.Tensor]) -> "Trace":
        """Validate a document from ``to_json`` against its tensors (``leaves`` may hold other tensors
        too: only the trace's are taken). Raises TraceError on anything malformed or refused."""
        if not isinstance(document, dict) or document.get("schema") != TRACE_SCHEMA:
            raise TraceError(f"not a {TRACE_SCHEMA} document")
        version = document.get("version")
        if type(version) is not int or version != TRACE_VERSION:
            newer = isinstance(version, int) and version > TRACE_VERSION
            raise TraceError(f"trace version {version!r} is {'newer than' if newer else 'not'} the one "
                             f"this gradnan reads ({TRACE_VERSION})")
        if set(document) != _DOCUMENT_KEYS:
            raise TraceError(f"a trace has exactly the keys {sorted(_DOCUMENT_KEYS)}")
        taken = _checked_leaves(document["leaves"], leaves)
        ops = document["ops"]
        if not isinstance(ops, list):
            raise TraceError("'ops' must be a list")
        defined = set(taken)
        for index, op in enumerate(ops):
            _check_op(index, op, defined, set(taken))
        _decode(document["outputs"], _defined_in(defined, "the outputs"))
        first = document["first_nonfinite"]
        if first is not None and not (isinstance(first, dict) and set(first) == {"index", "op"}
                                      and isinstance(first["index"], int) and isinstance(first["op"], str)):
            raise TraceError("'first_nonfinite' must be null or {\"index\": int, \"op\": str}")
        return Trace(ops=ops, leaves=taken, outputs=document["outputs"], first_nonfinite=first)


def _checked_leaves(meta: Any, leaves: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The trace's tensors out of ``leaves``, each of the shape and dtype the document says."""
    if not isinstance(meta, dict):
        raise TraceError("'leaves' must be an object")
    taken = {}
    for name, spec in meta.items():
        tensor = leaves.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise TraceError(f"leaf {name!r} is missing from the tensors")
        if not (isinstance(spec, dict) and spec.get("shape") == list(tensor.shape)
                and spec.get("dtype") == str(tensor.dtype).removeprefix("torch.")):
            raise TraceError(f"leaf {name!r} is not the {spec!r} the trace says")
        taken[name] = tensor
    return taken


def _defined_in(defined: Set[str], where: str) -> Callable[[str], str]:
    def check(name: str) -> str:
        if name not in defined:
            raise TraceError(f"{where} use tensor {name!r}, which no leaf or earlier op provides")
        return name
    return check


def _check_op(index: int, op: Any, defined: Set[str], leaf_names: Set[str]) -> None:
    """One op entry: well formed, replayable or flagged as not executed, referring only to tensors
    defined before it. Adds the names it produces to ``defined``."""
    name = op.get("op") if isinstance(op, dict) else None
    try:
        if not (isinstance(op, dict) and _OP_KEYS.issuperset(op) and {"op", "args", "kwargs", "out"} <= set(op)
                and all(op.get(flag, True) is True for flag in ("collective", "external", "opaque"))):
            raise TraceError("malformed entry")
        match = _OP_NAME.fullmatch(name) if isinstance(name, str) else None
        if op.get("collective"):
            if match is None or match[1] not in COLLECTIVE_NAMESPACES:
                raise TraceError("marked collective but not a c10d op")
        elif op.get("external"):
            if match is None:
                raise TraceError("malformed op name")
            if not leaf_names.issuperset(_refs(op["out"])):
                raise TraceError("the outputs of an external op must be leaves")
        else:
            _replayable(name)
        if not isinstance(op["args"], list) or not isinstance(op["kwargs"], dict):
            raise TraceError("'args' must be a list and 'kwargs' an object")
        for encoded in _op_inputs(op):
            _decode(encoded, _defined_in(defined, "arguments"))
        if any("opaque" in node for node in _nodes(_op_inputs(op))) != bool(op.get("opaque")):
            raise TraceError("'opaque' must mark exactly the ops with an opaque argument")
        _decode(op["out"], str)
    except TraceError as error:
        raise TraceError(f"op {index} ({repr(name)[:80]}): {error}") from None
    defined.update(_refs(op["out"]))


class OpRecorder(TorchDispatchMode):
    """While active, records every op dispatched: ``with OpRecorder() as recorder: out = module(*args, **kwargs)``."""

    def __init__(self) -> None:
        super().__init__()
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # never keeps an activation alive
        self._marked: Set[str] = set()
        self._produced: Set[str] = set()
        self._leaves: Dict[str, torch.Tensor] = {}
        self._ops: List[Dict[str, Any]] = []
        self._count = 0
        self._first = _FirstNonFinite()
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
        encoded = _encode(outputs, self._input_name)
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
            entry["out"] = _encode(out, self._external_output if entry.get("external") else self._output_name)
            self._ops.append(entry)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
        return out

    def _begin(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        name = _op_name(func)
        namespace = func.namespace
        entry: Dict[str, Any] = {"op": name}
        if namespace in COLLECTIVE_NAMESPACES:
            entry["collective"] = True
        elif namespace not in REPLAYABLE_NAMESPACES:
            entry["external"] = True
        entry["args"] = [_encode(value, self._input_name) for value in args]
        entry["kwargs"] = {key: _encode(value, self._input_name) for key, value in kwargs.items()}
        if any("opaque" in node for node in _nodes(_op_inputs(entry))):
            entry["opaque"] = True
        return entry, self._first.inputs_finite(args, kwargs)


# --- replay -----------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """The replayed output tree, the first non-finite op (forward, then backward: ``index`` into the
    trace's ops, or into the ops the backward dispatched) and the requested leaf gradients."""

    outputs: Any
    first_nonfinite: Optional[Dict[str, Any]]
    grads: Dict[str, Optional[torch.Tensor]]


def _replay_leaves(leaves: Dict[str, torch.Tensor], dtype: Optional[torch.dtype], device: torch.device,
                   grad_names: Sequence[str]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Private copies of the leaves (the trace is never mutated) and the graph leaves to differentiate."""
    for name in grad_names:
        if name not in leaves or not leaves[name].is_floating_point():
            raise TraceError(f"cannot differentiate {name!r}: not a floating leaf of the trace")
    env, graph_leaves = {}, {}
    for name, tensor in leaves.items():
        copy = tensor.detach().to(device=device, dtype=_cast(tensor.dtype, dtype), copy=True)
        if name in grad_names:
            graph_leaves[name] = copy.requires_grad_()
            copy = copy.clone()  # in-place ops on a graph leaf are illegal (on real activations they are not)
        env[name] = copy
    return env, graph_leaves


def _from_env(env: Dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def lookup(name: str) -> torch.Tensor:
        if name not in env:
            raise TraceError(f"tensor {name!r} is used before anything produced it")
        return env[name]
    return lookup


def _bind(encoded: Any, value: Any, env: Dict[str, torch.Tensor]) -> None:
    """Name the tensors an op returned at replay as the trace named them at record time."""
    if isinstance(encoded, dict) and "t" in encoded:
        if not isinstance(value, torch.Tensor):
            raise TraceError("returned something else than a tensor at replay")
        env[encoded["t"]] = value
        return
    children = _children(encoded)
    if children:
        if not isinstance(value, (list, tuple)) or len(value) != len(children):
            raise TraceError("returned a different structure at replay")
        for child, item in zip(children, value):
            _bind(child, item, env)


def _replay_collective(op: Dict[str, Any], env: Dict[str, torch.Tensor]) -> None:
    """Identity: each output takes the value of the input in its position (a no-op for an in-place
    all-reduce; a copy into the destination for ``_allgather_base_(out, in)``; a clone for a
    functional collective)."""
    inputs, outputs = _refs(_op_inputs(op)), _refs(op["out"])
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


def _replay_op(index: int, op: Dict[str, Any], env: Dict[str, torch.Tensor], first: _FirstNonFinite,
               dtype: Optional[torch.dtype], device: torch.device) -> None:
    if op.get("collective"):
        _replay_collective(op, env)
        return
    if op.get("external"):
        return  # its outputs are leaves, already in ``env``
    if op.get("opaque"):
        raise TraceError("takes an argument that was not recorded (see 'opaque'): cannot replay")
    func = _replayable(op["op"])
    lookup = _from_env(env)
    args = _decode(op["args"], lookup, dtype, device)
    kwargs = {key: _decode(value, lookup, dtype, device) for key, value in op["kwargs"].items()}
    if dtype is not None and op["op"] in _HALF_TO_FLOAT:
        args[2] = False
    finite = first.inputs_finite(args, kwargs)
    out = func(*args, **kwargs)
    first.check(index, op["op"], finite, out)
    _bind(op["out"], out, env)


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
    children = _children(encoded)
    if children:
        if not isinstance(grads, (list, tuple)) or len(grads) != len(children):
            raise TraceError("grad_outputs do not have the outputs' structure")
        for child, grad in zip(children, grads):
            yield from _output_grads(child, grad)


def _backward(outputs: Any, env: Dict[str, torch.Tensor], grad_outputs: Any,
              graph_leaves: Dict[str, torch.Tensor], dtype: Optional[torch.dtype],
              device: torch.device) -> Tuple[Dict[str, Optional[torch.Tensor]], Optional[Dict[str, Any]]]:
    """Leaf gradients for the given output gradients, and the first non-finite backward op."""
    pairs = [(env[name], grad.detach().to(device=device, dtype=_cast(grad.dtype, dtype)))
             for name, grad in _output_grads(outputs, grad_outputs)
             if isinstance(grad, torch.Tensor) and env[name].requires_grad]
    if not pairs or not graph_leaves:
        return dict.fromkeys(graph_leaves), None
    with _Watch() as watch:
        grads = torch.autograd.grad([out for out, _ in pairs], list(graph_leaves.values()),
                                    grad_outputs=[grad for _, grad in pairs], allow_unused=True)
    return dict(zip(graph_leaves, grads)), watch.first.found


def output_tree(trace: Trace, values: Callable[[int], Any]) -> Any:
    """The module's output structure with ``values(i)`` in place of its i-th tensor, in the order the
    outputs list them (e.g. the gradients captured for them, to pass as ``grad_outputs``)."""
    positions = iter(range(len(_refs(trace.outputs))))
    return _decode(trace.outputs, lambda name: values(next(positions)))


def replay(trace: Trace, dtype: Optional[torch.dtype] = None, grad_outputs: Any = None,
           grad_leaves: Sequence[str] = (), device: Optional[torch.device] = None) -> ReplayResult:
    """Re-execute ``trace.ops`` on copies of ``trace.leaves``.

    ``dtype``: every floating leaf and floating dtype argument becomes it (an fp16 computation becomes an
    fp64 one). ``grad_leaves``: the leaves to differentiate (all floating leaves when ``grad_outputs`` is
    given and this is empty). ``grad_outputs``: the output tree's gradients (tensors or None), cast like
    the leaves; the backward then runs and the leaf gradients come back. ``device``: where to replay (the
    leaves' device by default); every device argument maps to it. Autocast is off: its casts are
    recorded ops already. Errors of the ops themselves come back as TraceError naming the op."""
    device = torch.device(device) if device is not None else next(
        (t.device for t in trace.leaves.values()), torch.device("cpu"))
    if grad_outputs is not None and not grad_leaves:
        grad_leaves = [name for name, t in trace.leaves.items() if t.is_floating_point()]
    env, graph_leaves = _replay_leaves(trace.leaves, dtype, device, grad_leaves)
    forward = _FirstNonFinite(phase="forward")
    with torch.autocast(device.type, enabled=False), torch.set_grad_enabled(bool(graph_leaves)):
        for index, op in enumerate(trace.ops):
            try:
                _replay_op(index, op, env, forward, dtype, device)
            except TraceError as error:
                raise TraceError(f"op {index} ({op.get('op')}): {error}") from None
            except (RuntimeError, TypeError, IndexError) as error:
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise TraceError(f"op {index} ({op.get('op')}) failed at replay: {first_line}") from error
        outputs = _decode(trace.outputs, _from_env(env))
        grads: Dict[str, Optional[torch.Tensor]] = {}
        backward = None
        if grad_outputs is not None:
            grads, backward = _backward(trace.outputs, env, grad_outputs, graph_leaves, dtype, device)
    return ReplayResult(outputs=outputs, first_nonfinite=forward.found or backward, grads=grads)
