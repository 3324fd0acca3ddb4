"""The op trace inside a capture bundle (``gradnan.trace``, JSON): the document, its validation and meaning.

A trace is one module call written down as the aten operations it dispatched: each op's overload name
(``aten.addmm.default``), its arguments with tensors as references, the names of its outputs, and a flat
``name -> tensor`` dict of the tensors the ops started from (inputs, parameters, buffers). Nothing in it is
pickled code. The training side writes traces (``gradnan.training.recorder``); the offline side replays
them (``gradnan.offline.replay.trace``); both judge "the first non-finite op" by ``FirstNonFinite``
(``trace_findings``), so the field means the same thing at record time and at replay. How one op is
written down, and which operators a replay may execute, is ``trace_ops``'; this module holds the document
(``Trace``), its checks, and the digests of what each op's outputs were.
"""

import ctypes
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from .schema import Schema
from .trace_ops import (
    _OP_NAME,
    COLLECTIVE_NAMESPACES,
    TraceError,
    decode,
    nodes,
    op_inputs,
    refs,
    replayable_op,
)

SCHEMA = Schema("gradnan.trace", 4)
# Version 2 added ``fused`` entries; a trace without one is still written as version 1, which older
# gradnan reads (it refuses a version 2 trace in one line, as newer than it reads). Version 3 added
# ``digests`` (what each op's outputs were at capture); a trace without them keeps its version 1 or 2.
# Version 4 added each digest's ``canonical_hash`` (its NaNs all written alike), with which a comparison tells
# a difference in NaN bit patterns alone from one in values.
FUSED_VERSION = 2
DIGEST_VERSION = 3
CANONICAL_VERSION = 4

# The precisions a replay runs a trace in, by label: as captured, then every floating tensor cast wider
# (``cast_dtype``); a fused kernel's reference math runs in the same three.
REPLAY_PRECISIONS = (("captured", None), ("float32", torch.float32), ("float64", torch.float64))
# ``half_to_float`` is legal for a float16 input only; a replay cast to another dtype drops it.
HALF_TO_FLOAT = frozenset({"aten._softmax.default", "aten._log_softmax.default"})
_OP_KEYS = frozenset({"op", "collective", "external", "opaque", "fused", "args", "kwargs", "out"})
_FUSED_KEYS = frozenset({"class", "class_module", "module"})
_FUSED_NAME = re.compile(r"[\w.<>]{1,300}")
_DOCUMENT_KEYS = frozenset({"schema", "version", "ops", "outputs", "first_nonfinite", "leaves"})
_DIGEST_KEYS = frozenset({"hash", "shape", "dtype", "abs_max", "abs_sum", "nonfinite"})
_CANONICAL_KEYS = _DIGEST_KEYS | {"canonical_hash"}
_HASH = re.compile(r"[0-9a-f]{32}")


# --- digests: what an op's outputs were ---------------------------------------------------------


