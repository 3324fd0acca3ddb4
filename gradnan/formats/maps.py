"""The per-rank parameter map (``gradnan.map``): optimizer parameter id -> global name and its facts."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..errors import InputError
from .schema import Schema, check_rank, is_int, is_text, read_document

SCHEMA = Schema("gradnan.map", 1)


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

    def to_json(self) -> Dict[str, Any]:
        document = asdict(self)
        document["shape"] = list(self.shape)
        document["shard"] = list(self.shard) if self.shard is not None else None
        return document


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
        "params": [slot.to_json() for slot in slots],
    }


def from_json(document: Any, where: str) -> Dict[str, Any]:
    """A map document, checked: InputError (one line) for anything a reader could not use."""
    document = SCHEMA.check(document, where)
    params, rank = document.get("params"), document.get("rank")
    if not isinstance(params, list) or not isinstance(rank, dict):
        raise InputError(f"{where}: a map needs a 'params' list and a 'rank' object")
    for position, entry in enumerate(params):
        if not (isinstance(entry, dict) and is_int(entry.get("id")) and is_text(entry.get("name"))):
            raise InputError(f"{where}: params[{position}] needs an integer 'id' and a string 'name'")
    check_rank(rank, where)
    return document


def load(path: Path) -> Dict[str, Any]:
    return from_json(read_document(path, SCHEMA), str(path))
