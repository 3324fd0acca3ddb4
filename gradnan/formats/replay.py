"""The ``gradnan.replay`` document's vocabulary (what ``gradnan replay --json`` prints): its schema and the
verdicts a replay reaches (``gradnan.offline.replay.command`` decides them; docs/capture-replay.md says
what each means)."""

from __future__ import annotations

import enum

from .schema import Schema

SCHEMA = Schema("gradnan.replay", 1)


class ReplayVerdict(str, enum.Enum):
    """What re-executing a captured call says (the document's ``verdict``)."""

    INPUTS_NONFINITE = "inputs_nonfinite"
    """The module's inputs or parameters were already non-finite: look upstream."""
    INPUTS_OUT_OF_LINE = "inputs_out_of_line"
    """Its inputs were finite but already out of line: the growth upstream, not this module."""
    INCOMING_GRADIENT_NONFINITE = "incoming_gradient_nonfinite"
    """The gradient flowing into its outputs was already non-finite: look downstream."""
    KERNEL_BUG = "kernel_bug"
    """A fused kernel made Inf/NaN where its reference math stays finite in the captured dtype."""
    PRECISION = "precision"
    """Reproduces in the captured dtype, not in float64: an overflow (or underflow) at that operator."""
    BAD_OPERATOR_OR_INPUT = "bad_operator_or_input"
    """Reproduces in every precision: a genuinely bad input for the operator, or a bug in it."""
    CHANGED_AFTER_RETURN = "changed_after_return"
    """Its outputs are finite; training went on with a value changed after the module returned."""
    NOT_REPRODUCED = "not_reproduced"
    """From the same inputs the module computes finite values: what training saw came from elsewhere."""
    HEALTHY = "healthy"
    """Nothing non-finite was captured, and the replay agrees."""


COMPARISON = Schema("gradnan.comparison", 1)
"""What ``gradnan replay BUNDLE --against PYTHON --json`` prints: one bundle replayed under other stacks,
op by op against the capture's digests and against each other (``gradnan.offline.replay.comparison``)."""