@torch.no_grad()
def digest(tensor: torch.Tensor) -> Dict[str, Any]:
    """What a tensor holds, in a few numbers that any later replay can be compared with: ``hash``, a
    BLAKE2b (128 bits) of its bytes in C order; ``canonical_hash``, the same with every NaN written as one
    bit pattern (the same as ``hash`` where it has no NaN: two tensors whose ``hash`` differs and whose
    ``canonical_hash`` does not differ in their NaNs' sign or payload alone); its ``shape`` and ``dtype``;
    ``abs_max`` and ``abs_sum``, the largest and the float64 sum of its finite magnitudes (null where it
    has none, or is not floating); ``nonfinite``, how many elements are NaN or Inf. Read on the host: one
    copy of the tensor (none of a plain CPU one: a buffer that another thread is still
    writing, as gloo writes an MoE token exchange's, may change between the reads, so a largest magnitude
    read non-finite there is null, never a NaN that no JSON takes)."""
    host = _on_host(tensor)
    found: Dict[str, Any] = {
        "hash": _bytes_hash(host), "shape": list(host.shape), "dtype": str(host.dtype).removeprefix("torch."),
        "abs_max": None, "abs_sum": None, "nonfinite": 0}
    found["canonical_hash"] = found["hash"]
    if not host.is_floating_point() or host.numel() == 0:
        return found
    magnitudes = host.abs()
    total = float(magnitudes.sum(dtype=torch.float64))
    if not math.isfinite(total):  # the slow path only where something is NaN or Inf
        nan = torch.isnan(host)
        if bool(nan.any()):
            found["canonical_hash"] = _bytes_hash(torch.where(nan, torch.full((), math.nan, dtype=host.dtype),
                                                              host))
        finite = torch.isfinite(host)
        found["nonfinite"] = int(host.numel() - int(finite.sum()))
        magnitudes = torch.where(finite, magnitudes, 0)
        total = float(magnitudes.sum(dtype=torch.float64))
        if found["nonfinite"] == host.numel():
            return found
    largest = float(magnitudes.max())
    found["abs_max"] = largest if math.isfinite(largest) else None
    found["abs_sum"] = total if math.isfinite(total) else None
    return found


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself where it is a plain contiguous CPU tensor (not a subclass: a functional
    collective's result holds no data of its own until waited for), else a contiguous CPU copy of its
    values (``empty`` and ``copy_``): no ``detach``, ``clone``, ``contiguous`` or ``_to_copy``, operators a
    trace records, whose change in an environment would otherwise change every digest."""
    if (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _bytes_hash(host: torch.Tensor) -> str:
    """The BLAKE2b of a contiguous CPU tensor's bytes in C order, read in place (no operator runs)."""
    size = host.numel() * host.element_size()
    raw = (ctypes.c_char * size).from_address(host.data_ptr()) if size else b""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def digests_of(tree: Any) -> List[Dict[str, Any]]:
    """The digest of every tensor of an op's output tree, in the order its encoding names them."""
    return [digest(tensor) for tensor in tensors_in(tree)]


def _checked_digests(digests: Any, ops: List[Any], version: int) -> None:
    """``digests``: one list per op, one digest per tensor the op's ``out`` names, with the keys of its
    version."""
    if not (isinstance(digests, list) and len(digests) == len(ops)):
        raise TraceError("'digests' must be a list with one entry per op")
    keys = _CANONICAL_KEYS if version >= CANONICAL_VERSION else _DIGEST_KEYS
    for index, (entry, op) in enumerate(zip(digests, ops)):
        if not (isinstance(entry, list) and len(entry) == len(refs(op["out"]))
                and all(_digest_valid(item, keys) for item in entry)):
            raise TraceError(f"digests of op {index}: one {{{', '.join(sorted(keys))}}} per output tensor")


def _digest_valid(item: Any, keys: frozenset) -> bool:
    def magnitude(value: Any) -> bool:
        return value is None or (isinstance(value, float) and math.isfinite(value) and value >= 0)

    return (isinstance(item, dict) and set(item) == keys
            and all(isinstance(item[key], str) and bool(_HASH.fullmatch(item[key]))
                    for key in ("hash", "canonical_hash") if key in keys)
            and isinstance(item["shape"], list)
            and all(type(size) is int and size >= 0 for size in item["shape"])
            and isinstance(item["dtype"], str)
            and isinstance(getattr(torch, item["dtype"], None), torch.dtype)
            and magnitude(item["abs_max"]) and magnitude(item["abs_sum"])
            and type(item["nonfinite"]) is int and item["nonfinite"] >= 0)


# --- the trace ------------------------------------------------------------------------------


@dataclass
class Trace:
    """One module call: ``ops`` (JSON, in execution order), the tensors they started from, the
    encoded return tree, the first op that turned finite inputs into a NaN/Inf at record time and, where
    they were taken, the ``digests`` of each op's outputs at record time (one list per op)."""

    ops: List[Dict[str, Any]]
    leaves: Dict[str, torch.Tensor]
    outputs: Any
    first_nonfinite: Optional[Dict[str, Any]]
    digests: Optional[List[List[Dict[str, Any]]]] = field(default=None)

    def to_json(self) -> Dict[str, Any]:
        version = (_digests_version(self.digests) if self.digests is not None
                   else FUSED_VERSION if any(is_fused(op) for op in self.ops) else 1)
        return {
            "schema": SCHEMA.name, "version": version,
            "ops": self.ops,
            "outputs": self.outputs,
            "first_nonfinite": self.first_nonfinite,
            "leaves": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for name, t in self.leaves.items()},
            **({} if self.digests is None else {"digests": self.digests}),
        }

    @staticmethod
    def from_json(document: Dict[str, Any], leaves: Dict[str, torch.Tensor]) -> "Trace":
        """Validate a document from ``to_json`` against its tensors (``leaves`` may hold other tensors
        too: only the trace's are taken). Raises TraceError on anything malformed or refused."""
        try:
            return Trace._checked(document, leaves)
        except RecursionError:
            raise TraceError("a value nested too deeply") from None

    @staticmethod
    def _checked(document: Dict[str, Any], leaves: Dict[str, torch.Tensor]) -> "Trace":
        if not isinstance(document, dict) or document.get("schema") != SCHEMA.name:
            raise TraceError(f"not a {SCHEMA.name} document")
        version = document.get("version")
        if type(version) is not int or not 1 <= version <= SCHEMA.version:
            newer = isinstance(version, int) and version > SCHEMA.version
            raise TraceError(f"trace version {version!r} is {'newer than' if newer else 'not'} the one "
                             f"this gradnan reads ({SCHEMA.version})")
        keys = _DOCUMENT_KEYS | ({"digests"} if version >= DIGEST_VERSION else set())
        if set(document) != keys:
            raise TraceError(f"a version {version} trace has exactly the keys {sorted(keys)}")
        taken = _checked_leaves(document["leaves"], leaves)
        ops = document["ops"]
        if not isinstance(ops, list):
            raise TraceError("'ops' must be a list")
        defined = set(taken)
        for index, op in enumerate(ops):
            _check_op(index, op, defined, set(taken), fused_allowed=version >= FUSED_VERSION)
        decode(document["outputs"], _defined_in(defined, "the outputs"))
        first = document["first_nonfinite"]
        if first is not None and not (isinstance(first, dict) and set(first) == {"index", "op"}
                                      and type(first["index"]) is int and 0 <= first["index"] < len(ops)
                                      and isinstance(first["op"], str)):
            raise TraceError("'first_nonfinite' must be null or {\"index\": int, \"op\": str}, its index"
                             " that of one of the trace's ops")
        digests = document.get("digests")
        if digests is not None:
            _checked_digests(digests, ops, version)
        return Trace(ops=ops, leaves=taken, outputs=document["outputs"], first_nonfinite=first,
                     digests=digests)


