"""Re-entrancy guard: only the outermost of nested wrapped calls acts, so one step gives one record."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class Outermost:
    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def enter(self) -> Iterator[bool]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._local.depth = depth
