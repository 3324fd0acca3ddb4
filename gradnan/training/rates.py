"""The learning rate each optimizer step used, for the last few steps: read at the step's start from the
optimizer's param groups where they hold plain numbers (host values; a rate held in a tensor is not read,
so no step ever waits for the device). At an incident the ``state`` record carries them, and the report
judges the update that wrote a bad weight by the rate it used.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Optional, Tuple

from ..formats.schema import json_float

KEPT_STEPS = 8


def _rate(group: Any) -> Optional[float]:
    value = group.get("lr") if isinstance(group, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class LearningRates:
    """The last ``KEPT_STEPS`` steps' rates, one per param group, in the optimizer's order."""

    def __init__(self) -> None:
        self._kept: Deque[Tuple[int, List[Optional[float]]]] = collections.deque(maxlen=KEPT_STEPS)

    def keep(self, step: int, optimizer: Any) -> None:
        """At ``optimizer.step()``'s start: the rates this update uses."""
        rates = [_rate(group) for group in getattr(optimizer, "param_groups", None) or ()]
        if self._kept and self._kept[-1][0] == step:
            self._kept.pop()
        self._kept.append((step, rates))

    def to_json(self) -> List[Dict[str, Any]]:
        """A ``state`` record's ``learning_rates``: oldest first."""
        return [{"step": step, "lr": [None if rate is None else json_float(rate) for rate in rates]}
                for step, rates in self._kept]
