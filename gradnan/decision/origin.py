"""Which ranks the failing step's records point at. The gradients': one declared, ordered table
(``ORIGIN_RULES``, best evidence first) over the step's checked records; the first rule whose needs were
observed and that selects any record decides (``decide_gradient_origin``). The rerun's: the forward
origins among the ranks its records name (``forward_origins``). The cause table reads both as evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Sequence, Tuple

from ..formats.incident import NORM_KINDS, OriginBasis, RecordKind
from .facts import Fact, unobserved

Record = Dict[str, Any]  # a record ``formats.records`` checked
CHECKED = ("clean", "nonfinite", "overflow")  # a norm record's ``pre_reduction`` where the rank was checked
INFINITE = ("inf", "-inf")  # a record's ``grad_norm`` that a float32 sum of squares overflowing gives


def facts_of_step(at_step: Sequence[Record]) -> FrozenSet[Fact]:
    """The kinds of gradient evidence the step's incident records hold; all of them where Megatron's loss
    check ended the step before any gradient existed (none was there to see)."""
    kinds = {record["kind"] for record in at_step}
    if kinds == {RecordKind.NONFINITE_LOSS}:
        return frozenset({Fact.GRADIENTS, Fact.OWN_GRADIENTS, Fact.LARGEST_GRADIENT})
    facts = set()
    if kinds & {*NORM_KINDS, RecordKind.PRE_REDUCTION}:
        facts.add(Fact.GRADIENTS)
    if RecordKind.PRE_REDUCTION in kinds or any(record.get("pre_reduction") in CHECKED for record in at_step
                                                if record["kind"] in NORM_KINDS):
        facts.add(Fact.OWN_GRADIENTS)
    if any(record.get("largest_grad") for record in at_step):
        facts.add(Fact.LARGEST_GRADIENT)
    return frozenset(facts)


def per_rank(records: Sequence[Record]) -> List[Record]:
    """One record per rank: a rank writes one pre-reduction record per bad bucket group."""
    merged: Dict[Any, Record] = {}
    for record in records:
        rank = record["rank"].get("global_rank")
        if rank not in merged:
            merged[rank] = {**record, "params": list(record["params"]),
                            "params_total": record.get("params_total", len(record["params"]))}
        else:
            merged[rank]["params"] += record["params"]
            merged[rank]["params_total"] += record.get("params_total", len(record["params"]))
    return list(merged.values())


def _own_before(at_step: Sequence[Record], unchecked: Tuple[int, ...]) -> List[Record]:
    return per_rank([r for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r["params"]])


def _holders(at_step: Sequence[Record]) -> List[Record]:
    """One record per rank holding non-finite gradients at the norm (a rank writes one per optimizer: a
    distinct one for its experts under expert parallelism)."""
    return per_rank([r for r in at_step if r["kind"] in NORM_KINDS and r["params"]])


def _checked(record: Record) -> bool:
    """The record saw its rank's own gradients before the data-parallel collective."""
    return record["kind"] == RecordKind.PRE_REDUCTION or (record["kind"] in NORM_KINDS
                                                          and record.get("pre_reduction") in CHECKED)


def _job_ranks(at_step: Sequence[Record], known: Mapping[int, Mapping[str, Any]]
               ) -> Iterator[Tuple[int, Mapping[str, Any]]]:
    """The ``known`` ranks (global rank -> coordinates) of the step's job: below the ``world_size`` its
    records give."""
    world = max((size for size in (r["rank"].get("world_size") for r in at_step) if isinstance(size, int)),
                default=0)
    return ((rank, coords) for rank, coords in known.items() if isinstance(rank, int) and rank < world)


def unchecked_ranks(at_step: Sequence[Record], known: Mapping[int, Mapping[str, Any]]) -> Tuple[int, ...]:
    """The ranks whose norm must have been non-finite but whose own gradients no record of the step saw
    before the data-parallel collective: ``known`` ranks of the step's job without a checked record, in a
    data-parallel replica where another rank recorded a non-finite norm (a replica's ranks all-reduce one
    norm, so each of them had it). They died first, their files are not in the run directory, or gradnan's
    ``ranks`` left them out. A rank with no record in a replica where none recorded one had a finite norm:
    its gradients after the collective were finite."""
    failed = {r["rank"].get("dp") for r in at_step if r["kind"] in NORM_KINDS}
    checked = {r["rank"].get("global_rank") for r in at_step if _checked(r)}
    return tuple(sorted(rank for rank, coords in _job_ranks(at_step, known)
                        if rank not in checked and coords.get("dp") in failed))


def silent_replicas(at_step: Sequence[Record], known: Mapping[int, Mapping[str, Any]]) -> Tuple[int, ...]:
    """The ``known`` ranks of the step's job in data-parallel replicas where no rank wrote a record of the
    step: a finite norm there (or every rank of the replica died first, or their files are missing)."""
    recorded = {r["rank"].get("dp") for r in at_step}
    return tuple(sorted(rank for rank, coords in _job_ranks(at_step, known)
                        if coords.get("dp") not in recorded))


