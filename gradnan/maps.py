"""The per-rank parameter map: optimizer parameter id -> global parameter name and its facts."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .records import MAP_SCHEMA, SCHEMA_VERSION


@dataclass(frozen=True)
class ParamSlot:
    """One parameter as the optimizer steps it.

    ``id`` is its position in the optimizer's parameters (``get_parameters()``, concatenated over a
    ``ChainedOptimizer``'s sub-optimizers): the id a record reports. ``shape``/``dtype``/``numel`` are the
    model parameter's. ``shard`` is the ``[start, end)`` slice of the flattened model parameter this rank
    steps (distributed optimizer), else None.
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

    def to_json(self) -> Dict[str, Any]:
        document = asdict(self)
        document["shape"] = list(self.shape)
        document["shard"] = list(self.shard) if self.shard is not None else None
        return document


def map_document(
    coords: Mapping[str, Any],
    versions: Mapping[str, Any],
    optimizer_index: int,
    optimizer_class: str,
    slots: Sequence[ParamSlot],
) -> Dict[str, Any]:
    return {
        "schema": MAP_SCHEMA,
        "version": SCHEMA_VERSION,
        "written_at": time.time(),
        "rank": dict(coords),
        "versions": dict(versions),
        "optimizer_index": optimizer_index,
        "optimizer_class": optimizer_class,
        "params": [slot.to_json() for slot in slots],
    }


def names_by_id(document: Mapping[str, Any]) -> Dict[int, str]:
    return {int(entry["id"]): entry["name"] for entry in document["params"]}


def slot_for_id(slots: Sequence[ParamSlot], param_id: int) -> Optional[ParamSlot]:
    return next((slot for slot in slots if slot.id == param_id), None)


def slots_summary(slots: List[ParamSlot]) -> str:
    return f"{len(slots)} parameters, {sum(slot.numel for slot in slots)} elements"
