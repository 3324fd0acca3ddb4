"""Where the failing step's records contradict each other (pure: records in). gradnan writes each of these
facts once and consistently; two records that disagree mean a run directory mixing launches, files edited
by hand, or a writer gone wrong, and no cause should be named from them (``decision.causes``'s
``records_conflict``). Each finding is a sentence and the ranks it names.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Sequence, Tuple

from ...formats.incident import RecordKind
from ...formats.layout import peers_key
from ...formats.text import untrusted

Record = Dict[str, Any]
Conflict = Tuple[str, Tuple[int, ...]]  # what contradicts what, and the ranks whose records do


def _rank(record: Record) -> int:
    return record["rank"].get("global_rank")


def _pre_reduction_claims(at_step: Sequence[Record]) -> List[Conflict]:
    """A rank's grad-norm record says what its pre-reduction check found; a ``pre_reduction`` record of
    that rank at that step is written exactly where it found a non-finite gradient."""
    wrote = {_rank(r) for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r["params"]}
    found: List[Conflict] = []
    for record in at_step:
        if record["kind"] != RecordKind.NONFINITE_GRAD_NORM:
            continue
        said, rank = record.get("pre_reduction"), _rank(record)
        if said == "nonfinite" and rank not in wrote:
            found.append((f"rank {rank}'s grad-norm record says its own gradients were non-finite before the"
                          " data-parallel collective, and it wrote no pre_reduction record of them", (rank,)))
        elif said in ("clean", "unchecked") and rank in wrote:
            found.append((f"rank {rank}'s grad-norm record says its pre-reduction check found it {said}, and"
                          " its pre_reduction record lists non-finite gradients", (rank,)))
    return found


def _digests_and_weights(states: Sequence[Record]) -> List[Conflict]:
    """Data-parallel peers with equal digests of their weights hold bitwise equal weights: one cannot hold
    a non-finite model weight its peer holds finite."""
    seen: Dict[Tuple[Tuple[Any, ...], str], Tuple[Record, FrozenSet[str]]] = {}
    found: List[Conflict] = []
    for record in states:
        bad = frozenset(p["name"] for p in record["params"] if p.get("copy", "model") == "model")
        key = (peers_key(record["rank"], "dp"), record["weights_digest"])
        first, first_bad = seen.setdefault(key, (record, bad))
        if bad != first_bad:
            name = sorted(bad ^ first_bad)[0]
            found.append((f"ranks {_rank(first)} and {_rank(record)} report equal digests of their weights,"
                          f" yet only one of them holds {untrusted(name)} non-finite",
                          (_rank(first), _rank(record))))
    return found


def _reductions(reruns: Sequence[Record]) -> List[Conflict]:
    """Every rank of a tensor-parallel group judges the same reduction from the same all-reduced facts: one
    cannot find every partial sum finite ("collective") while a peer found its own non-finite ("partial")."""
    groups: Dict[Tuple[Any, ...], Dict[str, List[int]]] = {}
    for record in reruns:
        if record.get("reduction"):
            groups.setdefault(peers_key(record["rank"], "tp"), {}).setdefault(record["reduction"], []).append(
                _rank(record))
    return [(f"rank {said['collective'][0]}'s rerun found every partial sum of a tensor-parallel reduction"
             f" finite, and rank {said['partial'][0]}'s found its own partial sum non-finite",
             (said["collective"][0], said["partial"][0]))
            for said in groups.values() if "collective" in said and "partial" in said]


def conflicts_of(at_step: Sequence[Record], states: Sequence[Record], reruns: Sequence[Record]
                 ) -> Tuple[Conflict, ...]:
    """Every contradiction among the failing step's incident, ``state`` and ``rerun`` records."""
    return tuple(_pre_reduction_claims(at_step) + _digests_and_weights(states) + _reductions(reruns))
