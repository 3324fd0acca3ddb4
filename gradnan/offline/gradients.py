"""The failing step's gradients, rank by rank (pure: records in): each rank's view and its offending
parameters in backward order, the origin the gradients' records point at and what it rests on, and the
pattern of the origin's gradients (the forward or the backward pass).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..formats.incident import NORM_KINDS, GradientPass, OriginBasis, RecordKind
from ..formats.layout import shown_axes
from ..formats.records import FORWARD_SHARE
from .verdict import Pattern, View


def rank_view(coords: Dict[str, Any]) -> View:
    view = {"global_rank": coords.get("global_rank"), "host": coords.get("host"),
            "device": coords.get("device")}
    for axis in shown_axes(coords):
        view[axis] = coords.get(axis)
    view["dp_size"] = coords.get("dp_size")
    return view


def module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def backward_key(rank: Dict[str, Any], param: Dict[str, Any]):
    """Later pipeline stages and later-registered parameters come first in backward."""
    order = param.get("order")
    return (-(rank.get("pp") or 0), -(order if isinstance(order, int) else -1))


def _param_view(param: Dict[str, Any], dtype: Optional[str]) -> Dict[str, Any]:
    return {**{key: param.get(key) for key in ("id", "name", "kind", "nan", "inf", "first_bad_index",
                                               "abs_max_finite", "near_limit", "order", "copy")},
            "dtype": dtype}


def rank_entry(record: Dict[str, Any], dtypes: Dict[Tuple[Any, str], str]) -> View:
    params = sorted(record["params"], key=lambda p: backward_key(record["rank"], p))
    rank = record["rank"].get("global_rank")
    entry = {**rank_view(record["rank"]), "kind": record["kind"],
             "params_total": record.get("params_total", len(params)),
             "params": [_param_view(p, dtypes.get((rank, p["name"]))) for p in params]}
    if record.get("largest_grad"):
        entry["largest_grad"] = record["largest_grad"]
    if record.get("optimizer_state"):
        entry["optimizer_state"] = record["optimizer_state"]
    return entry


def _per_rank(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per rank: a rank writes one pre-reduction record per bad bucket group."""
    merged: Dict[Any, Dict[str, Any]] = {}
    for record in records:
        rank = record["rank"].get("global_rank")
        if rank not in merged:
            merged[rank] = {**record, "params": list(record["params"]),
                            "params_total": record.get("params_total", len(record["params"]))}
        else:
            merged[rank]["params"] += record["params"]
            merged[rank]["params_total"] += record.get("params_total", len(record["params"]))
    return list(merged.values())


def gradient_origin_of(at_step: List[Dict[str, Any]]) -> Tuple[OriginBasis, List[Dict[str, Any]]]:
    """The origin as the gradients' records show it, and what it rests on."""
    pre = [r for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r["params"]]
    norm = [r for r in at_step if r["kind"] in NORM_KINDS]
    holders = [r for r in norm if r["params"]]
    checked = [r for r in norm if r.get("pre_reduction") in ("clean", "nonfinite", "overflow")]
    if pre:
        return OriginBasis.BEFORE_COLLECTIVE, _per_rank(pre)
    if holders and checked:
        return OriginBasis.AFTER_COLLECTIVE, holders
    if holders:
        return OriginBasis.UNCONFIRMED, holders
    overflow = norm_overflow_origin(at_step)
    return (OriginBasis.NORM_OVERFLOW, overflow) if overflow else (OriginBasis.NONE, [])


def _magnitude(record: Dict[str, Any]) -> float:
    value = record["largest_grad"]["value"]
    return abs(value) if isinstance(value, (int, float)) else float("inf")


def norm_overflow_origin(at_step: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Where no rank held a non-finite gradient: the records of the ranks that held the largest finite
    gradient, whose square overflowed the grad norm. Best evidence first: pre-reduction records of a norm
    overflow (their own gradients before the data-parallel collective, where a replica that only received
    the value through it does not appear); else the grad-norm records whose own float32 sum of squares
    overflowed, the largest of them; else the largest. Empty when no record names a largest gradient."""
    before = [r for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r.get("norm_overflow")]
    if before:
        return _per_rank(before)
    named = [r for r in at_step if r["kind"] == RecordKind.NONFINITE_GRAD_NORM and r.get("largest_grad")]
    candidates = [r for r in named if r["largest_grad"]["overflows"]] or named
    if not candidates:
        return []
    top = max(_magnitude(r) for r in candidates)
    return [r for r in candidates if _magnitude(r) == top]


def pattern_of(origin: Sequence[View], params_per_rank: Dict[int, int]) -> Pattern:
    """Forward: (nearly) every gradient on the origin rank is bad, so the loss or an activation already
    was. Backward: only some are; the first in backward order is where it started."""
    # a distributed optimizer's map lists the parameters of its shard, a record every one it checked
    shares = [min(1.0, entry["params_total"] / params_per_rank[entry["global_rank"]])
              for entry in origin if params_per_rank.get(entry["global_rank"])]
    if shares and min(shares) >= FORWARD_SHARE:
        return Pattern(GradientPass.FORWARD, min(shares), None, None)
    firsts = [(backward_key(entry, entry["params"][0]), entry["params"][0]["name"], entry["global_rank"])
              for entry in origin if entry["params"]]
    _, first, first_rank = min(firsts) if firsts else (None, None, None)
    return Pattern(GradientPass.BACKWARD if shares else GradientPass.UNKNOWN,
                   min(shares) if shares else None, first, first_rank)
