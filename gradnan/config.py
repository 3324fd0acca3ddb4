"""One configuration dataclass, settable three ways: keyword arguments, ``GRADNAN_*`` environment
variables, and a JSON or TOML file named by ``GRADNAN_CONFIG`` (same field names in all three).

Modes are enums (``str`` enums: ``config.frames == "detect"`` holds); rank/step ranges and module patterns
are given as text and parsed once, when the configuration is made (``config.ranges(name)``,
``config.patterns(name)``), into intervals and tuples.
"""

from __future__ import annotations

import bisect
import enum
import fnmatch
import json
import os
import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .errors import ConfigError, InputError
from .formats.runup import MAX_RUNUP_STEPS
from .formats.schema import read_text

ENV_PREFIX = "GRADNAN_"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; a larger one (or /dev/zero) is refused
CONFIG_FILE_ENV = "GRADNAN_CONFIG"  # names a config file; not a field
RESERVED_PREFIXES = ("GRADNAN_SELFTEST_",)  # read by `gradnan selftest` only (its test switches)
_NUMBER = re.compile(r"[0-9]+")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class PreReduction(str, enum.Enum):
    """When each rank's own gradients are checked before the data-parallel collective, to tell the rank
    that produced a NaN from those that received it."""

    AUTO = "auto"
    """One finite flag per bucket kept on the device, read only after a non-finite norm or an fp16 overflow
    (no host sync on a healthy step); as ``SYNC`` where Megatron's ``check_for_nan_in_grad`` is on."""
    SYNC = "sync"
    """Read at once: the record is written before the collective."""
    OFF = "off"
    """No check before the collective."""


class RerunMode(str, enum.Enum):
    """Whether the first incident's step is re-executed in place to find where it went non-finite."""

    AUTO = "auto"
    """At the run's first incident (a non-finite grad norm, an fp16 overflow that keeps recurring), before
    the optimizer applies anything, run the same step's forward pass again on every rank that saw it, over
    the same micro-batches from the same RNG state, without gradients; name the module where a value
    first went non-finite (its rank, micro-batch, tensor-parallel receivers), capture that call into a
    bundle and keep the failing micro-batch; then say whether the failure reproduced (data or numerics)
    or not (suspect the device). Training is unchanged: the RNG state, module buffers and gradients are
    as they were. Costs one reference per micro-batch a step. Needs the step driven by megatron-core's
    pipeline schedules."""
    OFF = "off"
    """Never."""


class OnNonfinite(str, enum.Enum):
    """What happens to training after a non-finite grad norm is recorded."""

    CONTINUE = "continue"
    """Record it and go on (Megatron's behaviour)."""
    RAISE = "raise"
    """Stop the run with ``NonFiniteGradientError`` right after the record of a non-finite grad norm (or
    a collapsed fp16 loss scale) is on disk. Every rank of the norm's group sees the same norm, so all
    stop. With ``frames="detect"``, also at the first non-finite forward value (DebugUnderflowOverflow's
    behaviour), on the ranks that saw it, once its frames are on disk."""


class FramesMode(str, enum.Enum):
    """Forward frame tracing: the abs-min and abs-max of each watched module call's weights, inputs and
    outputs, computed on the device and read once per step."""

    OFF = "off"
    """No tracing."""
    DETECT = "detect"
    """Keep the last ``max_frames`` frames and write them when a forward value first goes non-finite."""
    TRACE = "trace"
    """Write every frame of the ``trace_steps``."""