def _holders_after_clean_checks(at_step: Sequence[Record], unchecked: Tuple[int, ...]) -> List[Record]:
    return _holders(at_step) if not unchecked and any(map(_checked, at_step)) else []


def _holders_beside_unchecked(at_step: Sequence[Record], unchecked: Tuple[int, ...]) -> List[Record]:
    return _holders(at_step) if unchecked and any(map(_checked, at_step)) else []


def _magnitude(record: Record) -> float:
    value = record["largest_grad"]["value"]
    return abs(value) if isinstance(value, (int, float)) else float("inf")


def norm_overflow_origin(at_step: Sequence[Record]) -> List[Record]:
    """Where no rank held a non-finite gradient: the records of the ranks that held the largest finite
    gradient, whose square overflowed the grad norm. Best evidence first: pre-reduction records of a norm
    overflow (their own gradients before the data-parallel collective, where a replica that only received
    the value through it does not appear); else the grad-norm records whose own float32 sum of squares
    overflowed, the largest of them; else the largest of those whose norm is infinite (a sum of squares
    overflows; a NaN norm does not come of one: a gradient the rank does not hold, a shard of a rank whose
    records are missing, made it). Empty when no record names a largest gradient."""
    before = [r for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r.get("norm_overflow")]
    if before:
        return per_rank(before)
    named = [r for r in at_step if r["kind"] == RecordKind.NONFINITE_GRAD_NORM and r.get("largest_grad")]
    candidates = [r for r in named if r["largest_grad"]["overflows"]] or [
        r for r in named if r.get("grad_norm") in INFINITE]
    if not candidates:
        return []
    top = max(_magnitude(r) for r in candidates)
    return [r for r in candidates if _magnitude(r) == top]


@dataclass(frozen=True)
class OriginRule:
    """One row: the ``basis`` it decides, the evidence it needs, when (in words) and the records it
    selects (none: it does not apply)."""

    basis: OriginBasis
    needs: Tuple[Fact, ...]
    when: str
    select: Callable[[Sequence[Record], Tuple[int, ...]], List[Record]]  # (records, unchecked ranks)


ORIGIN_RULES: Tuple[OriginRule, ...] = (
    OriginRule(OriginBasis.BEFORE_COLLECTIVE, (Fact.OWN_GRADIENTS,),
               "some rank's own gradients were non-finite before the data-parallel collective", _own_before),
    OriginRule(OriginBasis.AFTER_COLLECTIVE, (Fact.GRADIENTS, Fact.OWN_GRADIENTS),
               "no rank's were, every rank of a replica that recorded a non-finite norm was checked, and some"
               " hold non-finite gradients at the norm", _holders_after_clean_checks),
    OriginRule(OriginBasis.UNCHECKED, (Fact.GRADIENTS, Fact.OWN_GRADIENTS),
               "no checked rank's were, a rank of a replica that recorded a non-finite norm has no record at"
               " the step, and some hold non-finite gradients at the norm", _holders_beside_unchecked),
    OriginRule(OriginBasis.UNCONFIRMED, (Fact.GRADIENTS,),
               "no rank was checked before the collective, some hold non-finite gradients",
               lambda at_step, unchecked: _holders(at_step)),
    OriginRule(OriginBasis.NORM_OVERFLOW, (Fact.GRADIENTS,),
               "no rank holds a non-finite gradient, a largest finite one overflowed the float32 norm",
               lambda at_step, unchecked: norm_overflow_origin(at_step)),
)


def decide_gradient_origin(at_step: Sequence[Record], unchecked: Tuple[int, ...]
                           ) -> Tuple[OriginBasis, List[Record]]:
    """The origin as the gradients' records show it, and what it rests on (``NONE``: no rule selects);
    ``unchecked``: the step's ``unchecked_ranks``."""
    observed = facts_of_step(at_step)
    for rule in ORIGIN_RULES:
        if not unobserved(rule.needs, observed):
            selected = rule.select(at_step, unchecked)
            if selected:
                return rule.basis, selected
    return OriginBasis.NONE, []


def forward_origins(records: List[Record]) -> List[Record]:
    """Of the ranks a rerun named as origins, those of each data-parallel replica's earliest pipeline
    stage: a forward value flows from the first stage to the last, so a later stage that went non-finite
    too received it (a stage's input arrives through the point-to-point exchange, not as an argument its
    hooks see)."""
    def stage(record: Record) -> int:
        return record["rank"].get("pp") or 0

    earliest: Dict[Any, int] = {}
    for record in records:
        replica = record["rank"].get("dp")
        earliest[replica] = min(earliest.get(replica, stage(record)), stage(record))
    return [record for record in records if stage(record) == earliest[record["rank"].get("dp")]]
