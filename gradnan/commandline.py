"""What the two command lines (``gradnan`` and ``python -m gradnan.run``) share: bad input is one line
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, TextIO

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


# C0 and C1 control characters (ANSI/OSC escape sequences start with them) and the bidirectional
# overrides, which reorder what a terminal shows; newline and tab are layout.
_UNPRINTABLE = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
                for code in (*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F),
                             *range(0x2066, 0x206A))
                if chr(code) not in "\n\t"}


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\x1b``): a parameter name, a host or a path from
    an untrusted file cannot drive the terminal (colours, titles, hyperlinks, clearing the screen)."""
    return text.translate(_UNPRINTABLE)


def say(text: str, file: Optional[TextIO] = None) -> None:
    """Print ``text`` for a terminal, escaped (``printable``)."""
    print(printable(str(text)), file=file or sys.stdout)


def bad_input(program: str, error: GradnanError) -> int:
    """Say what was wrong in one line on stderr; the exit code for bad input."""
    say(error if isinstance(error, ArgumentError) else f"{program}: error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT
