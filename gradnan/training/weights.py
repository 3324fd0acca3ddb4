"""The weights and the optimizer state as the failing step found them (pure: tensors in, a ``state``
record's fields out). Read once, at a run's first incident, before the optimizer applies anything: what
decides whether the value was born in the weights (a corrupted checkpoint, a bad write, one replica's copy
gone bad) or in the previous update (a corrupted optimizer moment), rather than in the step itself. Never
read on a healthy step.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..events import ParamTensors, StepState
from ..formats.maps import ParamSlot
from ..formats.schema import json_float
from .offenders import offending_params
from .scan import find_nonfinite, integer_view, unravel

MAX_STATE_ENTRIES = 32  # optimizer-state findings a record lists (all are counted)


@torch.no_grad()
def nonfinite_weights(state: StepState, ids_by_name: Mapping[str, int]) -> List[Dict[str, Any]]:
    """Every model parameter (``copy`` "model"), and every separate copy the optimizer steps ("main"), that
    holds a NaN or an Inf, as a record's params (element indices in the model parameter; ``id``: the
    parameter's in this rank's map, where it has one)."""
    found = []
    for position, located in find_nonfinite([tensor for _, tensor in state.weights]):
        name, tensor = state.weights[position]
        found.append({"id": ids_by_name.get(name), "name": name, "copy": "model", "kind": located.kind,
                      "nan": located.nan, "inf": located.inf, "first_bad_flat": located.first_bad,
                      "first_bad_index": unravel(located.first_bad, tensor.shape),
                      "abs_max_finite": json_float(located.abs_max_finite), "numel": tensor.numel()})
    found += [{**entry, "copy": "main"}
              for entry in offending_params(state.slots, [held.main for held in state.stepped])]
    return found


def _must_not_be_negative(state_name: str) -> bool:
    """Adam's second moment (``exp_avg_sq``, ``max_exp_avg_sq``) is a running mean of squares."""
    return state_name.endswith("_sq")


@torch.no_grad()
def optimizer_state_faults(slots: Sequence[ParamSlot],
                           stepped: Sequence[ParamTensors]) -> List[Dict[str, Any]]:
    """Each optimizer-state tensor that holds a NaN or an Inf, or a second moment below zero (from which
    the update's square root is NaN): ``name`` (the parameter), ``state``, ``nan``, ``inf``, ``negative``.
    The scan's own host reads (``find_nonfinite``) and one for the signs."""
    entries = [(position, name, value) for position, held in enumerate(stepped)
               for name, value in sorted(held.state.items())]
    bad = dict(find_nonfinite([value for _, _, value in entries]))
    squares = [index for index, (_, name, _) in enumerate(entries) if _must_not_be_negative(name)]
    negatives = (torch.stack([(entries[i][2] < 0).sum() for i in squares]).tolist() if squares else [])
    negative_at = {index: int(count) for index, count in zip(squares, negatives) if count}
    faults = []
    for index in sorted(set(bad) | set(negative_at)):
        position, name, _ = entries[index]
        found = bad.get(index)
        faults.append({"id": slots[position].id, "name": slots[position].name, "state": name,
                       "nan": found.nan if found else 0, "inf": found.inf if found else 0,
                       "negative": negative_at.get(index, 0)})
    return faults


@torch.no_grad()
def weights_digest(weights: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """A digest of every model parameter's bits, by name (the integer sum of each one's bit patterns, exact
    and the same in any reduction order, hashed together): data-parallel replicas, which hold bitwise equal
    weights, have equal digests. One host read."""
    named = sorted((name, tensor) for name, tensor in weights if tensor.numel())
    sums = [torch.sum(integer_view(tensor), dtype=torch.int64) for _, tensor in named]
    digest = hashlib.sha256()
    for (name, _), value in zip(named, torch.stack(sums).tolist() if sums else []):
        digest.update(name.encode())
        digest.update(int(value).to_bytes(8, "little", signed=True))
    return digest.hexdigest()[:16]


@torch.no_grad()
def finite_flag(weights: Sequence[Tuple[str, torch.Tensor]]) -> Optional[torch.Tensor]:
    """Whether every weight is finite, as one device flag, never read here (no host sync): each tensor's
    largest magnitude (a fused infinity norm: NaN and Inf carry through, a finite tensor's stays finite)."""
    present = [tensor.detach() for _, tensor in weights if tensor.numel()]
    if not present:
        return None
    largest = torch._foreach_norm(present, math.inf)
    return torch.isfinite(torch.stack([norm.float() for norm in largest])).all()


def state_fields(state: StepState, ids_by_name: Mapping[str, int],
                 at_launch: Optional[torch.Tensor]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """A ``state`` record's offending params (the non-finite weights) and its other fields;
    ``at_launch``: ``finite_flag`` of the weights at the launch's first step (None: not taken)."""
    faults = optimizer_state_faults(state.slots, state.stepped)
    return nonfinite_weights(state, ids_by_name), {
        "launch_weights_finite": None if at_launch is None else bool(at_launch),
        "weights_digest": weights_digest(state.weights), "params_checked": len(state.weights),
        "optimizer_state": faults[:MAX_STATE_ENTRIES], "optimizer_state_total": len(faults),
        "optimizer_state_checked": sum(len(held.state) for held in state.stepped)}
