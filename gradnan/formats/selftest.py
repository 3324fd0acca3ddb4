"""A self-test result (``gradnan.selftest``): which ranks failed which check, written by rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ..errors import InputError
from .schema import Schema, is_int, is_text, optional, read_document

SCHEMA = Schema("gradnan.selftest", 1)


def from_json(document: Any, where: str) -> Dict[str, Any]:
    document = SCHEMA.check(document, where)
    failing = document.get("failing_ranks")
    if not isinstance(document.get("pass"), bool) or not isinstance(failing, list) or not all(
            isinstance(entry, dict) and is_int(entry.get("rank")) and optional(entry.get("host"), is_text)
            and optional(entry.get("device"), is_text) for entry in failing) or not optional(
            document.get("world_size"), is_int) or not optional(document.get("time"), is_text):
        raise InputError(f"{where}: a self-test result needs 'pass' and a 'failing_ranks' list of ranks")
    return document


def load(path: Path) -> Dict[str, Any]:
    return from_json(read_document(path, SCHEMA), str(path))
