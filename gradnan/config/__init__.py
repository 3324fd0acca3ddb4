"""One configuration dataclass, settable three ways: keyword arguments, ``GRADNAN_*`` environment
variables, and a JSON or TOML file named by ``GRADNAN_CONFIG`` (same field names in all three).

Modes are enums (``str`` enums: ``config.frames == "detect"`` holds); rank/step ranges and module patterns
are given as text and parsed once, when the configuration is made (``config.ranges(name)``,
``config.patterns(name)``), into intervals and tuples.

This module is the dataclass and its checks; the modes, ranges and patterns are ``gradnan.config.values``,
and reading the environment and a file, and merging them, is ``gradnan.config.sources``.
"""

from __future__ import annotations

import enum
import fnmatch
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, FrozenSet, Iterable, List, Tuple, Type

from ..errors import ConfigError
from ..formats.runup import MAX_RUNUP_STEPS
from .values import FramesMode, OnNonfinite, PreReduction, Ranges, RerunMode, parse_patterns

RANGE_FIELDS = ("ranks", "steps", "trace_steps", "capture_steps", "capture_ranks")
PATTERN_FIELDS = ("modules", "exclude_modules", "capture_modules")
_ENUM_FIELDS: Dict[str, Type[enum.Enum]] = {"pre_reduction": PreReduction, "on_nonfinite": OnNonfinite,
                                             "frames": FramesMode, "rerun": RerunMode}


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

    replica_check_every: int = 100
    """Every this many steps, as the optimizer step begins, data-parallel replicas compare a digest of their
    weights (one asynchronous all-reduce of two integers, read at the next check); a replica whose weights
    differ is recorded (``replica_divergence``) with the parameter and its first differing element; 0: off."""

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

    if typing.TYPE_CHECKING:  # set by __new__ and __post_init__ (object.__setattr__): not fields
        _explicit_fields: FrozenSet[str] = field(init=False)
        _ranges: Dict[str, Ranges] = field(init=False)
        _patterns: Dict[str, Tuple[str, ...]] = field(init=False)

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
        if self.replica_check_every < 0:
            raise ConfigError("gradnan config field 'replica_check_every' must be >= 0 (0: off)")
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


def _enum_value(name: str, enum_type: Type[enum.Enum], value: Any) -> Any:
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
