"""The limits of one ``gradnan replay`` child process (``isolation``); no torch import, so that parsing
the command line stays fast."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_OPS = 100_000
DEFAULT_MAX_CPU_SECONDS = 3600
_SIZE = re.compile(r"(\d{1,15})([KMGT]?)(i?B)?", re.IGNORECASE)


@dataclass(frozen=True)
class ReplayLimits:
    """What one replay child may use: ``max_memory`` bytes of address space beyond what it has mapped
    when it starts, ``max_cpu_seconds`` of CPU time (all threads), ``max_ops`` operators per pass."""

    max_memory: int
    max_cpu_seconds: int = DEFAULT_MAX_CPU_SECONDS
    max_ops: int = DEFAULT_MAX_OPS

    @property
    def wall_seconds(self) -> int:
        """The wall-clock backstop, for a child that waits without computing."""
        return 2 * self.max_cpu_seconds + 60


def trace_too_long(ops: int, max_ops: int) -> Optional[str]:
    """Why a trace of ``ops`` operators is not replayed, or None: one wording for the command, which
    refuses before a child starts, and for ``trace_replay.replay``, which refuses before anything runs."""
    if ops <= max_ops:
        return None
    return f"the trace has {ops} ops, more than the {max_ops} a replay runs (--max-ops): refused"


def physical_memory() -> int:
    """This machine's memory in bytes: the default ``--max-memory``."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def byte_size(text: str) -> int:
    """An argparse type: bytes, or a whole number with K, M, G or T (powers of 1024: ``8G``, ``512MiB``)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(f"not a size (bytes, or a number with K, M, G or T): {text!r}")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))
