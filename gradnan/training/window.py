"""The recording window: whether anything is recorded now (``start()``/``stop()``, ``ranks``, ``steps``)."""

from __future__ import annotations

from typing import Callable, Optional

from ..config import GradnanConfig
from .clock import StepClock


class RecordingWindow:
    def __init__(self, config: GradnanConfig, clock: StepClock, global_rank: Callable[[], int]) -> None:
        self._ranks, self._steps = config.ranges("ranks"), config.ranges("steps")
        self._clock, self._global_rank = clock, global_rank
        self.open = True
        self._rank_recorded: Optional[bool] = None

    def recording(self) -> bool:
        if not self.open:
            return False
        if self._ranks and self._rank_recorded is None:
            self._rank_recorded = self._global_rank() in self._ranks
        if self._ranks and not self._rank_recorded:
            return False
        return not self._steps or self._clock.filter_step() in self._steps
