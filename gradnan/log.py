"""The ``gradnan`` logger: rank-prefixed lines on stderr unless the application configured its own."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("gradnan")


def _rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return launcher_rank()


def launcher_rank() -> str:
    """This process's rank before torch.distributed starts: torchrun's RANK, else SLURM's SLURM_PROCID."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def configure(level: str) -> None:
    """Give the logger a level, and a stderr handler when neither it nor the root logger has one."""
    logger.setLevel(level.upper())
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[gradnan rank %(rank)s] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
