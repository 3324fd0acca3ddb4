"""The magnitude path: where a value first grew out of line, as opposed to where it first went non-finite.

A bf16 value of 3.9e28 is finite; it turns NaN only further on, where something squares it (a LayerNorm's
variance). The module that went non-finite first is then not the culprit: the one whose output jumped
from a few units to 3.9e28 is. This module decides "grew out of line" for one computation (a module call
of the rerun's frames, or one operator of a replay) from magnitudes alone, with no torch: the training side
(``gradnan.training.rerun``) and the offline side (``gradnan replay``) judge the same way.

A computation's output grew out of line when its largest finite output magnitude either

- exceeds ``GROWTH_FACTOR`` (2^20, about 10^6) times the largest magnitude among its inputs and weights,
  that largest taken as at least 1 (``grew``'s ``reference``). No healthy layer multiplies its largest
  input or weight by a million: a matmul's output is at most ``fan_in * max|x| * max|w|``, i.e. at most
  ``fan_in * min(max|x|, max|w|)`` times the larger of the two, and with a fan-in up to 2^16 and trained
  weights below 1 (or activations below 16) that stays under 2^20; a norm, a softmax, an activation or
  a dropout (scale 1/(1-p)) changes magnitudes by far less. The floor of 1 keeps a normalization of tiny
  inputs (1e-7 in, 3 out) from counting: the output must also be above 2^20 in absolute terms.
- or comes within ``LIMIT_MARGIN`` (2^4) of its dtype's largest value (fp16: above 4094; bf16 and fp32:
  above 2.1e37) while none of its inputs and weights was that close: four doublings (a residual sum of
  16 such values) from overflowing. A tighter margin (the 2^16 a bf16 run could afford) would flag every
  fp16 activation above 1. A computation that only passes on a value already that close (a transpose of
  a 60000 fp16 weight) did not grow it.

Healthy steps of the toy GPT (bf16, fp16, fp32) stay below both by orders of magnitude: every output below
5, the largest unfloored jump a LayerNorm's 30x (tests/test_magnitude.py traces them). A computation
whose inputs, weights or outputs are already non-finite is not judged: a non-finite output is the other
half of the path (where the value went non-finite), a non-finite input was received, not grown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from .schema import is_stat, json_float

# torch.finfo(dtype).max of each floating dtype, by its name in maps and frames (readers load no torch)
DTYPE_MAX = {
    "torch.float16": 65504.0,
    "torch.bfloat16": 3.3895313892515355e38,
    "torch.float32": 3.4028234663852886e38,
}
GROWTH_FACTOR = 2.0 ** 20
LIMIT_MARGIN = 2.0 ** 4
INPUT_KINDS = ("input", "weight")


@dataclass(frozen=True)
class Growth:
    """One computation whose output grew out of line: the largest magnitude among its inputs and weights
    (None: it had no floating input), its output's largest, the output's dtype, and whether the output
    came within ``LIMIT_MARGIN`` of that dtype's limit (else: it jumped by ``GROWTH_FACTOR``)."""

    inputs_abs_max: Optional[float]
    output_abs_max: float
    dtype: str
    near_limit: bool

    def to_json(self) -> Dict[str, Any]:
        return {"inputs_abs_max": None if self.inputs_abs_max is None else json_float(self.inputs_abs_max),
                "output_abs_max": json_float(self.output_abs_max), "dtype": self.dtype,
                "near_limit": self.near_limit}


def near_limit(abs_max: float, dtype: str) -> bool:
    """Within ``LIMIT_MARGIN`` of the dtype's largest finite value (a dtype it does not know: never)."""
    limit = DTYPE_MAX.get(dtype)
    return limit is not None and math.isfinite(abs_max) and abs_max * LIMIT_MARGIN >= limit


def grew(inputs_abs_max: Optional[float], output_abs_max: float, dtype: str) -> Optional[Growth]:
    """The growth of one computation with finite inputs and a finite output (module docstring), or None."""
    if not math.isfinite(output_abs_max):
        return None
    reference = max(1.0, inputs_abs_max or 0.0)
    close = near_limit(output_abs_max, dtype) and not near_limit(inputs_abs_max or 0.0, dtype)
    if close or output_abs_max > GROWTH_FACTOR * reference:
        return Growth(inputs_abs_max, output_abs_max, dtype, close)
    return None


def as_number(stat: Any) -> Optional[float]:
    """An abs-min/abs-max as a frame holds it (a float, or as JSON writes it: "nan"/"inf"/"-inf") as a
    float; None where it was not measured."""
    return float(stat) if stat is not None and is_stat(stat) else None


def entries_growth(entries: Iterable[Tuple[Optional[str], str, Any]]) -> Optional[Growth]:
    """The growth of one module call from its entries' (kind, dtype, abs_max): inputs and weights against
    outputs. None where any measured entry is non-finite, or no output was measured."""
    inputs, outputs = [], []
    for kind, dtype, stat in entries:
        value = as_number(stat)
        if value is None:
            continue
        if not math.isfinite(value):
            return None
        if kind in INPUT_KINDS:
            inputs.append(value)
        elif kind == "output":
            outputs.append((value, dtype))
    if not outputs:
        return None
    output_abs_max, dtype = max(outputs)
    return grew(max(inputs) if inputs else None, output_abs_max, dtype)


def frame_growth(frame: Dict[str, Any]) -> Optional[Growth]:
    """``entries_growth`` of a frame as records and bundle manifests write it."""
    return entries_growth((entry.get("kind"), str(entry.get("dtype")), entry.get("abs_max"))
                          for entry in frame.get("entries", ()) if isinstance(entry, dict))


def first_grown_frame(frames: Sequence[Dict[str, Any]]) -> Optional[Tuple[Dict[str, Any], Growth]]:
    """The first written frame whose output grew out of line, and how."""
    for frame in frames:
        growth = frame_growth(frame) if isinstance(frame, dict) else None
        if growth is not None:
            return frame, growth
    return None


def magnitude_text(value: Any) -> str:
    """A magnitude as a headline writes it: three significant digits, ``3.9e28`` rather than ``3.9e+28``."""
    if value is None:
        return "none"
    mantissa, _, exponent = f"{float(value):.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa
