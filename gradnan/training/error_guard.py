"""Training must never die of gradnan: an internal error is logged once per kind and the original
behaviour goes on; ``strict=True`` lets it propagate (as ``InternalError``), so tests fail on it."""

from __future__ import annotations

from typing import Any, Callable, Set

from ..errors import INTENDED_STOPS, InternalError
from ..log import logger


class ErrorGuard:
    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._logged: Set[str] = set()

    def __call__(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; on an exception log it once per (what, type) and return None, unless strict."""
        try:
            return fn(*args)
        except INTENDED_STOPS:
            raise
        except Exception as exc:
            if self.strict:
                raise InternalError(f"internal error in {what}: {type(exc).__name__}: {exc}") from exc
            self.log_once(f"{what}:{type(exc).__name__}",
                          "internal error in %s (training goes on unchanged): %s: %s",
                          what, type(exc).__name__, exc)
            return None

    def log_once(self, key: str, message: str, *args: Any) -> None:
        """An ERROR line the first time ``key`` is seen."""
        if key not in self._logged:
            self._logged.add(key)
            logger.error(message, *args)
