"""The one step count: which step is in progress, as records name it and as the step filters see it.

- ``current()``: the step records carry. The stepping optimizer's count of ``step()`` calls (else one past
  the last step taken); once a custom loop calls ``Installation.step()``, the loop's own count.
- ``filter_step()``: the step the filters (``steps``, ``trace_steps``, ``capture_steps``) compare with:
  the loop's count, else Megatron-LM's iteration where its loop runs, else ``current()``.
- ``iteration()``: Megatron-LM's iteration, written beside ``step`` in every record.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional


class StepClock:
    def __init__(self, iteration: Callable[[], Optional[int]]) -> None:
        self.iteration = iteration
        self._steps: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._loop: Optional[int] = None
        self._local = threading.local()
        self._lock = threading.Lock()

    def add(self, optimizer: Any) -> None:
        with self._lock:
            self._steps.setdefault(optimizer, 0)

    def begin(self, optimizer: Any) -> None:
        """``optimizer.step()`` starts: its count goes up and it is the stepping optimizer."""
        with self._lock:
            self._steps[optimizer] = self._steps.get(optimizer, 0) + 1
        self._local.stepping = optimizer

    def end(self, optimizer: Any) -> None:
        if self.stepping() is optimizer:
            self._local.stepping = None

    def stepping(self) -> Optional[Any]:
        return getattr(self._local, "stepping", None)

    def steps_taken(self) -> int:
        """The most ``step()`` calls any optimizer has begun."""
        with self._lock:
            return max(self._steps.values(), default=0)

    def current(self, optimizer: Any = None) -> int:
        """The step in progress as records name it (``optimizer``: count that one's steps)."""
        if self._loop is not None:
            return self._loop
        optimizer = optimizer if optimizer is not None else self.stepping()
        with self._lock:
            if optimizer is not None and optimizer in self._steps:
                return self._steps[optimizer]
        return self.steps_taken() + 1

    def filter_step(self) -> int:
        if self._loop is not None:
            return self._loop
        iteration = self.iteration()
        return iteration if iteration is not None else self.current()

    @property
    def counts_loop(self) -> bool:
        """Whether a custom loop's ``step()`` drives the count."""
        return self._loop is not None

    def loop_step(self) -> int:
        """A custom loop's step in progress; its count starts, on the first call, from the optimizer steps
        taken so far (at least 1: a loop without a Megatron optimizer)."""
        if self._loop is None:
            self._loop = max(1, self.steps_taken())
        return self._loop

    def advance_loop(self) -> None:
        self._loop = self.loop_step() + 1
