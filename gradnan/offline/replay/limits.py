"""The limits of one ``gradnan replay`` child process (``isolation``); no torch import, so that parsing
the command line stays fast."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_OPS = 100_000
# a bundle from someone else's job may hold anything: by default a replay gets minutes of CPU and a quarter
# of this machine's memory (a captured call replays in seconds); the options raise them
DEFAULT_MAX_CPU_SECONDS = 600
DEFAULT_MEMORY_SHARE = 4
MAX_CPU_SECONDS = 86_400  # a day; the wall-clock backstop (2 N + 60 s) stays within poll()'s range
MAX_MEMORY = 1 << 50  # 1 PiB: beyond it a size is a typo
_SIZE = re.compile(r"(\d{1,15})([KMGT]?)(i?B)?", re.IGNORECASE | re.ASCII)


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
    refuses before a child starts, and for ``trace.replay``, which refuses before anything runs."""
    if ops <= max_ops:
        return None
    return f"the trace has {ops} ops, more than the {max_ops} a replay runs (--max-ops): refused"


def default_max_memory() -> int:
    """The default ``--max-memory``: a quarter of this machine's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // DEFAULT_MEMORY_SHARE


def byte_size(text: str) -> int:
    """An argparse type: bytes, or a whole number with K, M, G or T (powers of 1024: ``8G``, ``512MiB``),
    at most ``MAX_MEMORY``."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(f"not a size (bytes, or a number with K, M, G or T): {text!r}")
    size = int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))
    if size > MAX_MEMORY:
        raise argparse.ArgumentTypeError(f"{text!r}: more than {MAX_MEMORY >> 50} PiB")
    return size


def cpu_seconds(text: str) -> int:
    """An argparse type: whole seconds of CPU time, 1 to ``MAX_CPU_SECONDS``."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_CPU_SECONDS:
        raise argparse.ArgumentTypeError(f"must be whole seconds from 1 to {MAX_CPU_SECONDS}, got {text!r}")
    return int(text)