def _digests_version(digests: List[List[Dict[str, Any]]]) -> int:
    """4 where the digests have ``canonical_hash`` (``digest`` writes it), 3 for digests read from a
    version 3 trace."""
    return (CANONICAL_VERSION if all("canonical_hash" in item for entry in digests for item in entry)
            else DIGEST_VERSION)


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


def _check_op(index: int, op: Any, defined: Set[str], leaf_names: Set[str],
              fused_allowed: bool = True) -> None:
    """One op entry: well formed, replayable or flagged as not executed, referring only to tensors
    defined before it. Adds the names it produces to ``defined``."""
    name = op.get("op") if isinstance(op, dict) else None
    try:
        if not (isinstance(op, dict) and _OP_KEYS.issuperset(op)
                and {"op", "args", "kwargs", "out"} <= set(op)
                and all(op.get(flag, True) is True for flag in ("collective", "external", "opaque"))
                and (fused_allowed or "fused" not in op)):
            raise TraceError("malformed entry")
        match = _OP_NAME.fullmatch(name) if isinstance(name, str) else None
        if "fused" in op:
            _check_fused(op, defined)
        elif op.get("collective"):
            if match is None or match[1] not in COLLECTIVE_NAMESPACES:
                raise TraceError("marked collective but not a c10d op")
        elif op.get("external"):
            if match is None:
                raise TraceError("malformed op name")
            if not leaf_names.issuperset(refs(op["out"])):
                raise TraceError("the outputs of an external op must be leaves")
        else:
            replayable_op(name)
        if not isinstance(op["args"], list) or not isinstance(op["kwargs"], dict):
            raise TraceError("'args' must be a list and 'kwargs' an object")
        for encoded in op_inputs(op):
            decode(encoded, _defined_in(defined, "arguments"))
        if any("opaque" in node for node in nodes(op_inputs(op))) != bool(op.get("opaque")):
            raise TraceError("'opaque' must mark exactly the ops with an opaque argument")
        decode(op["out"], str)
    except TraceError as error:
        raise TraceError(f"op {index} ({repr(name)[:80]}): {error}") from None
    defined.update(refs(op["out"]))


def is_fused(op: Dict[str, Any]) -> bool:
    """An entry for a custom ``torch.autograd.Function`` whose work the dispatcher did not (all) see."""
    return "fused" in op


def fused_name(cls: type) -> str:
    """The ``op`` of a fused entry: the Function class's module and qualified name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_fused(op: Dict[str, Any], defined: Set[str]) -> None:
    """A fused entry names its Function class consistently, and every output is a tensor already defined:
    a saved leaf (the kernel's own output) or an output of a recorded op inside it."""
    fused = op["fused"]
    if not (isinstance(fused, dict) and set(fused) == _FUSED_KEYS
            and all(isinstance(fused[key], str) and _FUSED_NAME.fullmatch(fused[key])
                    for key in ("class", "class_module"))
            and (fused["module"] is None or isinstance(fused["module"], str))
            and op["op"] == f"{fused['class_module']}.{fused['class']}"):
        raise TraceError("malformed fused entry")
    if not defined.issuperset(refs(op["out"])):
        raise TraceError("the outputs of a fused entry must be leaves or outputs of earlier ops")


def tensors_in(tree: Any) -> List[torch.Tensor]:
    """The tensors of a nested tuple/list/dict structure (a module's inputs or outputs), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


def same_values(saved: torch.Tensor, other: torch.Tensor) -> bool:
    """Bitwise equal, NaN matching NaN (a saved NaN met again as NaN is the same value)."""
    if saved.shape != other.shape or saved.dtype != other.dtype or saved.device != other.device:
        return False
    return bool(((saved == other) | (torch.isnan(saved) & torch.isnan(other))).all())


def has_nonfinite(tensor: Any) -> bool:
    """True for a floating tensor holding a NaN or Inf (one host read; for the capture/replay paths)."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            and not bool(torch.isfinite(tensor).all()))
