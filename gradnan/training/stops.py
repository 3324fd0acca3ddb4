"""The only two ways gradnan stops a run, each only when asked: ``on_nonfinite="raise"`` and
``abort_after_step``. Both raise after the evidence is on disk."""

from __future__ import annotations

from ..config import GradnanConfig
from ..config.values import OnNonfinite
from ..errors import AbortRequested, NonFiniteGradientError
from .messages import when, where
from .writer import Written


def stop_if_asked(config: GradnanConfig, record: Written) -> None:
    if config.on_nonfinite is OnNonfinite.RAISE:
        raise NonFiniteGradientError(
            f"gradnan: {record['kind']} at {when(record)} on {where(record)}; stopping as"
            f" configured (on_nonfinite=raise); record: {record.path}")


def abort_if_asked(config: GradnanConfig, finished: int) -> None:
    limit = config.abort_after_step
    if limit and finished >= limit:
        raise AbortRequested(f"gradnan: stopping after step {finished} as configured"
                             f" (abort_after_step={limit}); records are in {config.out_dir}")
