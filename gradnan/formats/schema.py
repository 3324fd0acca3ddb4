"""What every gradnan document has in common: a named, versioned schema and strict field checks.

Each file format (``maps``, ``records``, ``bundle``, ``selftest``, ``trace``) declares its own
``Schema``; a reader accepts a document of its schema at the version it knows or an older one, and
refuses a newer one with the advice to upgrade. Each schema is versioned on its own. A document is read
bounded, from a regular file only (``open_regular``, ``read_document``); how files are written is
``safe_write``'s.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Mapping, Optional, Tuple, Union

from ..errors import InputError


@dataclass(frozen=True)
class Schema:
    """A document kind: ``name`` is its ``schema`` field, ``version`` the newest this gradnan writes."""

    name: str
    version: int

    def header(self) -> Dict[str, Any]:
        """The fields that open every document of this schema."""
        return {"schema": self.name, "version": self.version}

    def check(self, document: Any, where: str) -> Dict[str, Any]:
        """``document`` as a dict of this schema at a version this gradnan reads; InputError otherwise."""
        if not isinstance(document, dict):
            raise InputError(f"{where}: not a JSON object")
        if document.get("schema") != self.name:
            raise InputError(f"{where}: not a {self.name} document (schema={document.get('schema')!r})")
        version: Any = document.get("version")  # checked next: an int within int64, or refused
        if not is_int(version) or version < 1:
            raise InputError(f"{where}: missing or invalid schema version")
        if version > self.version:
            raise InputError(f"{where}: {self.name} version {version} is newer than this gradnan reads"
                             f" ({self.version}); upgrade gradnan")
        return document


INT_BOUND = 2**63  # every integer gradnan writes fits in int64; a 400-digit one is not a count, a step, an id


def is_int(value: Any) -> bool:
    """An integer within int64: larger ones (valid JSON) would overflow every float or format using them."""
    return isinstance(value, int) and not isinstance(value, bool) and -INT_BOUND <= value < INT_BOUND


def is_number(value: Any) -> bool:
    """A usable number: not a bool, not NaN/Inf, and small enough for a float (time stamps, counts)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e15 < value < 1e15


def is_finite(value: Any) -> bool:
    """A finite number a float can hold (a measured magnitude: up to float64's largest)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_text(value: Any) -> bool:
    """A string that can be written back as UTF-8 (no lone surrogate); one regex scan, not a loop per
    character."""
    return isinstance(value, str) and (value.isascii() or _SURROGATE.search(value) is None)


NONFINITE_WORDS = ("nan", "inf", "-inf")  # how JSON records write a non-finite number (``json_float``)


def is_stat(value: Any) -> bool:
    """An abs-min/abs-max as written: a number, "nan"/"inf"/"-inf", or null (not measured)."""
    return value is None or value in NONFINITE_WORDS or is_finite(value)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def optional(value: Any, check: Callable[[Any], bool]) -> bool:
    return value is None or check(value)


def json_float(value: float) -> Any:
    """JSON has no NaN/Inf: non-finite floats are written as the strings "nan", "inf", "-inf"."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


_RANK_INTS = ("tp", "pp", "dp", "cp", "ep", "tp_size", "pp_size", "dp_size", "cp_size", "ep_size",
              "world_size", "local_rank", "pid")


def check_rank(rank: Any, where: str) -> None:
    """The rank object every reader and the report rely on: integers where integers go, text for host."""
    if not isinstance(rank, dict) or not is_int(rank.get("global_rank")):
        raise InputError(f"{where}: needs a 'rank' object with an integer 'global_rank'")
    for value in map(rank.get, _RANK_INTS):  # inline: a record of each of 131,072 ranks has one
        if value is not None and (type(value) is not int or not -INT_BOUND <= value < INT_BOUND) \
                and not is_int(value):
            key = next(key for key in _RANK_INTS if rank.get(key) is value)
            raise InputError(f"{where}: rank.{key} must be an integer")
    for key in ("host", "device"):
        if not optional(rank.get(key), is_text):
            raise InputError(f"{where}: rank.{key} must be text")
    for value, bound in zip(map(rank.get, _COORDINATES), map(rank.get, _SIZES)):
        if value is not None and (value < 0 or (bound is not None and not value < bound)):
            key, size = next(pair for pair in zip(_COORDINATES, _SIZES) if rank.get(pair[0]) is value)
            raise InputError(f"{where}: rank.{key} {value} is outside its group (rank.{size} {bound})")


# a coordinate and the size it must be below: a rank outside its world is no rank of this job
_COORDINATES = ("global_rank", "tp", "pp", "dp", "cp", "ep")
_SIZES = ("world_size", "tp_size", "pp_size", "dp_size", "cp_size", "ep_size")


