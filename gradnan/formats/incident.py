"""The vocabulary of an incident, shared by the training side (log lines, records) and the offline side
(report, plot): record kinds, the in-place rerun's roles and conclusions, where an origin's evidence
comes from, and the verdict's causes. Each value is the string the files carry (docs/formats.md); each
conclusion's wording lives here and nowhere else, so a log line and a report headline cannot disagree.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Optional, Tuple

from .magnitude import LIMIT_MARGIN, magnitude_text


class RecordKind(str, enum.Enum):
    """What a ``gradnan.record`` line says happened (its ``kind``)."""

    NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
    """The grad norm was NaN/Inf: the rank's own offending parameters at the norm."""
    LOSS_SCALE_OVERFLOW = "loss_scale_overflow"
    """fp16 dynamic loss scaling skipped the step (found Inf/NaN in the scaled gradients)."""
    PRE_REDUCTION = "pre_reduction"
    """The rank's own gradients were non-finite before the data-parallel collective: it produced them."""
    FRAMES = "frames"
    """Forward frame tracing (``frames=detect|trace``): per-module value ranges of a step."""
    PROBE = "probe"
    """``gradnan.check`` probes: the values a user asked to watch."""
    RERUN = "rerun"
    """What the in-place rerun of the failing step found on this rank."""


INCIDENT_KINDS = (RecordKind.NONFINITE_GRAD_NORM, RecordKind.LOSS_SCALE_OVERFLOW, RecordKind.PRE_REDUCTION)
NORM_KINDS = (RecordKind.NONFINITE_GRAD_NORM, RecordKind.LOSS_SCALE_OVERFLOW)


class RerunRole(str, enum.Enum):
    """How one rank's forward pass stood in the rerun of the failing step."""

    ORIGIN = "origin"
    """The earliest call on its tensor-parallel group whose inputs were finite and outputs not."""
    RECEIVER = "receiver"
    """Its first non-finite value came later than a peer's, or arrived in its inputs: it received it."""
    CLEAN = "clean"
    """Every traced value stayed finite on this rank."""


class Conclusion(str, enum.Enum):
    """One data-parallel replica's conclusion from the rerun, the same on every rank of its model-parallel
    group. Declared strongest first: a replica that failed again outweighs one that was clean."""

    REPRODUCIBLE = "reproducible"
    """The forward pass went non-finite again with the same micro-batches and RNG state."""
    TRANSIENT = "transient"
    """Finite this time although the failing pass's loss was not, or Megatron's own rerun was finite."""
    BACKWARD = "backward"
    """The forward pass and the loss were finite in both passes: the values arose in backward."""
    AFTER_COLLECTIVE = "after_collective"
    """Forward pass, loss and own gradients before the data-parallel collective finite: at or after it."""
    NOT_REPRODUCED = "not_reproduced"
    """Finite this time, and no loss was seen to tell a transient fault from a clean step."""

    @classmethod
    def strongest(cls, conclusions) -> "Conclusion":
        order = list(cls)
        return min((cls(value) for value in conclusions), key=order.index)

    @property
    def headline(self) -> str:
        """The conclusion as the report's headline states it."""
        return _HEADLINES[self]

    @property
    def explanation(self) -> str:
        """The conclusion as a sentence (a rank's log line)."""
        return _EXPLANATIONS[self]

    def verdict(self, module: Optional[str], rank: Any, micro_batch: Any,
                grew_in: Optional[Mapping[str, Any]] = None) -> Optional[Tuple["Cause", str]]:
        """The cause and summary this conclusion decides by itself (it saw the same step again), or None
        where the gradients' evidence keeps the verdict. A reproducible failure decides only where the
        rerun named its module; where a value first grew out of line before it (``grew_in``), that module
        is named as the culprit next to it."""
        if self is Conclusion.TRANSIENT:
            return Cause.HARDWARE, _TRANSIENT_VERDICT
        if self is Conclusion.REPRODUCIBLE and module:
            where = f"in {module}" if not grew_in else f"in {module}, after {grew_text(grew_in)}"
            return Cause.DATA_OR_NUMERICS, _REPRODUCIBLE_VERDICT.format(where=where, rank=rank,
                                                                         micro_batch=micro_batch)
        return None

    @property
    def evidence(self) -> Optional[str]:
        """What this conclusion adds to a verdict the gradients' evidence decides, or None."""
        return _BACKWARD_EVIDENCE if self is Conclusion.BACKWARD else None


_HEADLINES = {
    Conclusion.REPRODUCIBLE: "REPRODUCIBLE (same micro-batches, same RNG state)",
    Conclusion.TRANSIENT: "NOT reproduced: transient",
    Conclusion.BACKWARD: "forward pass clean: the backward pass",
    Conclusion.AFTER_COLLECTIVE: "forward pass and local gradients clean: it arose at or after the"
                                 " data-parallel collective",
    Conclusion.NOT_REPRODUCED: "not reproduced",
}

_EXPLANATIONS = {
    Conclusion.REPRODUCIBLE: "it fails again with the same micro-batches and RNG state: data or numerics,"
                             " not the device",
    Conclusion.TRANSIENT: "the forward pass was finite this time with the same micro-batches and RNG state,"
                          " although the loss was not: a transient fault; suspect the device of the ranks"
                          " that reported (gradnan selftest)",
    Conclusion.BACKWARD: "the forward pass was finite in both passes: the non-finite values arose in the"
                         " backward pass",
    Conclusion.AFTER_COLLECTIVE: "this replica's forward pass, loss and own gradients before the"
                                 " data-parallel collective were finite: the non-finite values arose at or"
                                 " after that collective (from another replica, or a corruption after it)",
    Conclusion.NOT_REPRODUCED: "the forward pass was finite this time with the same micro-batches and RNG"
                               " state",
}


