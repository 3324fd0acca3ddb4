"""What rank 0 prints. Host names, paths and errors come from other ranks and other machines, so every
line goes out through ``say``, which escapes control characters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, TextIO

from ..commandline import printable_lines, say
from .wording import shortened

if TYPE_CHECKING:
    from .runner import Settings


def show(text: str, file: Optional[TextIO] = None) -> None:
    """``say`` it now, not when the buffer fills: a collective that hangs next may get the process killed."""
    stream = file or sys.stdout
    say(text, file=stream)
    stream.flush()


def format_header(settings: Settings) -> str:
    """The first line: what this run checks, and for how long."""
    layout = (" ".join(f"{axis}{size}" for axis, size in settings.layout.items()) if settings.layout
              else "none")
    budget = f"{settings.repeats} repeat(s)" if settings.repeats else f"{settings.seconds:g} s"
    return (f"gradnan selftest: {settings.world_size} rank(s), backend {settings.backend}, layout {layout},"
            f" size {settings.size}, arithmetic for {budget}, timeout {settings.timeout:g} s")


def format_text(document: Dict[str, Any], path: Optional[Path]) -> str:
    """The rest: a line per phase, every rank named with why, the file, then PASS or FAIL."""
    lines = []
    for kind in ("communication", "arithmetic"):
        checks = [check for check in document["checks"] if check["kind"] == kind]
        if checks:
            bad = sum(not check["pass"] for check in checks)
            repeats = f" x {checks[0]['repeats']} repeat(s)" if kind == "arithmetic" else ""
            verdict = f"{bad} failed" if bad else "all ranks agree"
            lines.append(f"{kind}: {len(checks)} check(s){repeats}, {verdict}")
    for skip in document["skipped"]:
        lines.append(f"skipped {skip['name']} on rank(s) {shortened(skip['ranks'])}: {skip['reason']}")
    unreachable = document["unreachable"]
    if unreachable and not unreachable["ranks"]:
        lines.append(f"{unreachable['phase']} failed and named no rank: {unreachable['error']}")
    if document["failing_ranks"]:
        lines.append("Ranks that disagree with the majority or could not communicate:")
        for failing in document["failing_ranks"]:
            where = f"host {failing['host']}, {failing['device']}" if failing["host"] else "host unknown"
            lines.append(f"  rank {failing['rank']} ({where}): {'; '.join(failing['reasons'])}")
    if path is not None:
        lines.append(f"Result: {path}")
    world = document["world_size"]
    if document["pass"]:
        lines.append(f"PASS: all {world} rank(s) communicate and agree bitwise on every check")
    else:
        named = len(document["failing_ranks"])
        lines.append(f"FAIL: {named} of {world} rank(s) named above" if named
                     else f"FAIL: {unreachable['phase']} failed")
    return printable_lines(lines)
