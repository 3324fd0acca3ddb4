"""Where the failing step's records contradict each other (pure: records in). gradnan writes each of these
facts once and consistently; two records that disagree mean a run directory mixing launches, files edited
by hand, or a writer gone wrong, and no cause should be named from them (``decision.causes``'s
``records_conflict``). Each finding is a sentence and the ranks it names.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Mapping, Sequence, Tuple

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


def _observations(at_step: Sequence[Record], reruns: Sequence[Record]) -> List[Conflict]:
    """A rerun's ``observed`` (records version 2) is all-reduced over at least the rank's model-parallel
    group (its data-parallel replica: equal ``dp`` and ``cp``), and Megatron's job verdict is the whole
    job's: ranks of one replica that observed differently, or two job verdicts, cannot both be true; nor
    can a replica whose own gradients were finite hold a rank whose pre-reduction check found its own
    non-finite."""
    found: List[Conflict] = []
    seen: Dict[Tuple[Any, ...], Record] = {}
    jobs: Dict[Any, int] = {}
    wrote = {_rank(r) for r in at_step if r["kind"] == RecordKind.PRE_REDUCTION and r["params"]}
    for record in reruns:
        observed = record.get("observed")
        if not isinstance(observed, dict):
            continue
        first = seen.setdefault((record["rank"].get("dp"), record["rank"].get("cp")), record)
        if first["observed"] != observed:
            found.append((f"ranks {_rank(first)} and {_rank(record)} ran the step again in one data-parallel"
                          " replica, and their rerun records say it observed different things",
                          (_rank(first), _rank(record))))
        if observed.get("megatron_job") is not None:
            jobs.setdefault(observed["megatron_job"], _rank(record))
        if observed.get("own_gradients") == "finite" and _rank(record) in wrote:
            found.append((f"rank {_rank(record)}'s rerun record says its replica's own gradients were"
                          " finite before the data-parallel collective, and its pre_reduction record lists"
                          " non-finite ones", (_rank(record),)))
    if len(jobs) > 1:
        (said, one), (other_said, other) = sorted(jobs.items())[:2]
        found.append((f"Megatron's verdict on the job is {untrusted(said)} in rank {one}'s rerun record and"
                      f" {untrusted(other_said)} in rank {other}'s", (one, other)))
    return found


def _divergences(divergences: Sequence[Record], ranks: Mapping[int, Mapping[str, Any]]) -> List[Conflict]:
    """One replica check writes the same facts on every peer that differs, and the ranks it names are the
    writer's data-parallel peers (the same tensor-parallel and pipeline coordinates) of this job."""
    found: List[Conflict] = []
    first = divergences[0] if divergences else None
    for record in divergences:
        writer = _rank(record)
        if first is not None and any(record[key] != first[key] for key in ("replicas", "read_at_step")):
            found.append((f"ranks {_rank(first)} and {writer} wrote one replica check with different facts"
                          " (how many replicas, or when it was read)", (_rank(first), writer)))
        for named in record["differing_ranks"]:
            coords = ranks.get(named)
            if coords is None or any(coords.get(axis) != record["rank"].get(axis) for axis in ("tp", "pp")):
                why = "no rank of this job" if coords is None else "not a data-parallel peer of it"
                found.append((f"rank {writer}'s replica check names rank {named} among the data-parallel"
                              f" copies that differ, and rank {named} is {why}", (writer,)))
                break
    return found


def _links_without_pipeline(records: Sequence[Record]) -> List[Conflict]:
    """A stage's links are its sends to and receives from the neighbouring pipeline stages: a rank of a job
    without pipeline parallelism (``pp_size`` 1) has none."""
    return [(f"rank {_rank(record)}'s record lists pipeline transfers, and its rank is in no pipeline"
             " (pp_size 1)", (_rank(record),))
            for record in records
            if (record["rank"].get("pp_size") or 1) == 1 and any(
                direction.get("transfers") for direction in (record.get("pipeline_links") or {}).values())]


def _row_counts(states: Sequence[Record]) -> List[Conflict]:
    """Megatron splits the padded vocabulary evenly over the tensor-parallel ranks: every shard of one
    vocabulary weight has the same row count, which a row's token is computed from."""
    counts: Dict[Tuple[Any, ...], Dict[Any, int]] = {}
    for record in states:
        for row in record.get("outlying_rows") or ():
            counts.setdefault((peers_key(record["rank"], "tp"), row["name"]), {}).setdefault(
                row["rows"], _rank(record))
    return [(f"ranks {' and '.join(str(rank) for rank in sorted(seen.values())[:2])} hold shards of"
             f" {untrusted(name)} with different row counts, so no row's token is known",
             tuple(sorted(seen.values())[:2]))
            for (_, name), seen in counts.items() if len(seen) > 1]


_PLACE = ("host", "device", "tp", "pp", "dp", "cp", "ep")


def _two_places(records: Sequence[Record]) -> List[Conflict]:
    """A rank runs in one place: two of its records at the step naming two hosts, devices or parallel
    coordinates come from two runs (a file copied in under its name) or a file edited by hand."""
    places: Dict[Any, set] = {}
    for record in records:
        places.setdefault(_rank(record), set()).add(tuple(record["rank"].get(key) for key in _PLACE))
    return [(f"rank {rank}'s records at this step name {len(named)} places for it (hosts, devices or parallel"
             " coordinates)", (rank,)) for rank, named in places.items() if len(named) > 1]


def conflicts_of(at_step: Sequence[Record], states: Sequence[Record], reruns: Sequence[Record],
                 divergences: Sequence[Record] = (), ranks: Mapping[int, Mapping[str, Any]] = {}
                 ) -> Tuple[Conflict, ...]:
    """Every contradiction among the failing step's incident, ``state``, ``rerun`` and ``replica_divergence``
    records (``ranks``: the job's ranks, by global rank)."""
    return tuple(_pre_reduction_claims(at_step) + _digests_and_weights(states) + _reductions(reruns)
                 + _observations(at_step, reruns) + _divergences(divergences, ranks)
                 + _links_without_pipeline([*at_step, *states]) + _row_counts(states)
                 + _two_places([*at_step, *states, *reruns, *divergences]))