def check_run(run: Any, where: str) -> None:
    """The launch identity written into records, maps and bundles (``layout.run_identity``)."""
    if run is not None and not (isinstance(run, dict) and optional(run.get("started"), is_number)
                                and optional(run.get("id"), is_text)
                                and optional(run.get("rendezvous"), is_text)
                                and optional(run.get("attempt"), _is_attempt)):
        raise InputError(f"{where}: 'run' needs a numeric 'started', a text 'id' and 'rendezvous' and an"
                         " 'attempt'")


def _is_attempt(value: Any) -> bool:
    return is_int(value) or is_text(value)


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise InputError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python converts
        raise InputError(f"{where}: invalid JSON ({str(exc).splitlines()[0][:80]})") from None


FilePath = Union[str, Path]  # a file to read: a Path, or its name as text (listed files cost no Paths)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_READ_BYTES = 1 << 30  # above any file gradnan writes (records stop at max_records_bytes, 64 MiB)


def open_regular(path: FilePath, max_bytes: int = MAX_READ_BYTES, follow: bool = False) -> BinaryIO:
    """``path`` opened for reading if it is a regular file of at most ``max_bytes``; InputError otherwise.

    Opened without blocking (a FIFO would wait forever for a writer) and checked on the open file, not
    the name, so a directory swapped in after a check is refused too. A symbolic link is refused unless
    ``follow`` (a user's own config file): a member of a run directory or bundle that points elsewhere
    (``manifest.json -> /etc/...``) is not read, so nothing of another file reaches a message."""
    descriptor, _ = _open_checked(path, max_bytes, follow)
    try:
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _open_checked(path: FilePath, max_bytes: int, follow: bool) -> Tuple[int, int]:
    """``open_regular``'s descriptor (still non-blocking) and the file's size."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise InputError(f"{path}: not a regular file (a symbolic link): refused") from None
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise InputError(f"{path}: not a regular file ({_file_kind(status.st_mode)}): refused")
        if status.st_size > max_bytes:
            raise InputError(f"{path}: {status.st_size} bytes, more than the {max_bytes} gradnan reads:"
                             " refused")
        return descriptor, status.st_size
    except BaseException:
        os.close(descriptor)
        raise


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def read_bytes(path: FilePath, max_bytes: int = MAX_READ_BYTES, follow: bool = False) -> bytes:
    """The content of a regular file of at most ``max_bytes`` (``open_regular``); never more is read,
    even from a file that grows while it is read. Read at its size with plain reads (one of 131,072
    ranks' files costs an open, a read and a close)."""
    data = _read_open(path, *_open_checked(path, max_bytes, follow), max_bytes)
    if len(data) > max_bytes:
        raise InputError(f"{path}: more than the {max_bytes} bytes gradnan reads: refused")
    return data


def read_if_small(path: FilePath, small: int) -> Optional[bytes]:
    """``read_bytes`` of a file of at most ``small`` bytes; None for a larger one (read it as a stream)."""
    descriptor, size = _open_checked(path, MAX_READ_BYTES, False)
    if size > small:
        os.close(descriptor)
        return None
    data = _read_open(path, descriptor, size, small)
    return data if len(data) <= small else None


def _read_open(path: FilePath, descriptor: int, size: int, max_bytes: int) -> bytes:
    """At most ``max_bytes`` + 1 bytes of an open file of ``size`` bytes, and closes it: one read where the
    file is still that size, more where it grew or a read came short (read on to its end)."""
    try:
        data = os.read(descriptor, min(size, max_bytes) + 1)
        if len(data) != size:
            chunks = [data]
            total = len(data)
            while chunks[-1] and total <= max_bytes:
                chunks.append(os.read(descriptor, max_bytes + 1 - total))
                total += len(chunks[-1])
            data = b"".join(chunks)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(descriptor)
    return data


def read_prefix(path: FilePath, count: int) -> bytes:
    """At most the first ``count`` bytes of a regular file (``open_regular``)."""
    with open_regular(path) as stream:
        try:
            return stream.read(count)
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_text(path: FilePath, max_bytes: int = MAX_READ_BYTES, follow: bool = False) -> str:
    """The one way gradnan reads a file it did not just write: ``read_bytes``, decoded as UTF-8."""
    try:
        return read_bytes(path, max_bytes, follow).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None


def read_document(path: FilePath, schema: Schema, max_bytes: int = MAX_READ_BYTES) -> Dict[str, Any]:
    """A JSON file of ``schema`` of at most ``max_bytes``, checked for its name and version (the caller
    checks its fields)."""
    return parse_document(read_bytes(path, max_bytes), path, schema)


def parse_document(data: bytes, path: FilePath, schema: Schema) -> Dict[str, Any]:
    """``read_document`` of bytes already read from ``path``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    return schema.check(parse_json(text, str(path)), str(path))


def nonfinite_counts(entry: Mapping[str, Any]) -> str:
    """ "3 NaN, 1 Inf" for an entry with ``nan``/``inf`` counts (zero counts left out)."""
    return ", ".join(f"{entry[key]} {label}" for key, label in (("nan", "NaN"), ("inf", "Inf"))
                     if entry.get(key))
