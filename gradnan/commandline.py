"""What the two command lines (``gradnan`` and ``python -m gradnan.run``) share: bad input is one line
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, TextIO

from .config.sources import parse_bool
from .errors import GradnanError, UsageError
from .formats.text import message_line, printable, printable_lines, shell_word

__all__ = ["printable", "printable_lines", "shell_word"]  # the escaping every command's output goes through

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


def whole_number(text: str) -> int:
    """An argparse type: a whole number >= 0, in ASCII digits (``int`` would take ``٣``)."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def say(text: str, file: Optional[TextIO] = None) -> None:
    """Print laid-out ``text`` for a terminal: its newlines are the layout, every line is escaped
    (``printable``). Text that puts a value from a file into its lines escapes each line itself first
    (``printable_lines``), so that a newline in the value cannot start a line."""
    print(printable_lines(str(text).split("\n")), file=file or sys.stdout)


def bad_input(program: str, error: GradnanError) -> int:
    """Say what was wrong in one line on stderr; the exit code for bad input."""
    message = str(error) if isinstance(error, ArgumentError) else f"{program}: error: {error}"
    print(message_line(message), file=sys.stderr)  # one line whatever it holds (a path with a newline)
    return EXIT_BAD_INPUT