_REPRODUCIBLE_VERDICT = (
    "the failing step, run again in place with the same micro-batches and RNG state, went non-finite again"
    " in the forward pass, {where} on rank {rank}, micro-batch {micro_batch}: the data or the numerics"
    " (an overflow), not a passing fault; `gradnan replay` of its bundle on another device tells a"
    " persistently faulty device apart")
_TRANSIENT_VERDICT = (
    "the failing step, run again in place with the same micro-batches and RNG state, was finite on every"
    " rank of the replica that failed, although its loss was not: a transient fault; suspect the device of"
    " the ranks named below and run gradnan selftest there")
_BACKWARD_EVIDENCE = (
    "the step's forward pass, run again in place, was finite on every rank of the replica(s) that failed,"
    " and so was the loss: the non-finite values arose in the backward pass")


def _magnitudes(grew_in: Mapping[str, Any]) -> str:
    """``2.91 -> 3.9e28``, and whether the output came near its dtype's limit."""
    text = (f"{magnitude_text(grew_in.get('inputs_abs_max'))} ->"
            f" {magnitude_text(grew_in.get('output_abs_max'))}")
    if grew_in.get("near_limit"):
        text += f", within {LIMIT_MARGIN:g}x of the {str(grew_in.get('dtype')).removeprefix('torch.')} limit"
    return text


def grew_text(grew_in: Mapping[str, Any]) -> str:
    """The culprit of a value that grew out of line (a ``rerun`` record's ``grew_in``), as the verdict
    names it: ``decoder.layers.0.mlp (MLP) grew a value out of line (2.91 -> 3.9e28)``."""
    return f"{grew_in['module']} ({grew_in['class']}) grew a value out of line ({_magnitudes(grew_in)})"


def growth_path(grew_in: Mapping[str, Any], module: Optional[str], module_class: Optional[str]) -> str:
    """The magnitude path as a report headline says it: where the value grew, then where it went
    non-finite (``module``; None: it stayed finite on the ranks traced)."""
    grown = (f"{grew_in['module']} ({grew_in['class']}) grew a value to"
             f" {magnitude_text(grew_in.get('output_abs_max'))} (from"
             f" {magnitude_text(grew_in.get('inputs_abs_max'))})")
    if grew_in.get("near_limit"):
        grown += f", near the {str(grew_in.get('dtype')).removeprefix('torch.')} limit"
    return grown + (f", which went non-finite in {module} ({module_class})" if module else "")


def growth_log(grew_in: Mapping[str, Any], module: Optional[str], module_class: Optional[str]) -> str:
    """The magnitude path as a rank's log line says it."""
    grown = (f"values first grew out of line in {grew_in['module']} ({grew_in['class']})"
             f" ({_magnitudes(grew_in)})")
    return grown + (f", then went non-finite in {module} ({module_class})" if module else "")


class Cause(str, enum.Enum):
    """The report's verdict: what most likely made the step non-finite."""

    HARDWARE = "hardware"
    """One device: a replica alone produced it on different data, or the rerun was clean (transient)."""
    DATA_OR_NUMERICS = "data_or_numerics"
    """The data or the numerics (an overflow, a forward-pass failure, one that reproduces)."""
    UNDETERMINED = "undetermined"
    """The evidence names the ranks but cannot tell a device from the data (the summary says what would)."""
    UNKNOWN = "unknown"
    """No rank held a non-finite gradient: only the norm was non-finite."""


class OriginBasis(str, enum.Enum):
    """What the origin ranks of an incident were decided from, best evidence first."""

    RERUN = "rerun"
    """Where a forward value first went non-finite when the failing step was run again in place."""
    BEFORE_COLLECTIVE = "before_collective"
    """Their own gradients were non-finite before the data-parallel collective (pre-reduction check)."""
    AFTER_COLLECTIVE = "after_collective"
    """Every checked rank was clean before the collective; these hold the non-finite gradients after it."""
    UNCONFIRMED = "unconfirmed"
    """They hold the non-finite gradients; no pre-reduction check ran to say whether they produced them."""
    NONE = "none"
    """No rank held a non-finite gradient."""

    @property
    def description(self) -> str:
        return _BASIS_TEXT[self]


_BASIS_TEXT = {
    OriginBasis.BEFORE_COLLECTIVE: "local gradients non-finite before the data-parallel collective",
    OriginBasis.AFTER_COLLECTIVE: "holds the non-finite gradients; clean before the collective",
    OriginBasis.UNCONFIRMED: "holds the non-finite gradients (unconfirmed: no pre-reduction check)",
    OriginBasis.NONE: "",
    OriginBasis.RERUN: "where a forward value first went non-finite when the failing step was run again in"
                       " place",
}


class GradientPass(str, enum.Enum):
    """Which pass the origin's gradients point at (the report's ``pattern.pass``)."""

    FORWARD = "forward"
    """(Nearly) every gradient of the origin is non-finite: the loss or an activation already was."""
    BACKWARD = "backward"
    """Only some are: the first in backward order is where it started."""
    UNKNOWN = "unknown"
    """The maps needed to tell are missing."""


def values(enum_type: type) -> Tuple[str, ...]:
    """The strings a file may carry for ``enum_type``, in declaration order."""
    return tuple(member.value for member in enum_type)
