"""The per-rank parameter map (``gradnan.map``): optimizer parameter id -> global name and its facts.

Version 2 writes the parameters as a table (``param_columns`` once, then one row per parameter), without
indentation: a map of 50,000 parameters is built and written in a fraction of a second and read back fast.
Readers still accept version 1 (``params`` as one object per parameter) and give both as objects.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..errors import InputError
from .safe_write import write_json_atomic
from .schema import (
    FilePath,
    Schema,
    check_rank,
    is_int,
    is_text,
    open_regular,
    parse_json,
    read_prefix,
    read_text,
)

SCHEMA = Schema("gradnan.map", 2)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter as the optimizer steps it.

    ``id`` is its position in the optimizer's parameters (``get_parameters()``, concatenated over a
    ``ChainedOptimizer``'s sub-optimizers): the id a record reports. ``order`` is its position in the
    model's parameter registration (forward) order on this rank; backward order is the reverse.
    ``shape``/``dtype``/``numel`` are the model parameter's. ``shard`` is the ``[start, end)`` slice of
    the flattened model parameter this rank steps (distributed optimizer), else None.
    """

    id: int
    name: str
    shape: Tuple[int, ...]
    dtype: str
    numel: int
    group: int
    wd_mult: Optional[float]
    lr_mult: Optional[float]
    is_expert: bool
    optimizer: int
    shard: Optional[Tuple[int, int]]
    main_dtype: str
    order: int = -1

    def to_row(self) -> List[Any]:
        """The slot's values in ``COLUMNS`` order, as JSON values."""
        return [self.id, self.name, list(self.shape), self.dtype, self.numel, self.group, self.wd_mult,
                self.lr_mult, self.is_expert, self.optimizer,
                list(self.shard) if self.shard is not None else None, self.main_dtype, self.order]


COLUMNS = tuple(field.name for field in fields(ParamSlot))


def to_json(coords: Mapping[str, Any], versions: Mapping[str, Any], run: Mapping[str, Any],
            optimizer_index: int, optimizer_class: str, slots: Sequence[ParamSlot]) -> Dict[str, Any]:
    return {
        **SCHEMA.header(),
        "written_at": time.time(),
        "rank": dict(coords),
        "versions": dict(versions),
        "run": dict(run),
        "optimizer_index": optimizer_index,
        "optimizer_class": optimizer_class,
        "params_count": len(slots),
        "param_columns": list(COLUMNS),
        "params": [slot.to_row() for slot in slots],
    }


def _checked_columns(document: Dict[str, Any], where: str) -> List[str]:
    """Version 2's table: column names with 'id' and 'name', and a row of that many values per parameter."""
    columns = document.get("param_columns")
    if not (isinstance(columns, list) and all(is_text(column) for column in columns)
            and "id" in columns and "name" in columns):
        raise InputError(f"{where}: a version 2 map needs 'param_columns', a list of names with 'id' and"
                         " 'name'")
    id_at, name_at = columns.index("id"), columns.index("name")
    for position, row in enumerate(document["params"]):
        if not (isinstance(row, list) and len(row) == len(columns) and is_int(row[id_at])
                and is_text(row[name_at])):
            raise InputError(f"{where}: params[{position}] needs one value per column ({len(columns)}), an"
                             " integer 'id' and a string 'name'")
    return columns


def from_json(document: Any, where: str, params: bool = True) -> Dict[str, Any]:
    """A map document, checked: InputError (one line) for anything a reader could not use. Its ``params``
    are one object per parameter whatever the version, and ``params_count`` their number; ``params=False``
    leaves them out, and a version 2 table is then counted, not checked row by row."""
    document = SCHEMA.check(document, where)
    entries, rank = document.get("params"), document.get("rank")
    if not isinstance(entries, list) or not isinstance(rank, dict):
        raise InputError(f"{where}: a map needs a 'params' list and a 'rank' object")
    check_rank(rank, where)
    document["params_count"] = len(entries)
    if document["version"] >= 2 and params:
        columns = _checked_columns(document, where)
        document["params"] = [dict(zip(columns, row)) for row in entries]
    elif document["version"] < 2:
        for position, entry in enumerate(entries):
            if not (isinstance(entry, dict) and is_int(entry.get("id")) and is_text(entry.get("name"))):
                raise InputError(f"{where}: params[{position}] needs an integer 'id' and a string 'name'")
    if not params:
        del document["params"]
    return document


_TABLE_START = b',"param_columns":'  # a JSON string cannot hold ," unescaped: the first one is the key
HEADER_BYTES = 1 << 16  # a version 2 map's keys before its table fit in these bytes (a rank object, counts)


def _header(head: bytes, where: str) -> Optional[Dict[str, Any]]:
    """The keys a version 2 map writes before its table (rank, params_count, ...), parsed from the file's
    first bytes without the table; None where they are not laid out so (version 1, or written by other
    means), or not within ``HEADER_BYTES``."""
    cut = head.find(_TABLE_START)
    if cut < 0:
        return None
    try:
        text = head[:cut].decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text") from None
    header = SCHEMA.check(parse_json(text + "}", where), where)
    if (header["version"] < 2 or not is_int(header.get("params_count"))
            or not isinstance(header.get("rank"), dict)):
        return None
    check_rank(header["rank"], where)
    return header


FIRST_BYTES = 1 << 12  # a header as gradnan writes it (a rank object, counts, the columns) fits in these


