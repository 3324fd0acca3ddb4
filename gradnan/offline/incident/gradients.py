"""The failing step's gradients, rank by rank (pure: records in): each rank's view and its offending
parameters in backward order, the pattern of the origin's gradients (the forward or the backward pass),
and the settings that capture the implicated module on a rerun from a checkpoint. Which ranks are the
origin is decided by ``decision.origin``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...formats.incident import GradientPass
from ...formats.layout import shown_axes
from ...formats.records import FORWARD_SHARE
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
                                               "abs_max_finite", "near_limit", "order", "copy",
                                               "vocab_rows")},
            "dtype": dtype}


def rank_entry(record: Dict[str, Any], dtypes: Dict[Tuple[Any, str], str]) -> View:
    params = sorted(record["params"], key=lambda p: backward_key(record["rank"], p))
    rank = record["rank"].get("global_rank")
    entry = {**rank_view(record["rank"]), "kind": record["kind"],
             "params_total": record.get("params_total", len(params)),
             "params": [_param_view(p, dtypes.get((rank, p["name"]))) for p in params]}
    if record.get("largest_grad"):
        entry["largest_grad"] = record["largest_grad"]
    for key in ("optimizer_state", "outlying_rows"):
        if record.get(key):
            entry[key] = record[key]
    return entry


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


def capture_settings(pattern: Pattern, origin: Sequence[View], step: int,
                     iteration: Optional[int]) -> Optional[Dict[str, str]]:
    """The GRADNAN_CAPTURE_* settings that capture the failing step's implicated module on the origin
    ranks when the job is rerun from a checkpoint (step filters use Megatron-LM's iteration where its
    loop ran, else steps count from the launch that is rerun)."""
    if not pattern.first_in_backward or not origin:
        return None
    return {"GRADNAN_CAPTURE_MODULES": module_of(pattern.first_in_backward),
            "GRADNAN_CAPTURE_STEPS": str(iteration if isinstance(iteration, int) else step),
            "GRADNAN_CAPTURE_RANKS": capture_ranks([e["global_rank"] for e in origin])}


MAX_RANK_RUNS = 8  # runs of consecutive ranks one capture setting names; more: the span of them all


def capture_ranks(ranks: Sequence[int]) -> str:
    """``GRADNAN_CAPTURE_RANKS`` for ``ranks`` in the option's syntax (``0,4-7``): each run of three or more
    consecutive ranks as a range; more than ``MAX_RANK_RUNS`` runs (20,000 scattered origin ranks), the
    span from the first to the last, a capture on a few more ranks in a setting of one line."""
    runs: List[List[int]] = []  # [first, last] of each run
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    if len(runs) > MAX_RANK_RUNS:
        return f"{runs[0][0]}-{runs[-1][1]}"
    return ",".join(f"{first}-{last}" if last - first >= 2 else ",".join(map(str, range(first, last + 1)))
                    for first, last in runs)