class Ranges:
    """A set of non-negative integers ("3,7-9") kept as sorted, merged intervals: a range as wide as
    ``0-10**12`` costs two numbers, and membership is a binary search."""

    def __init__(self, intervals: List[Tuple[int, int]]) -> None:
        merged: List[Tuple[int, int]] = []
        for low, high in sorted(intervals):
            if merged and low <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], high))
            else:
                merged.append((low, high))
        self._lows = [low for low, _ in merged]
        self._intervals = merged

    @classmethod
    def parse(cls, text: str, field_name: str = "ranges") -> "Ranges":
        """ "3,7-9" -> {3, 7, 8, 9}; empty text -> the empty set."""
        intervals = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            low, dash, high = part.partition("-")
            if not _NUMBER.fullmatch(low) or (dash and not _NUMBER.fullmatch(high)) or (
                    dash and int(high) < int(low)):
                raise ConfigError(f"gradnan config field '{field_name}' has a bad entry {part!r} (use 3,7-9)")
            intervals.append((int(low), int(high or low)))
        return cls(intervals)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        position = bisect.bisect_right(self._lows, value) - 1
        return position >= 0 and value <= self._intervals[position][1]

    def __bool__(self) -> bool:
        return bool(self._intervals)

    def last(self) -> int:
        """The largest member (the set must not be empty)."""
        return self._intervals[-1][1]


RANGE_FIELDS = ("ranks", "steps", "trace_steps", "capture_steps", "capture_ranks")
PATTERN_FIELDS = ("modules", "exclude_modules", "capture_modules")
_ENUM_FIELDS = {"pre_reduction": PreReduction, "on_nonfinite": OnNonfinite, "frames": FramesMode,
                "rerun": RerunMode}


