"""The weights and the optimizer state as the failing step found them (pure: tensors in, a ``state``
record's fields out). Read once, at a run's first incident, before the optimizer applies anything: what
decides whether the value was born in the weights (a corrupted checkpoint, a bad write, one replica's copy
gone bad) or in the previous update (a corrupted optimizer moment), rather than in the step itself. Never
read on a healthy step.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ..events import ParamTensors, StepState
from ..formats.layout import ROW_OUTLIER, VOCABULARY_ROWS
from ..formats.maps import ParamSlot
from ..formats.schema import json_float
from .offenders import offending_params, vocabulary_rows
from .scan import SCANNED_DTYPES, find_nonfinite, integer_view, nonfinite_indices, unravel

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
                      "abs_max_finite": json_float(located.abs_max_finite), "numel": tensor.numel(),
                      **vocabulary_rows(name, tensor.shape)})
    found += [{**entry, "copy": "main"}
              for entry in offending_params(state.slots, [held.main for held in state.stepped])]
    return found


def bad_stepped_copies(state: StepState, bad_weights: Sequence[Mapping[str, Any]]) -> Set[int]:
    """The positions in ``state.stepped`` whose stepped copy (the main copy, else the model parameter) is
    among ``bad_weights`` (``nonfinite_weights``)."""
    main_ids = {entry["id"] for entry in bad_weights if entry["copy"] == "main"}
    model_names = {entry["name"] for entry in bad_weights if entry["copy"] == "model"}
    return {position for position, (slot, held) in enumerate(zip(state.slots, state.stepped))
            if (slot.id in main_ids if held.main is not None else slot.name in model_names)}


def _must_not_be_negative(state_name: str) -> bool:
    """Adam's second moment (``exp_avg_sq``, ``max_exp_avg_sq``) is a running mean of squares."""
    return state_name.endswith("_sq")


@torch.no_grad()
def optimizer_state_faults(slots: Sequence[ParamSlot], stepped: Sequence[ParamTensors],
                           bad_copies: Set[int]) -> List[Dict[str, Any]]:
    """Each optimizer-state tensor that holds a NaN or an Inf, or a second moment below zero (from which
    the update's square root is NaN): ``name`` (the parameter), ``state``, ``nan``, ``inf``, ``negative``.
    Signs are read only for the parameters at ``bad_copies`` (positions in ``stepped`` whose stepped copy
    is non-finite): a negative moment explains a non-finite weight through the update, and anywhere else
    it has made nothing non-finite yet. The scan's own host reads (``find_nonfinite``), and one for the
    signs where there are any to read."""
    entries = [(position, name, value) for position, held in enumerate(stepped)
               for name, value in sorted(held.state.items())]
    bad = dict(find_nonfinite([value for _, _, value in entries]))
    squares = [index for index, (position, name, _) in enumerate(entries)
               if position in bad_copies and _must_not_be_negative(name)]
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


DIGEST_CHUNK_ELEMENTS = 1 << 24  # weights copied together to be summed at once (at most 64 MiB in fp32)


def _digest_chunks(tensors: Sequence[torch.Tensor]) -> Iterator[List[torch.Tensor]]:
    """The tensors (of one dtype and device, in order) in runs of at most ``DIGEST_CHUNK_ELEMENTS``
    elements; a larger tensor alone."""
    run: List[torch.Tensor] = []
    filled = 0
    for tensor in tensors:
        if run and filled + tensor.numel() > DIGEST_CHUNK_ELEMENTS:
            yield run
            run, filled = [], 0
        run.append(tensor)
        filled += tensor.numel()
    if run:
        yield run


def bit_sum(chunk: List[torch.Tensor]) -> torch.Tensor:
    """The integer sum of the chunk's bit patterns (int64): one tensor summed where it is, several copied
    back to back first (``torch._chunk_cat``: one kernel, not one per tensor)."""
    if len(chunk) == 1:
        return torch.sum(integer_view(chunk[0]), dtype=torch.int64)
    flat = torch._chunk_cat([tensor if tensor.ndim else tensor.reshape(1) for tensor in chunk], 0, 1)
    return torch.sum(integer_view(flat), dtype=torch.int64)


