"""The job a launch's records describe (pure: records in): its world size, the one most of its records
name, and the records and ranks that belong to it. A record claiming another world size, none, or a rank
beyond the job's is from outside the job (a file copied in from another run, edited by hand, forged): it
is left out of every decision and named once, so that a ghost rank can neither take the blame, nor ask for
a self-test on a node it is not on, nor make a save clean.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...formats.schema import is_int

Record = Dict[str, Any]
MAX_OUTSIDE_NAMED = 4  # ranks from outside the job named in its one problem line; the rest counted


def job_world_size(records: Sequence[Record]) -> Optional[int]:
    """The job's world size: the one most of its records name (the larger where two tie); None where none
    names one."""
    counts: Dict[int, int] = {}
    for record in records:
        size = record["rank"].get("world_size")
        if is_int(size) and size > 0:
            counts[size] = counts.get(size, 0) + 1
    return max(counts, key=lambda size: (counts[size], size)) if counts else None


def inside_job(rank: Dict[str, Any], world: Optional[int]) -> bool:
    """A rank of a job of ``world`` ranks (any, where no record names the job's size)."""
    if world is None:
        return True
    number: Any = rank.get("global_rank")
    return rank.get("world_size") == world and is_int(number) and 0 <= number < world


def _claimed(rank: Dict[str, Any]) -> str:
    size = rank.get("world_size")
    return (f"rank {rank.get('global_rank')} of "
            + (f"a world of {size}" if is_int(size) else "no stated world size"))


def job_records(launch: Sequence[Record]) -> Tuple[Optional[int], List[Record], Tuple[str, ...]]:
    """The job's world size, the launch's records from inside it, and one problem line for those left out
    (none where every record is inside)."""
    world = job_world_size(launch)
    kept: List[Record] = []
    outside: Dict[str, int] = {}
    for record in launch:
        if inside_job(record["rank"], world):
            kept.append(record)
        else:
            outside.setdefault(_claimed(record["rank"]), 0)
            outside[_claimed(record["rank"])] += 1
    if not outside:
        return world, kept, ()
    claims = sorted(outside)
    named = ", ".join(claims[:MAX_OUTSIDE_NAMED]) + (
        f" and {len(claims) - MAX_OUTSIDE_NAMED} more" if len(claims) > MAX_OUTSIDE_NAMED else "")
    return world, kept, (f"{sum(outside.values())} record(s) claim a place outside this job of {world} ranks"
                         f" (what most of its records name): {named}; left out of the report",)
