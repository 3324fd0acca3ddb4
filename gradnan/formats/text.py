"""Text for a terminal and a shell: the one escaping function every command's output goes through
(``printable``), and the quoting of what the user copies into a shell (``shell_word``). In ``formats``
because every layer prints values read from files: the CLI, the offline report and plot, the training
side's log lines."""

from __future__ import annotations

import logging
import re
import shlex
import textwrap
from typing import Any, Iterable, List

# Stands for a space inside a value from a file (``untrusted``) until the line is printed: the wrapping
# (``wrap``) never breaks a line there, and ``printable`` prints a run of them as one ASCII space. A
# private-use code point: no name, host or path gradnan writes holds one, and a file's own is shown as a
# space too.
GLUE = "\ue000"
MAX_VALUE = 160  # characters of one value from a file shown in a text; longer ones are cut in the middle
MAX_LISTED = 8  # items of one list from a file shown in a text; the rest are counted
_SPACE_RUN = re.compile(" {2,}")
_GLUE_RUN = re.compile(GLUE + "+")


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
    twice changes nothing. A value's glued spaces (``GLUE``) are printed as one space a run."""
    text = unglued(text)
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(character if character.isprintable() else _escaped(character) for character in text)


def unglued(text: str) -> str:
    """``text`` with a value's glued spaces (``untrusted``) as spaces, a run as one: once it is laid out."""
    return _GLUE_RUN.sub(" ", text) if GLUE in text else text


def untrusted(text: Any, limit: int = MAX_VALUE) -> str:
    """A value read from a file (a name, a host, a reason) as a text shows it: escaped (``printable``), each
    run of spaces shown as one, cut to ``limit`` characters (the middle dropped, the count said), and
    its spaces glued (``GLUE``). The value can then neither start a line of its own where ``wrap`` breaks
    one, nor indent text to a column of its choice (a fake command under ``Next:``), nor fill a screen."""
    text = _SPACE_RUN.sub(" ", printable(str(text)))
    if len(text) > limit:
        half = limit // 2
        text = f"{text[:half]}...({len(text) - 2 * half} characters)...{text[-half:]}"
    return text.replace(" ", GLUE)


MAX_MESSAGE = 2000  # characters of one error message (the longest gradnan words: 1,100); the middle of a
# longer one is dropped, the count said


def message_line(text: Any) -> str:
    """An error message, which may quote a file's values (a leaf name, a path, a reason), as the one line
    ``bad_input`` prints: what ``untrusted`` makes of a value (escaped, each run of spaces as one, cut in
    the middle), at a message's length. A run of spaces in a file's value cannot push a fake command to
    the start of a terminal's row on this path either."""
    return unglued(untrusted(text, MAX_MESSAGE))


def listing(items: Iterable[Any], limit: int = MAX_LISTED) -> str:
    """Items from a file as a text lists them: the first ``limit`` (each ``untrusted``), then the count."""
    items = list(items)
    shown = ", ".join(untrusted(item) for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def wrap(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "") -> List[str]:
    """``text`` in lines of at most ``width`` characters, broken only at the text's own spaces: never
    inside a value (``untrusted``), nor inside a long word (a path, a name), which overruns the width."""
    return textwrap.wrap(text, width, initial_indent=initial_indent, subsequent_indent=subsequent_indent,
                         break_long_words=False, break_on_hyphens=False)


def printable_lines(lines: Iterable[str]) -> str:
    """Lines joined for a terminal, each escaped whole (``printable``): a newline inside a line, from a
    value put into it, is shown as ``\\n``; only the joins start new lines."""
    return "\n".join(printable(line) for line in lines)


def plain(document: Any) -> Any:
    """A JSON document whose wordings hold values (``untrusted``), with their glued spaces as spaces."""
    if isinstance(document, str):
        return unglued(document)
    if isinstance(document, dict):
        return {key: plain(item) for key, item in document.items()}
    if isinstance(document, (list, tuple)):
        return [plain(item) for item in document]
    return document


def shell_word(value: Any) -> str:
    """``value`` (a path, a name) quoted for a POSIX shell, as a command the user copies needs it: a path
    with a space or a ``;`` stays one argument and runs nothing (``shlex.quote``), and is never broken by
    ``wrap``. A value that is not printable or holds a run of spaces is written in bash's ``$'...'`` form
    with byte escapes (every space ``\\x20``, a control character ``\\x1b``, U+202E as its UTF-8 bytes
    ``\\xe2\\x80\\xae``): still the same path to bash and zsh in every locale (a ``\\u`` escape is
    encoded in the shell's own locale: under ``LANG=C`` it names another file), and no run of spaces that
    could push a value's text to the start of a line."""
    text = str(value)
    if text.isprintable() and "  " not in text:
        return shlex.quote(text).replace(" ", GLUE)
    return "$'" + "".join(_ansi_c(character) for character in text) + "'"


def _ansi_c(character: str) -> str:
    """One character inside bash's ``$'...'`` quoting: itself where printable, else its bytes (UTF-8, or
    the byte a file name's undecodable byte stands for) as ``\\xNN``."""
    if character in "\\'":
        return "\\" + character
    if character.isprintable() and character != " ":
        return character
    try:
        data = character.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        data = character.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{byte:02x}" for byte in data)


class PlainSpaces(logging.Filter):
    """A log message whose wording holds values laid out for a text (``untrusted``, in wordings the
    training side shares with the report) shows their glued spaces as spaces, whatever handler prints it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if GLUE in message:
            record.msg, record.args = unglued(message), ()
        return True


def magnitude(value: Any) -> str:
    """A number as a record wrote it, in three significant digits; "inf", "nan" (or any text) escaped."""
    return f"{value:.3g}" if isinstance(value, (int, float)) else untrusted(value)