@torch.no_grad()
def weights_digest(weights: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """A digest of every model parameter's bits (the integer sums of their bit patterns, exact and the same
    in any reduction order, hashed with the parameters' names): data-parallel replicas, which hold bitwise
    equal weights, have equal digests, and one flipped bit changes it. Parameters by name, summed in runs
    of one dtype (``_digest_chunks``): a few kernels for thousands of tensors. One host read per dtype."""
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    named = sorted(((name, tensor) for name, tensor in weights
                    if tensor.numel() and tensor.dtype in SCANNED_DTYPES), key=lambda item: item[0])
    for _, tensor in named:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    digest = hashlib.sha256()
    for name, _ in named:
        digest.update(name.encode() + b"\0")
    for key in sorted(groups, key=str):  # one read per dtype and device
        for value in torch.stack([bit_sum(chunk) for chunk in _digest_chunks(groups[key])]).tolist():
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


MAX_ROWS = 8  # rows a record lists (all are counted)


@torch.no_grad()
def outlying_rows(weights: Sequence[Tuple[str, torch.Tensor]]) -> List[Dict[str, Any]]:
    """The rows of the vocabulary's weights (the word embedding, the output layer: row r is this rank's
    vocabulary shard's token r) that are non-finite or whose largest magnitude is ``ROW_OUTLIER`` times the
    median row's: a row set to 1e30 (a bad write, a corrupted checkpoint) overflows wherever its token is
    read, or, through a tied output layer, in every step, every other weight finite. ``rows``: the shard's
    row count (the token is ``tp * rows + row``); ``every_step``: every forward pass reads the row (the
    output layer's, or an embedding this rank holds no separate output layer beside: tied to it). One
    reduction per row and one host read per weight."""
    found: List[Dict[str, Any]] = []
    untied = any(name == "output_layer.weight" for name, _ in weights)
    for name, tensor in weights:
        if name not in VOCABULARY_ROWS or tensor.ndim != 2 or not tensor.shape[0]:
            continue
        largest = torch.linalg.vector_norm(tensor.detach().float(), math.inf, dim=1)
        median = largest.nanmedian()
        outlying = (~torch.isfinite(largest)) | ((largest > ROW_OUTLIER * median) & (median > 0))
        rows = torch.nonzero(outlying).flatten()[:MAX_ROWS]
        values = largest[rows].tolist()
        found += [{"name": name, "rows": tensor.shape[0], "row": int(row), "largest": json_float(value),
                   "median": json_float(float(median)),
                   "every_step": name == "output_layer.weight" or not untied}
                  for row, value in zip(rows.tolist(), values)]
    return found[:MAX_ROWS]


def state_fields(state: StepState, ids_by_name: Mapping[str, int],
                 at_launch: Optional[torch.Tensor]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """A ``state`` record's offending params (the non-finite weights) and its other fields;
    ``at_launch``: ``finite_flag`` of the weights at the launch's first step (None: not taken)."""
    bad_weights = nonfinite_weights(state, ids_by_name)
    faults = optimizer_state_faults(state.slots, state.stepped, bad_stepped_copies(state, bad_weights))
    return bad_weights, {
        "launch_weights_finite": None if at_launch is None else bool(at_launch),
        "weights_digest": weights_digest(state.weights), "params_checked": len(state.weights),
        "outlying_rows": outlying_rows(state.weights),
        "optimizer_state": faults[:MAX_STATE_ENTRIES], "optimizer_state_total": len(faults),
        "optimizer_state_checked": sum(len(held.state) for held in state.stepped)}


MAX_MARK_ENTRIES = 32  # non-finite tensors a checkpoint mark lists (all are counted)


def _saved_tensors(state: StepState) -> List[Tuple[str, str, torch.Tensor]]:
    """What a checkpoint saves of this rank, as (what, parameter name, tensor): every model parameter
    ("weight"), each separate copy the optimizer steps ("main") and each of its state tensors by its own
    name ("exp_avg", "exp_avg_sq"); non-empty, of a dtype whose NaN and Inf the scan sees."""
    listed = [("weight", name, tensor) for name, tensor in state.weights]
    for slot, held in zip(state.slots, state.stepped):
        if held.main is not None:
            listed.append(("main", slot.name, held.main))
        listed += [(key, slot.name, value) for key, value in sorted(held.state.items())]
    return [(what, name, tensor) for what, name, tensor in listed
            if tensor.numel() and tensor.dtype in SCANNED_DTYPES]


@torch.no_grad()
def checkpoint_mark(state: StepState) -> Dict[str, Any]:
    """A ``checkpoint`` record's fields for a save of this rank's ``state``: ``clean`` where every weight,
    main copy and optimizer moment is finite, the non-finite ones listed, the vocabulary's rows far out of
    range (``outlying_rows``: a token's row at 1e30 is finite, and fails wherever it is read), the second
    moments below zero (``negative_moments``: finite, and the next update's square root of one is NaN), and
    ``weights_digest``. The
    scan's first level (``nonfinite_indices``: fused largest magnitudes, NaN and Inf carried through, one
    host read) and the digest's one read per dtype: at a save, which copies every tensor anyway, never on
    a training step."""
    saved = _saved_tensors(state)
    bad = [{"name": saved[index][1], "tensor": saved[index][0]}
           for index in nonfinite_indices([tensor for _, _, tensor in saved])]
    kinds = [what if what in ("weight", "main") else "moment" for what, _, _ in saved]
    checked = {key: kinds.count(key) for key in ("weight", "main", "moment")}
    second = [(name, tensor) for what, name, tensor in saved if what == "exp_avg_sq"]
    lowest = torch.stack([tensor.detach().min().float() for _, tensor in second]).tolist() if second else []
    negative = [{"name": name, "tensor": "exp_avg_sq"} for (name, _), low in zip(second, lowest) if low < 0]
    return {"negative_moments": negative[:MAX_MARK_ENTRIES], "negative_total": len(negative),
            "clean": not bad, "nonfinite": bad[:MAX_MARK_ENTRIES], "nonfinite_total": len(bad),
            "checked": checked, "weights_digest": weights_digest(state.weights),
            "outlying_rows": outlying_rows(state.weights)}
