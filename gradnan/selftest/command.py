"""``gradnan selftest`` on the command line: its options, turned into ``SelftestOptions``, and its exit
code. The torch side (``runner``) is loaded only when the command runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .options import DEFAULT_OUT, DEFAULT_SECONDS, DEFAULT_TIMEOUT, SelftestOptions

EXIT_FAIL = 1
"""A rank disagrees, could not communicate or did not join in time: every rank that gets to decide exits
with it. A pass exits 0; bad options, launch environment or ``--out`` exit ``commandline.EXIT_BAD_INPUT``
(docs/selftest.md#exit-codes)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``selftest`` options. Their values are checked by ``run`` (``UsageError``)."""
    parser.add_argument("--tp", type=int, help="tensor-parallel size: also check the tp/pp/dp groups")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size (default 1 when --tp is given)")
    parser.add_argument("--size", type=int,
                        help="square matrix size of the arithmetic checks (default 4096 on GPU, 256 on CPU)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float,
                        help=f"repeat the arithmetic checks for this long (default {DEFAULT_SECONDS:g})")
    budget.add_argument("--repeats", type=int, help="repeat the arithmetic checks this many times instead")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds to wait for a rank at the rendezvous and at each collective"
                             " (default %(default)g)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="run directory; the result goes to OUT/selftest/ (default %(default)s)")


def options_from(args: argparse.Namespace) -> SelftestOptions:
    """The parsed ``selftest`` options, checked (``UsageError``)."""
    return SelftestOptions(tp=args.tp, pp=args.pp, size=args.size, seconds=args.seconds, repeats=args.repeats,
                           timeout=args.timeout, out=Path(args.out))


def run(args: argparse.Namespace) -> int:
    """Run the self-test on this rank: 0 when every check agrees on every rank, else ``EXIT_FAIL``. Bad
    input raises ``UsageError`` or ``InputError``, which the command reports in one line (exit code 2)."""
    from .runner import run_selftest

    return 0 if run_selftest(options_from(args), os.environ) else EXIT_FAIL