def _head(path: FilePath) -> bytes:
    """The file's first bytes up to its table's rows: ``FIRST_BYTES`` where those hold the header and the
    columns (16,000 maps of 50 KB read 4 KB each), else ``HEADER_BYTES``."""
    head = read_prefix(path, FIRST_BYTES)
    if len(head) < FIRST_BYTES or _ROWS_START.encode() in head:
        return head
    return read_prefix(path, HEADER_BYTES)


def load(path: FilePath, params: bool = True) -> Dict[str, Any]:
    """``params=False``: the map without its parameters, for a reader of thousands of maps that needs
    each rank's coordinates and ``params_count`` (a version 2 map's table is not even read)."""
    header = None if params else _header(_head(path), str(path))
    if header is not None:
        return header
    text = read_text(path)
    return from_json(SCHEMA.check(parse_json(text, str(path)), str(path)), str(path), params)


_ROWS_START = ',"params":['  # after the header and its columns; cannot occur inside a JSON string
CHUNK_BYTES = 1 << 20
MAX_ROW_CHARS = 1 << 20  # a row longer than this is no parameter gradnan wrote
_SPACE = re.compile(r"[ \t\n\r]*")


class _Rows:
    """The rows of a version 2 map's table, decoded one at a time from a file read in chunks: a map of a
    million parameters in the memory of one chunk."""

    def __init__(self, stream: BinaryIO, where: str) -> None:
        self._stream, self._where = stream, where
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._text, self._at, self._ended = "", 0, False
        self._json = json.JSONDecoder()

    def _more(self) -> bool:
        """Read the next chunk behind what is left; False at the end of the file."""
        if self._ended:
            return False
        data = self._stream.read(CHUNK_BYTES)
        self._ended = not data
        try:
            self._text = self._text[self._at:] + self._utf8.decode(data, final=self._ended)
        except UnicodeDecodeError:
            raise InputError(f"{self._where}: not UTF-8 text") from None
        self._at = 0
        return not self._ended

    def _next_char(self) -> str:
        """The next character that is not white space ('' at the end of the file), not consumed."""
        while True:
            space = _SPACE.match(self._text, self._at)
            assert space is not None  # white space or none: the pattern matches everywhere
            self._at = space.end()
            if self._at < len(self._text) or not self._more():
                return self._text[self._at:self._at + 1]

    def _value(self) -> Any:
        while True:
            try:
                value, end = self._json.raw_decode(self._text, self._at)
                self._at = end
                return value
            except RecursionError:
                raise InputError(f"{self._where}: invalid JSON (nested too deeply)") from None
            except ValueError:
                if len(self._text) - self._at > MAX_ROW_CHARS or not self._more():
                    raise InputError(f"{self._where}: invalid JSON in the 'params' table") from None

    def __iter__(self) -> Iterator[Any]:
        if self._next_char() == "]":
            self._at += 1
        else:
            while True:
                yield self._value()
                separator = self._next_char()
                self._at += 1
                if separator == "]":
                    break
                if separator != ",":
                    raise InputError(f"{self._where}: invalid JSON in the 'params' table")
        closed = self._next_char() == "}"
        self._at += 1
        if not closed or self._next_char():
            raise InputError(f"{self._where}: invalid JSON after the 'params' table")


def stream_params(path: Path, wanted: Callable[[Dict[str, Any]], bool]
                  ) -> Optional[Tuple[Dict[str, Any], Iterator[Dict[str, Any]]]]:
    """The map's header (as ``load(path, params=False)``) and an iterator over its parameters as objects,
    each checked as it is read (InputError at the first that is not usable); None where ``wanted(header)``
    is False, and then no parameter is read at all (``gradnan maps --rank 3`` of 16,000 maps). A version 2
    map as gradnan writes it is read in chunks (``_Rows``), another is loaded whole."""
    where = str(path)
    head = _head(path)
    header = _header(head, where)
    if header is None:
        document = load(path)
        return (document, iter(document.pop("params"))) if wanted(document) else None
    if not wanted(header):
        return None
    text = head.decode("utf-8", errors="ignore")  # the header's end decodes; a cut character is read again
    cut, start = text.find(_TABLE_START.decode()), text.find(_ROWS_START)
    if start < 0:  # the columns do not fit in the first bytes: no map gradnan wrote, read it whole
        return header, iter(load(path)["params"])
    columns = _checked_columns(parse_json("{" + text[cut + 1:start] + ',"params":[]}', where), where)
    return header, _table(path, len(text[:start + len(_ROWS_START)].encode("utf-8")), columns, where)


def _table(path: Path, offset: int, columns: List[str], where: str) -> Iterator[Dict[str, Any]]:
    """The rows from ``offset`` (just past ``"params":[``), as objects, checked one by one."""
    id_at, name_at = columns.index("id"), columns.index("name")
    with open_regular(path) as stream:
        stream.seek(offset)
        for position, row in enumerate(_Rows(stream, where)):
            if not (isinstance(row, list) and len(row) == len(columns) and is_int(row[id_at])
                    and is_text(row[name_at])):
                raise InputError(f"{where}: params[{position}] needs one value per column ({len(columns)}),"
                                 " an integer 'id' and a string 'name'")
            yield dict(zip(columns, row))


def write(path: Path, document: Mapping[str, Any], replace: bool = True, root: Optional[Path] = None) -> None:
    """Atomically, without indentation (a map can hold 50,000 parameters). ``replace=False``: never over an
    existing file (another launch's map): FileExistsError instead. ``root``: the out dir, below which no
    link is followed (``write_json_atomic``)."""
    write_json_atomic(path, document, indent=None, replace=replace, root=root)
