"""Turn optimizer-side gradients into per-parameter findings (pure: tensors in, dicts out)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..formats.maps import ParamSlot
from ..formats.records import DTYPE_MAX
from ..formats.schema import json_float
from .scan import find_nonfinite, unravel


def backward_position(slot: ParamSlot) -> tuple:
    """Sort key: the parameter whose gradient backward computes first comes first (highest registration
    ``order``; a parameter not found in the model, order -1, last; ties in optimizer order)."""
    return (slot.order < 0, -slot.order, slot.id)


def offending_params(
    slots: Sequence[ParamSlot], grads: Sequence[Optional[torch.Tensor]]
) -> List[Dict[str, Any]]:
    """One entry per parameter whose gradient holds a NaN or Inf, in backward order (``backward_position``),
    so a record capped at ``max_params_per_record`` keeps the first to go bad in backward, not the first
    in the optimizer's order.

    Element indices are in the model parameter (a distributed-optimizer shard's offset is added).
    ``near_limit`` says the largest finite gradient value is within 2x of the model dtype's maximum:
    a hint that the non-finite values come from overflow.
    """
    offending = []
    found_at = sorted(find_nonfinite(grads), key=lambda item: backward_position(slots[item[0]]))
    for position, found in found_at:
        slot = slots[position]
        flat_index = found.first_bad + (slot.shard[0] if slot.shard else 0)
        dtype_max = DTYPE_MAX.get(slot.dtype)
        offending.append(
            {
                "id": slot.id,
                "name": slot.name,
                "kind": found.kind,
                "nan": found.nan,
                "inf": found.inf,
                "pos_inf": found.pos_inf,
                "neg_inf": found.neg_inf,
                "first_bad_flat": flat_index,
                "first_bad_index": unravel(flat_index, slot.shape),
                "abs_max_finite": json_float(found.abs_max_finite),
                "near_limit": bool(dtype_max and found.abs_max_finite * 2 >= dtype_max),
                "numel": slot.numel,
                "shard": list(slot.shard) if slot.shard else None,
                "is_expert": slot.is_expert,
                "order": slot.order,
            }
        )
    return offending
