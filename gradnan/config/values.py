"""The kinds of value a configuration field holds besides plain numbers and text: the modes (``str``
enums, so ``config.frames == "detect"`` holds), rank/step sets (``Ranges``, "3,7-9" kept as merged
intervals) and module patterns (``parse_patterns``).

Apart from ``GradnanConfig`` (``gradnan.config``) because each mode's members are documented one by one
here, where a user reading what ``rerun="auto"`` does finds it, and the parsing of ranges is the one
piece of the configuration with an algorithm in it.
"""

from __future__ import annotations

import bisect
import enum
import re
from typing import List, Tuple

from ..errors import ConfigError

_NUMBER = re.compile(r"[0-9]+")


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


def parse_patterns(text: str) -> Tuple[str, ...]:
    """ "decoder.*, output_layer" -> ("decoder.*", "output_layer")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
