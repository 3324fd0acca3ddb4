"""What the two command lines (``gradnan`` and ``python -m gradnan.run``) share: bad input is one line
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Iterable, NoReturn, Optional, TextIO

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


def _escaped(character: str) -> str:
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` as ONE line a terminal shows as it is: every character Python does not call printable
    (``str.isprintable``) escaped (``\\x1b``, ``\\n``, ``\\u202e``). That is the control characters
    (ANSI/OSC escape sequences, newline, carriage return, tab), the line and paragraph separators (U+0085,
    U+2028, U+2029), the format characters (category Cf: bidirectional marks, overrides and isolates,
    zero-width characters, U+FEFF), spaces other than the ASCII space, surrogates, private-use and
    unassigned code points. A parameter name, a host or a path from an untrusted file can then neither
    drive the terminal (colours, titles, hyperlinks, clearing the screen) nor print a line of its own (a
    fake ``Verdict:``) nor reorder or hide what is shown. The escapes are printable themselves: escaping
    twice changes nothing."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(character if character.isprintable() else _escaped(character) for character in text)


def printable_lines(lines: Iterable[str]) -> str:
    """Lines joined for a terminal, each escaped whole (``printable``): a newline inside a line, from a
    value put into it, is shown as ``\\n``; only the joins start new lines."""
    return "\n".join(printable(line) for line in lines)


def shell_word(value: Any) -> str:
    """``value`` (a path, a name) quoted for a POSIX shell, as a command the user copies needs it: a path
    with a space or a ``;`` stays one argument and runs nothing (``shlex.quote``)."""
    return shlex.quote(str(value))


def say(text: str, file: Optional[TextIO] = None) -> None:
    """Print laid-out ``text`` for a terminal: its newlines are the layout, every line is escaped
    (``printable``). Text that puts a value from a file into its lines escapes each line itself first
    (``printable_lines``), so that a newline in the value cannot start a line."""
    print(printable_lines(str(text).split("\n")), file=file or sys.stdout)


def bad_input(program: str, error: GradnanError) -> int:
    """Say what was wrong in one line on stderr; the exit code for bad input."""
    message = str(error) if isinstance(error, ArgumentError) else f"{program}: error: {error}"
    print(printable(message), file=sys.stderr)  # one line whatever the message holds (a path with a newline)
    return EXIT_BAD_INPUT
