"""A ``replica_divergence`` record's own fields, checked: their types, and what one replica check can say
at all (``training.replicas``: the peers all-gather their weights, so every peer writes the same facts).
A record that cannot be true (five copies among two replicas, a "differing" value equal to the majority's,
a differing rank outside the job) is no record: the reader lists it as a problem line.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ..errors import InputError
from .rerun_record import MAX_DIMS
from .schema import is_finite, is_int, is_stat, is_text, optional

MAX_DIVERGED_PARAMS, MAX_DIFFERING_RANKS = 64, 1024  # far above what gradnan writes: 4 and 64


def _is_index(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(is_int(i) for i in value)


def _is_diverged(entry: Any) -> bool:
    """One parameter of a ``replica_divergence`` record: its first differing element where located."""
    return (isinstance(entry, dict) and is_text(entry.get("name"))
            and all(optional(entry.get(key), is_int) for key in ("numel", "flat"))
            and optional(entry.get("index"), _is_index)
            and all(optional(entry.get(key), is_stat) for key in ("value", "majority_value")))


def _same_value(entry: Dict[str, Any]) -> bool:
    """A located element whose value is the majority's, bit for bit as far as a float tells (0.0 and -0.0
    differ in their bits, so they differ here too)."""
    value: Any = entry.get("value")
    majority: Any = entry.get("majority_value")
    if not (is_finite(value) and is_finite(majority)):
        return False
    return bool(value == majority and math.copysign(1.0, value) == math.copysign(1.0, majority))


def _impossible(record: Dict[str, Any]) -> Optional[str]:
    """Why the record's facts cannot come from one replica check of its rank's job (None: they can)."""
    rank, replicas, agreeing = record["rank"], record["replicas"], record.get("agreeing")
    world, ranks = rank.get("world_size"), record["differing_ranks"]
    copies = (rank.get("dp_size") or 1) * (rank.get("cp_size") or 1) if is_int(rank.get("dp_size")) else None
    if replicas < 2 or (copies is not None and replicas > copies):
        return (f"'replicas' {replicas}, where its rank holds one of {copies} data-parallel copies"
                if copies is not None else f"'replicas' {replicas}: a check compares at least 2")
    if agreeing is not None and not 1 <= agreeing < replicas:
        return f"'agreeing' {agreeing} of {replicas} replicas (the writer differs from the majority it names)"
    if not max(1, len(ranks)) <= record["differing_total"] <= replicas or len(set(ranks)) < len(ranks):
        return (f"'differing_total' {record['differing_total']} with {len(ranks)} listed of {replicas}"
                " replicas, each at most once")
    if any(not 0 <= number < (world if is_int(world) else number + 1) for number in ranks):
        return f"a differing rank outside its world of {world} ranks"
    if any(map(_same_value, record["diverged"])):
        return "a 'value' equal to the majority's, said to differ from it"
    equal = record.get("last_equal_step")
    if equal is not None and equal >= record["step"]:
        return f"'last_equal_step' {equal} not before the check's step {record['step']}"
    return None


def check_divergence(record: Dict[str, Any], where: str) -> None:
    ranks, diverged = record.get("differing_ranks"), record.get("diverged")
    if (not all(is_int(record.get(key)) for key in ("read_at_step", "replicas", "differing_total",
                                                     "diverged_total"))
            or not all(optional(record.get(key), is_int) for key in ("agreeing", "last_equal_step"))
            or not (isinstance(ranks, list) and len(ranks) <= MAX_DIFFERING_RANKS and all(map(is_int, ranks)))
            or not (isinstance(diverged, list) and len(diverged) <= MAX_DIVERGED_PARAMS
                    and all(map(_is_diverged, diverged)))):
        raise InputError(f"{where}: a replica_divergence record needs integers 'read_at_step', 'replicas',"
                         " 'differing_total' and 'diverged_total', 'agreeing' and 'last_equal_step' null or"
                         " integers, a"
                         f" 'differing_ranks' list of at most {MAX_DIFFERING_RANKS} integers and a 'diverged'"
                         f" list of at most {MAX_DIVERGED_PARAMS} objects with a text 'name', 'numel'/'flat'"
                         " null or integers, 'index' null or a list of integers and 'value'/'majority_value'"
                         " null or numbers")
    impossible = _impossible(record)
    if impossible is not None:
        raise InputError(f"{where}: a replica_divergence record that no replica check writes: {impossible}")
