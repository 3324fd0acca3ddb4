"""The communication checks: every rank all-reduces known values in the world group and, with a layout,
in its tp, pp and dp groups, on the backend under test. A wrong slot of the sum names the rank whose
contribution was lost or changed."""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .wording import dtype_name, first_line, shortened

COMMUNICATION_DTYPES = (torch.int64, torch.float32, torch.bfloat16)


def layout_groups(world_size: int, tp: int, pp: int) -> Dict[str, List[List[int]]]:
    """The tp, pp and dp groups of Megatron's default rank order (tp fastest, then dp, then pp)."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"tp {tp} x pp {pp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp)
    stage = tp * dp
    return {
        "tp": [list(range(start, start + tp)) for start in range(0, world_size, tp)],
        "pp": [list(range(first, world_size, stage)) for first in range(stage)],
        "dp": [list(range(p * stage + t, (p + 1) * stage, tp)) for p in range(pp) for t in range(tp)],
    }


def allreduce_input(members: Sequence[int], rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros except this rank's own slot, which holds rank+1 (+0.5 for floats): the sum is fully known and
    a wrong slot names the rank whose contribution was lost or changed."""
    contribution = torch.zeros(len(members), dtype=dtype)
    contribution[members.index(rank)] = _known_value(rank, dtype)
    return contribution


def allreduce_expected(members: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([_known_value(member, dtype) for member in members], dtype=dtype)


def _known_value(rank: int, dtype: torch.dtype) -> float:
    return rank + 1 if not dtype.is_floating_point else rank + 1.5


def allreduce_mismatch(received: torch.Tensor, members: Sequence[int], dtype: torch.dtype) -> Optional[str]:
    """None when the all-reduce gave exactly the known sum, else what arrived wrong and from whom."""
    expected = allreduce_expected(members, dtype)
    wrong = [member for member, bad in zip(members, (received.cpu() != expected).tolist()) if bad]
    if not wrong:
        return None
    return (f"received {shortened(received.tolist())} instead of {shortened(expected.tolist())}: the"
            f" contribution of rank(s) {shortened(wrong)} arrived wrong")


def groups_under_test(world_size: int, rank: int, layout: Optional[Dict[str, int]],
                      timeout: datetime.timedelta) -> List[Tuple[str, List[int], Any]]:
    """(name, members, group) for the world and this rank's tp/pp/dp groups. Every rank creates every
    group in the same order, as torch.distributed requires."""
    dist = torch.distributed
    groups = [("world", list(range(world_size)), dist.group.WORLD)]
    if layout:
        for axis, members_list in layout_groups(world_size, layout["tp"], layout["pp"]).items():
            for members in members_list:
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    groups.append((axis, members, group))
    return groups


def allreduce_results(groups: Sequence[Tuple[str, List[int], Any]], rank: int, device: torch.device,
                      timeout: datetime.timedelta) -> List[Dict[str, Any]]:
    """This rank's all-reduce results in each of its ``groups``; after the first error the rest of this
    rank's checks are not run (its group may be broken), and say so."""
    results, failed = [], False
    for group_name, members, group in groups:
        for dtype in COMMUNICATION_DTYPES:
            detail = "not run: an earlier collective failed on this rank" if failed else None
            if not failed:
                tensor = allreduce_input(members, rank, dtype).to(device)
                try:
                    work = torch.distributed.all_reduce(tensor, group=group, async_op=True)
                    work.wait(timeout=timeout)
                    detail = allreduce_mismatch(tensor, members, dtype)
                except RuntimeError as exc:
                    failed, detail = True, f"all-reduce failed: {first_line(exc)}"
            results.append({"name": f"allreduce_{group_name}_{dtype_name(dtype)}", "group": group_name,
                            "dtype": dtype_name(dtype), "members": members, "detail": detail})
    return results


def communication_entries(results_by_rank: Sequence[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Every rank's own communication results (``results_by_rank[rank]``), one JSON check per name."""
    entries: Dict[str, Dict[str, Any]] = {}
    for rank, results in enumerate(results_by_rank):
        for result in results:
            entry = entries.setdefault(result["name"], {
                "name": result["name"], "kind": "communication", "group": result["group"],
                "dtype": result["dtype"], "pass": True, "ranks": []})
            row = {"rank": rank, "members": result["members"], "agrees": result["detail"] is None}
            if result["detail"] is not None:
                row["detail"] = result["detail"]
                entry["pass"] = False
            entry["ranks"].append(row)
    return list(entries.values())