@dataclass(frozen=True)
class GradnanConfig:
    """Everything ``gradnan.install()`` can be told.

    ``resolve_config`` merges the sources, each winning over the one before: the defaults, a config file,
    the ``GRADNAN_*`` variables, this object, keyword arguments. Of this object only the fields given to its
    constructor count (``explicit_fields``), whatever their values: a field left out hides neither the
    file nor the environment. ``dataclasses.replace`` gives the constructor every field, so its copy
    counts them all.
    """

    out_dir: str = "gradnan_out"
    """Where every rank writes its maps, records and bundles (shared by all ranks of a job)."""

    maps: bool = True
    """Write the per-rank parameter-id -> global-name maps when the optimizer is built."""

    detect: bool = True
    """Check the grad norm (and fp16 loss-scale overflows) and localize non-finite gradients."""

    pre_reduction: PreReduction = PreReduction.AUTO
    """When each rank's local gradients are checked before the data-parallel collective."""

    runup_steps: int = 32
    """Steps of each gradient bucket's largest magnitude before the data-parallel collective kept on the
    device (the run-up), written at an incident so the report can tell whether the culprit's gradients grew
    before the NaN; 0: off. Needs ``pre_reduction`` (it reuses that check's read)."""

    max_params_per_record: int = 64
    """Offending parameters listed in full per record; the rest are only counted."""

    skip_warn_after: int = 3
    """Consecutive fp16 loss-scale skips before a warning (then at 2x, 4x, ... that many)."""

    strict: bool = False
    """Let an internal gradnan error propagate instead of logging it and carrying on."""

    on_nonfinite: OnNonfinite = OnNonfinite.CONTINUE
    """Whether training goes on or stops once a non-finite grad norm is recorded."""

    run_id: str = ""
    """Names this launch in every record, so that restarts into one ``out_dir`` stay apart; empty: taken
    from TORCHELASTIC_RUN_ID or SLURM_JOB_ID, else launches are told apart by their start time."""

    max_records_bytes: int = 64 << 20
    """A rank stops appending records (with one log line) once its file is this big (at least 4096)."""

    capture: bool = True
    """After a detection on a rank, watch the implicated module there (the one owning the first offending
    parameter in backward order; after a forward-pass incident, the first module whose output went
    non-finite) and write a replay bundle at its next non-finite call (capture mode ``"incident"``)."""

    capture_modules: str = ""
    """Global module names or fnmatch patterns (comma-separated) to capture explicitly: at the steps in
    ``capture_steps``, or every step with ``capture_retain``."""

    capture_steps: str = ""
    """Steps ("5", "3,7-9") at which ``capture_modules`` are captured."""

    capture_ranks: str = ""
    """Global ranks ("0,4-7") that capture ``capture_modules``; empty: all."""

    capture_retain: bool = False
    """Keep the last call of ``capture_modules`` every step and write it when a detection happens in that
    step (the failing step itself, without a rerun; costs a trace every step)."""

    max_bundles: int = 4
    """Bundles a rank writes at most."""

    max_bundle_bytes: int = 256 << 20
    """A bundle whose tensors are larger is not written."""

    rerun: RerunMode = RerunMode.AUTO
    """Whether the first incident's step runs again in place to find where it went non-finite."""

    max_batch_bytes: int = 64 << 20
    """The failing micro-batch's tensors are kept by the rerun up to this size."""

    tensorboard_dir: str = ""
    """Where gradnan writes the run's first incident for TensorBoard (on the last rank), besides
    Megatron-LM's own writer (``--tensorboard-dir``), which it uses whenever one exists; empty: none of
    its own."""

    wandb_project: str = ""
    """The W&B project in which gradnan logs the run's first incident in a run of its own (on the last
    rank, made at the incident; ``WANDB_MODE``, ``WANDB_DIR`` and the rest of W&B's settings apply), besides
    Megatron-LM's own run (``--wandb-project``), which it uses whenever one exists; empty: none of its own."""

    ranks: str = ""
    """Global ranks ("0,4-7") that record anything (records, frames, probes, bundles); empty: all. Maps are
    written on every rank (the report needs them to name receivers)."""

    steps: str = ""
    """Steps ("10-20") in which anything is recorded; empty: all. Like every step filter, a step is
    Megatron-LM's iteration where its loop runs, else gradnan's step (the records' ``step``)."""

    modules: str = ""
    """Global module names or fnmatch patterns (comma-separated) that frame tracing and capture may watch;
    empty: all."""

    exclude_modules: str = ""
    """Global module names or fnmatch patterns (comma-separated) that frame tracing and capture never
    watch."""

    frames: FramesMode = FramesMode.OFF
    """Forward frame tracing."""

    trace_steps: str = ""
    """Steps ("1,3") whose frames ``frames="trace"`` writes; that mode needs them, and the others refuse
    them."""

    max_frames: int = 21
    """Frames kept by ``frames="detect"``."""

    abort_after_step: int = 0
    """Stop the run (``AbortRequested``) once this step has finished and its records are on disk; 0:
    never."""

    log_level: str = "INFO"
    """Level of the ``gradnan`` logger."""

    disabled_patches: Tuple[str, ...] = ()
    """Megatron patches left out, by name (``"schedules,module_hooks"``); each one's cost:
    docs/troubleshooting.md."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "GradnanConfig":
        """Remember which fields the caller gave, by position or by name, whatever their values."""
        config = super().__new__(cls)
        positional = [spec.name for spec in fields(cls)][:len(args)]
        object.__setattr__(config, "_explicit_fields", frozenset(positional).union(kwargs))
        return config

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            enum_type = _ENUM_FIELDS.get(spec.name)
            if enum_type is not None:
                object.__setattr__(self, spec.name, _enum_value(spec.name, enum_type, value))
            elif not _has_type(value, _FIELD_TYPES[spec.name]):
                raise ConfigError(f"gradnan config field '{spec.name}' must be"
                                  f" {_FIELD_TYPES[spec.name].__name__}, got {value!r}")
        if not self.out_dir.strip():
            raise ConfigError("gradnan config field 'out_dir' is empty (GRADNAN_OUT_DIR= ?): name a"
                              " directory")
        if self.max_records_bytes < 4096:
            raise ConfigError("gradnan config field 'max_records_bytes' must be >= 4096")
        object.__setattr__(self, "_ranges",
                           {name: Ranges.parse(getattr(self, name), name) for name in RANGE_FIELDS})
        object.__setattr__(self, "_patterns",
                           {name: parse_patterns(getattr(self, name)) for name in PATTERN_FIELDS})
        if (self.frames is FramesMode.TRACE) != bool(self.ranges("trace_steps")):
            raise ConfigError("gradnan config fields 'frames' and 'trace_steps' go together: frames='trace'"
                              " needs trace_steps, and trace_steps needs frames='trace'")
        if self.max_frames < 1 or self.abort_after_step < 0:
            raise ConfigError("gradnan config field 'max_frames' must be >= 1 and 'abort_after_step' >= 0")
        if self.max_bundles < 0 or self.max_bundle_bytes < 0 or self.max_batch_bytes < 0:
            raise ConfigError("gradnan config fields 'max_bundles', 'max_bundle_bytes' and"
                              " 'max_batch_bytes' must be >= 0")
        if not 0 <= self.runup_steps <= MAX_RUNUP_STEPS:
            raise ConfigError(f"gradnan config field 'runup_steps' must be 0 (off) to {MAX_RUNUP_STEPS}")
        if self.max_params_per_record < 1:
            raise ConfigError("gradnan config field 'max_params_per_record' must be >= 1")
        if self.skip_warn_after < 1:
            raise ConfigError("gradnan config field 'skip_warn_after' must be >= 1")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ConfigError(f"gradnan config field 'log_level' is not a log level: {self.log_level!r}")

    @property
    def explicit_fields(self) -> FrozenSet[str]:
        """The fields given to the constructor: the ones ``resolve_config`` takes from this object."""
        return self._explicit_fields

    def ranges(self, name: str) -> Ranges:
        """A rank/step range field, parsed (``RANGE_FIELDS``); empty means "all"."""
        return self._ranges[name]

    def patterns(self, name: str) -> Tuple[str, ...]:
        """A module pattern field, split (``PATTERN_FIELDS``)."""
        return self._patterns[name]

    def watches(self, module_name: str) -> bool:
        """Whether frame tracing and capture may hook this module (``modules`` / ``exclude_modules``)."""
        include, exclude = self.patterns("modules"), self.patterns("exclude_modules")
        return (not include or any(fnmatch.fnmatchcase(module_name, p) for p in include)) and not any(
            fnmatch.fnmatchcase(module_name, p) for p in exclude)

    def watched(self, named_modules: Iterable[Tuple[str, Any]],
                include_model: bool = False) -> List[Tuple[str, Any]]:
        """The (name, module) pairs of ``named_modules`` that gradnan may hook (``watches``); the model
        itself (the empty name) only with ``include_model`` (frame tracing shows it as ``<model>``)."""
        return [(name, module) for name, module in named_modules
                if (name or include_model) and self.watches(name)]


_FIELD_TYPES: Dict[str, type] = typing.get_type_hints(GradnanConfig)


def _enum_value(name: str, enum_type: type, value: Any) -> Any:
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise ConfigError(f"gradnan config field '{name}' must be one of {allowed}, got {value!r}") from None


def _has_type(value: Any, expected: type) -> bool:
    """Whether ``value`` is of a field's type (str, bool, int, a tuple of str; a bool is not an int here)."""
    if expected == Tuple[str, ...]:
        return isinstance(value, tuple) and all(isinstance(item, str) for item in value)
    return isinstance(value, expected) and not (expected is int and isinstance(value, bool))


