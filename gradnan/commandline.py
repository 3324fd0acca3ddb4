"""What the two command lines (``gradnan`` and ``python -m gradnan.run``) share: bad input is one line
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from .config import parse_bool
from .errors import GradnanError, UsageError

EXIT_BAD_INPUT = 2


class ArgumentError(UsageError):
    """A command line argparse rejects; the message already names the program."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ArgumentError(f"{self.prog}: error: {message}")


def boolean(text: str) -> bool:
    """An argparse type: 1/0, true/false, yes/no, on/off."""
    value = parse_bool(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")
    return value


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def bad_input(program: str, error: GradnanError) -> int:
    """Say what was wrong in one line on stderr; the exit code for bad input."""
    print(error if isinstance(error, ArgumentError) else f"{program}: error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT
