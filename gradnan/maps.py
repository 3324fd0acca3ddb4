"""The per-rank parameter map: optimizer parameter id -> global parameter name and its facts."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .records import MAP_SCHEMA, SCHEMA_VERSION


@dataclass(frozen=True)
class ParamSlot:
    """One parameter as the optimizer steps it.

    ``id`` is its position in the optimizer's parameters (``get_parameters()``, concatenated over a
    ``ChainedOptimizer``'s sub-optimizers): the id a record reports. ``order`` is its position in the
    model's parameter registration (forward) order on this rank; backward order is the reverse. ``shape``/``dtype``/``numel`` are the
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
    order: int = -1

    def to_json(self) -> Dict[str, Any]:
        document = asdict(self)
        document["shape"] = list(self.shape)
        document["shard"] = list(self.shard) if self.shard is not None else None
        return document


def map_document(
    coords: Mapping[str, Any],
    versions: Mapping[str, Any],
    run: Mapping[str, Any],
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
        "run": dict(run),
        "optimizer_index": optimizer_index,
        "optimizer_class": optimizer_class,
        "params": [slot.to_json() for slot in slots],
    }