def parse_bool(text: str) -> Optional[bool]:
    """1/0, true/false, yes/no, on/off (any case, spaces around); None for anything else."""
    lowered = text.strip().lower()
    return True if lowered in _TRUE else False if lowered in _FALSE else None


def _input_type(name: str) -> type:
    """The type a field is given as in a variable or a file: text for a mode (an enum)."""
    return str if name in _ENUM_FIELDS else _FIELD_TYPES[name]


def _parse(name: str, raw: str) -> Any:
    text = raw.strip()
    type_name = _input_type(name)
    if type_name is bool:
        value = parse_bool(text)
        if value is not None:
            return value
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean (use 1/0, true/false)")
    if type_name is int:
        if not re.fullmatch(r"-?[0-9]{1,18}", text):  # ASCII digits: int() would take "٣" or "1_000"
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not an integer")
        return int(text)
    if type_name == Tuple[str, ...]:
        return parse_patterns(text)
    return text


def parse_patterns(text: str) -> Tuple[str, ...]:
    """ "decoder.*, output_layer" -> ("decoder.*", "output_layer")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def options_from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The ``GRADNAN_*`` variables as config fields; an unknown ``GRADNAN_`` name is an error (typos)."""
    environ = os.environ if environ is None else environ
    by_env_name = {ENV_PREFIX + spec.name.upper(): spec for spec in fields(GradnanConfig)}
    options = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(RESERVED_PREFIXES) or key == CONFIG_FILE_ENV:
            continue
        spec = by_env_name.get(key)
        if spec is None:
            known = ", ".join(sorted([*by_env_name, CONFIG_FILE_ENV]))
            raise ConfigError(f"unknown environment variable {key} (known: {known})")
        options[spec.name] = _parse(spec.name, raw)
    return options


