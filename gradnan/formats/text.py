"""Text for a terminal and a shell: the one escaping function every command's output goes through
(``printable``), and the quoting of what the user copies into a shell (``shell_word``). In ``formats``
because every layer prints values read from files: the CLI, the offline report and plot, the training
side's log lines."""

from __future__ import annotations

import shlex
from typing import Any, Iterable


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
