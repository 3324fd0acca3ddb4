"""The op trace inside a capture bundle (``gradnan.trace``, JSON): its encoding, validation and meaning.

A trace is one module call written down as the aten operations it dispatched: each op's overload name
(``aten.addmm.default``), its arguments with tensors as references, the names of its outputs, and a flat
``name -> tensor`` dict of the tensors the ops started from (inputs, parameters, buffers). Nothing in it is
pickled code. The training side writes traces (``gradnan.training.recorder``); the offline side replays
them (``gradnan.offline.replay.trace``); both judge "the first non-finite op" by ``FirstNonFinite`` here,
so the field means the same thing at record time and at replay.

A replay executes only the operators of ``REPLAY_ALLOWLIST`` (and their in-place ``_`` variants): pure
tensor computation, shape and creation. Nothing a trace names can open a file, share memory with one,
talk to another process or reach the allocator's settings (``aten.from_file``, ``set_``, ``_copy_from``
of a storage, collectives): such an entry is refused before any op runs.
"""

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten

from ..errors import InputError
from .magnitude import entries_growth
from .schema import Schema

SCHEMA = Schema("gradnan.trace", 3)
# Version 2 added ``fused`` entries; a trace without one is still written as version 1, which older
# gradnan reads (it refuses a version 2 trace in one line, as newer than it reads). Version 3 added
# ``digests`` (what each op's outputs were at capture); a trace without them keeps its version 1 or 2.
FUSED_VERSION = 2
DIGEST_VERSION = 3

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
# The precisions a replay runs a trace in, by label: as captured, then every floating tensor cast wider
# (``cast_dtype``); a fused kernel's reference math runs in the same three.
REPLAY_PRECISIONS = (("captured", None), ("float32", torch.float32), ("float64", torch.float64))
# ``half_to_float`` is legal for a float16 input only; a replay cast to another dtype drops it.
HALF_TO_FLOAT = frozenset({"aten._softmax.default", "aten._log_softmax.default"})
_OP_NAME = re.compile(r"(\w+)\.(\w+)\.(\w+)")
_OP_KEYS = frozenset({"op", "collective", "external", "opaque", "fused", "args", "kwargs", "out"})
_FUSED_KEYS = frozenset({"class", "class_module", "module"})
_FUSED_NAME = re.compile(r"[\w.<>]{1,300}")
_DOCUMENT_KEYS = frozenset({"schema", "version", "ops", "outputs", "first_nonfinite", "leaves"})
_DIGEST_KEYS = frozenset({"hash", "shape", "dtype", "abs_max", "abs_sum", "nonfinite"})
_HASH = re.compile(r"[0-9a-f]{32}")


class TraceError(InputError, ValueError):
    """A malformed trace or an op that may not be replayed; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --- encoding ---------------------------------------------------------------------------------


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


# --- digests: what an op's outputs were ---------------------------------------------------------


def digest(tensor: torch.Tensor) -> Dict[str, Any]:
    """What a tensor holds, in a few numbers that any later replay can be compared with: ``hash``, a
    BLAKE2b (128 bits) of its bytes in C order; its ``shape`` and ``dtype``; ``abs_max`` and ``abs_sum``,
    the largest and the float64 sum of its finite magnitudes (null where it has none, or is not
    floating); ``nonfinite``, how many elements are NaN or Inf. Read on the host: one copy of the tensor."""
    host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    raw = memoryview(host.reshape(-1).view(torch.uint8).numpy())
    found: Dict[str, Any] = {
        "hash": hashlib.blake2b(raw, digest_size=16).hexdigest(),
        "shape": list(host.shape), "dtype": str(host.dtype).removeprefix("torch."),
        "abs_max": None, "abs_sum": None, "nonfinite": 0}
    if not host.is_floating_point() or host.numel() == 0:
        return found
    magnitudes = host.abs()
    total = float(magnitudes.sum(dtype=torch.float64))
    if not math.isfinite(total):  # the slow path only where something is NaN or Inf
        finite = torch.isfinite(host)
        found["nonfinite"] = int(host.numel() - int(finite.sum()))
        magnitudes = torch.where(finite, magnitudes, 0)
        total = float(magnitudes.sum(dtype=torch.float64))
        if found["nonfinite"] == host.numel():
            return found
    found["abs_max"], found["abs_sum"] = float(magnitudes.max()), total if math.isfinite(total) else None
    return found


def digests_of(tree: Any) -> List[Dict[str, Any]]:
    """The digest of every tensor of an op's output tree, in the order its encoding names them."""
    return [digest(tensor) for tensor in tensors_in(tree)]


def _checked_digests(digests: Any, ops: List[Any]) -> None:
    """``digests``: one list per op, one digest per tensor the op's ``out`` names."""
    if not (isinstance(digests, list) and len(digests) == len(ops)):
        raise TraceError("'digests' must be a list with one entry per op")
    for index, (entry, op) in enumerate(zip(digests, ops)):
        if not (isinstance(entry, list) and len(entry) == len(refs(op["out"]))
                and all(_digest_valid(item) for item in entry)):
            raise TraceError(f"digests of op {index}: one {{{', '.join(sorted(_DIGEST_KEYS))}}} per output"
                             " tensor")


def _digest_valid(item: Any) -> bool:
    def magnitude(value: Any) -> bool:
        return value is None or (isinstance(value, float) and math.isfinite(value) and value >= 0)

    return (isinstance(item, dict) and set(item) == _DIGEST_KEYS and isinstance(item["hash"], str)
            and bool(_HASH.fullmatch(item["hash"])) and isinstance(item["shape"], list)
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
        version = (DIGEST_VERSION if self.digests is not None
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
                                      and isinstance(first["index"], int) and isinstance(first["op"], str)):
            raise TraceError("'first_nonfinite' must be null or {\"index\": int, \"op\": str}")
        digests = document.get("digests")
        if digests is not None:
            _checked_digests(digests, ops)
        return Trace(ops=ops, leaves=taken, outputs=document["outputs"], first_nonfinite=first,
                     digests=digests)


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