def _file_value(where: str, name: str, value: Any) -> Any:
    """A config-file value as the field's type: ranges and patterns may also be lists."""
    if name in RANGE_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if name in RANGE_FIELDS and isinstance(value, list):
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: field '{name}' must list step/rank numbers or ranges like \"3-5\"")
        value = ",".join(str(v) for v in value)
    elif name in PATTERN_FIELDS and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: field '{name}' must list module names or patterns (text)")
        value = ",".join(value)
    type_name = _input_type(name)
    if type_name == Tuple[str, ...] and isinstance(value, (list, str)):
        value = tuple(value) if isinstance(value, list) else parse_patterns(value)
    if not _has_type(value, type_name):
        kind = {str: "text", bool: "true or false", int: "an integer"}.get(type_name, "a list of names")
        raise ConfigError(f"{where}: field '{name}' must be {kind}, got {value!r}")
    if name in RANGE_FIELDS:
        try:
            Ranges.parse(value, name)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def options_from_file(path: str) -> Dict[str, Any]:
    """The fields of a JSON (``.json``) or TOML (``.toml``) config file; unknown or ill-typed fields are
    errors naming the field."""
    where = f"gradnan config file {path}"
    is_toml = str(path).lower().endswith(".toml")
    try:
        text = read_text(Path(path), MAX_CONFIG_BYTES, follow=True)
    except InputError as exc:
        raise ConfigError(f"gradnan config file {exc}") from None
    try:
        document = tomllib.loads(text) if is_toml else json.loads(text)
    except (ValueError, RecursionError) as exc:
        syntax = "TOML" if is_toml else "JSON"
        raise ConfigError(f"{where}: invalid {syntax} ({str(exc).splitlines()[0][:100]})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: must hold one object of fields")
    by_name = {spec.name: spec for spec in fields(GradnanConfig)}
    options = {}
    for name, value in document.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"{where}: unknown field '{name}' (known: {', '.join(sorted(by_name))})")
        options[name] = _file_value(where, name, value)
    return options


def resolve_config(
    config: Optional[GradnanConfig] = None,
    environ: Optional[Mapping[str, str]] = None,
    config_file: Optional[str] = None,
    **options: Any,
) -> GradnanConfig:
    """Defaults < config file (``config_file``, else ``GRADNAN_CONFIG``) < ``GRADNAN_*`` environment <
    the fields given to ``config``'s constructor < keyword arguments (``None``: not given)."""
    known = {spec.name for spec in fields(GradnanConfig)}
    for name in options:
        if name not in known:
            raise ConfigError(f"unknown gradnan option '{name}' (known: {', '.join(sorted(known))})")
    if config is not None and not isinstance(config, GradnanConfig):
        raise ConfigError(f"gradnan argument 'config' is a {type(config).__name__}, not a GradnanConfig")
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(CONFIG_FILE_ENV, "").strip()
    merged: Dict[str, Any] = options_from_file(config_file) if config_file else {}
    merged.update(options_from_env(environ))
    if config is not None:
        merged.update({name: getattr(config, name) for name in config.explicit_fields})
    merged.update({name: value for name, value in options.items() if value is not None})
    return GradnanConfig(**merged)
