"""Turn optimizer-side gradients into per-parameter findings (pure: tensors in, dicts out)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..formats.layout import VOCABULARY_ROWS
from ..formats.maps import ParamSlot
from ..formats.records import DTYPE_MAX
from ..formats.schema import json_float
from .scan import find_nonfinite, unravel


def vocabulary_rows(name: str, shape: Sequence[int]) -> Dict[str, int]:
    """``{"vocab_rows": rows}`` for a weight with a row per token (this rank's shard of the vocabulary: the
    report names the token an element is in), else nothing."""
    return {"vocab_rows": int(shape[0])} if name in VOCABULARY_ROWS and len(shape) == 2 else {}


@torch.no_grad()
def largest_gradient(slots: Sequence[ParamSlot],
                     grads: Sequence[Optional[torch.Tensor]]) -> Optional[Dict[str, Any]]:
    """The largest-magnitude gradient element of a rank whose gradients are all finite, as a record's
    ``largest_grad``: parameter, element (in the model parameter: a shard's offset added) and signed value;
    ``overflows`` says the rank's own sum of squares overflows float32 the way Megatron computes the grad
    norm (a float32 norm per tensor, squared and summed). Read on the failing path only: one host read.
    None without a gradient."""
    present = [(position, grad.detach().reshape(-1)) for position, grad in enumerate(grads)
               if grad is not None and grad.numel()]
    if not present:
        return None
    norms = torch.stack([torch.linalg.vector_norm(flat, dtype=torch.float32) for _, flat in present])
    where = torch.stack([flat.abs().argmax() for _, flat in present])
    found = torch.stack([flat[index].to(torch.float64) for (_, flat), index in zip(present, where)])
    read = torch.cat([(norms ** 2).sum().to(torch.float64).reshape(1), found.cpu(),
                      where.to(torch.float64).cpu()]).tolist()
    square_sum, values, flats = read[0], read[1:len(present) + 1], read[len(present) + 1:]
    best = max(range(len(present)), key=lambda i: abs(values[i]))
    slot = slots[present[best][0]]
    flat_index = int(flats[best]) + (slot.shard[0] if slot.shard else 0)
    return {"id": slot.id, "name": slot.name, "flat": flat_index, "index": unravel(flat_index, slot.shape),
            "value": json_float(values[best]), "overflows": not math.isfinite(square_sum)}


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
                **vocabulary_rows(slot.name, slot.shape),
            }
        )
    return offending
