"""The typed facts the rules of ``causes`` decide on (``evidence_of``), read once from the failing step's
records: the weights and optimizer state the ranks read (``state`` records) and how data-parallel
replicas compare, whether an fp16 overflow recurs, the iterations the records name, and NVML's readings
of the origin's devices.
"""

from __future__ import annotations

import math
from typing import Any, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple

from ...decision.evidence import (
    RATE_JUMP,
    BadWeight,
    DivergedWeight,
    Evidence,
    HealthReading,
    OutlyingRow,
    RateFault,
    ReplicaDivergence,
    StateFault,
    View,
)
from ...decision.facts import Fact
from ...decision.links import link_findings
from ...decision.loop_terms import loop_of
from ...decision.origin import facts_of_step, silent_replicas
from ...formats.health import health_signs
from ...formats.incident import GradientPass, OriginBasis, RecordKind
from ...formats.layout import AXES, peers_key, rank_label, vocabulary_token
from ...formats.rerun_record import loss_here_nonfinite
from ...formats.schema import NONFINITE_WORDS
from .checkpoints import Save, newest_clean
from .conflicts import conflicts_of
from .gradients import rank_view
from .read import RunFiles
from .verdict import Pattern, RerunFinding


def health_readings(at_step: Sequence[Dict[str, Any]], origin: Sequence[View]) -> List[HealthReading]:
    """NVML's reading of each origin rank's device at the failing step: the first of its records there
    that carries one (a rank reads its device once per step)."""
    readings: Dict[Any, HealthReading] = {}
    ranks = {entry["global_rank"] for entry in origin}
    for record in at_step:
        rank, health = record["rank"].get("global_rank"), record.get("device_health")
        if health is not None and rank in ranks and rank not in readings:
            readings[rank] = HealthReading(rank_view(record["rank"]), health["device"], health["values"],
                                           health["unread"], health_signs(health["values"]))
    return [readings[rank] for rank in sorted(readings)]


def state_records(files: RunFiles, launch: List[Dict[str, Any]], step: int) -> List[Dict[str, Any]]:
    """The weights and optimizer state the ranks read at the run's first incident: the ``state`` records
    of the first step at or after the failing one that has any (a run of fp16 skips, which apply no update,
    becomes an incident a few steps after the step the report starts from). A rank whose first incident
    came later read weights another update had changed: not comparable, left out."""
    first = min((record["step"] for record in launch if record.get("kind") == RecordKind.STATE
                 and record["step"] >= step), default=None)
    chosen = {record["rank"].get("global_rank"): record for record in launch
              if record.get("kind") == RecordKind.STATE and record["step"] == first}
    return [files.full(chosen[rank]) for rank in sorted(chosen, key=lambda rank: (rank is None, rank or 0))]


def _expert_names(record: Dict[str, Any]) -> FrozenSet[str]:
    """The expert parameters among a ``state`` record's bad weights: marked ``is_expert`` (the main copy's
    entry carries it), else, under expert parallelism, named inside Megatron's MoE experts."""
    experts = (record["rank"].get("ep_size") or 1) > 1
    return frozenset(p["name"] for p in record["params"] if p.get("is_expert") is True or (
        experts and p.get("is_expert") is None and ".mlp.experts." in p["name"]))


def replica_key(coords: Mapping[str, Any], expert: bool) -> Tuple[Any, ...]:
    """What the data-parallel replicas of one parameter share: every coordinate but ``dp`` (an expert's,
    whose replicas hold the same experts), and but ``dp`` and ``ep`` for a dense parameter (every
    data-parallel rank holds it, whichever experts it holds)."""
    return peers_key(coords, "dp") if expert else tuple(coords.get(axis) for axis in AXES
                                                         if axis not in ("dp", "ep"))


def weight_peers(states: Sequence[Dict[str, Any]]) -> Dict[Tuple[int, str], List[int]]:
    """For each (rank, bad weight) of the ``state`` records, the other ranks holding a replica of that
    weight that read their state too."""
    groups: Dict[Tuple[bool, Tuple[Any, ...]], List[int]] = {}
    for record in states:
        for expert in (False, True):
            groups.setdefault((expert, replica_key(record["rank"], expert)), []).append(
                record["rank"].get("global_rank"))
    peers = {}
    for record in states:
        rank, experts = record["rank"].get("global_rank"), _expert_names(record)
        for name in {p["name"] for p in record["params"]}:
            group = groups[(name in experts, replica_key(record["rank"], name in experts))]
            peers[(rank, name)] = [peer for peer in group if peer != rank]
    return peers


def _lone_weights(states: Sequence[Dict[str, Any]], at_step: Sequence[Dict[str, Any]],
                  peers: Mapping[Tuple[int, str], List[int]]) -> Tuple[int, ...]:
    """The ranks holding a non-finite weight that a data-parallel peer (``weight_peers``) holds finite (its
    own ``state`` record says so), or whose peer's forward pass was finite at that step (an fp16 skip
    recorded with a finite loss: a replica that did not fail reads no state): that replica's copy went bad
    alone."""
    bad = {record["rank"].get("global_rank"): {p["name"] for p in record["params"]} for record in states}
    finite_forward = {(expert, replica_key(r["rank"], expert)) for r in at_step for expert in (False, True)
                      if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW and r.get("loss_finite") is True}
    lone = set()
    for record in states:
        rank, experts = record["rank"].get("global_rank"), _expert_names(record)
        for name in bad[rank]:
            key = (name in experts, replica_key(record["rank"], name in experts))
            if key in finite_forward or any(name not in bad[peer] for peer in peers[(rank, name)]):
                lone.add(rank)
    return tuple(sorted(lone))


def replica_digests(states: Sequence[Dict[str, Any]]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Data-parallel peers (equal coordinates but ``dp``) compared by their weights' digests: the ranks
    whose digest differs from a strict majority's (``odd``), and the ranks of groups that differ with no
    majority (``split``, e.g. two replicas)."""
    groups: Dict[Tuple[Any, ...], Dict[str, List[int]]] = {}
    for record in states:
        coords = record["rank"]
        digests = groups.setdefault(peers_key(coords, "dp"), {})
        digests.setdefault(record["weights_digest"], []).append(coords.get("global_rank"))
    odd: List[int] = []
    split: List[int] = []
    for digests in groups.values():
        if len(digests) < 2:
            continue
        total = sum(len(ranks) for ranks in digests.values())
        majority = next((d for d, ranks in digests.items() if 2 * len(ranks) > total), None)
        for digest, ranks in digests.items():
            if majority is None:
                split += ranks
            elif digest != majority:
                odd += ranks
    return tuple(sorted(odd)), tuple(sorted(split))


def replica_divergence(divergences: Sequence[Dict[str, Any]]) -> Optional[ReplicaDivergence]:
    """The step's ``replica_divergence`` records (each written by a rank whose weights differed) as one
    finding: the ranks they name (every record names them all, up to its cap, and each names itself), the
    first record's counts, and each writer's differing parameters."""
    if not divergences:
        return None
    first = divergences[0]
    named = {rank for record in divergences for rank in record["differing_ranks"]}
    named |= {record["rank"].get("global_rank") for record in divergences}
    weights = tuple(DivergedWeight(record["rank"].get("global_rank"), entry["name"],
                                   None if entry.get("index") is None else tuple(entry["index"]),
                                   entry.get("value"), entry.get("majority_value"))
                    for record in divergences for entry in record["diverged"])
    ranks = tuple(sorted(rank for rank in named if isinstance(rank, int)))
    return ReplicaDivergence(ranks, first["replicas"], first.get("agreeing"), first["read_at_step"], weights,
                             first["diverged_total"])


def overflow_recurs(at_step: Sequence[Dict[str, Any]], launch: Sequence[Dict[str, Any]], step: int) -> bool:
    """An fp16 overflow that fails again at the next step, where no update was applied in between: the same
    numerics, other data."""
    return (any(r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW for r in at_step)
            and any(r.get("kind") == RecordKind.LOSS_SCALE_OVERFLOW and r["step"] == step + 1
                    for r in launch))


def _loss_ranks(rerun: RerunFinding, ranks: Dict[int, Dict[str, Any]]) -> Tuple[int, ...]:
    """Every rank of the last pipeline stage (which computes the loss) of the replicas that reached the
    rerun's leading conclusion: the tensor-parallel ranks there compute the same loss, whether or not they
    wrote a record (one whose data iterator gave nothing keeps no micro-batch)."""
    def coordinate(rank: Any, axis: str) -> Any:
        return (ranks.get(rank) or {}).get(axis)

    replicas = {coordinate(rank, "dp") for rank in rerun.concluded_by}
    last = max((coordinate(rank, "pp") or 0 for rank in ranks if coordinate(rank, "dp") in replicas),
               default=0)
    stage = tuple(sorted(rank for rank in ranks if coordinate(rank, "dp") in replicas
                         and (coordinate(rank, "pp") or 0) == last))
    # a group spanning several replicas (expert parallelism) concluded together: not those whose own loss
    # was finite in both passes, where that leaves any
    return tuple(rank for rank in stage if rank not in rerun.losses_finite_here) or stage


def _tensor_parallel_loss_split(reruns: Sequence[Dict[str, Any]]) -> Tuple[int, ...]:
    """The ranks whose own loss (a rerun record's ``loss_here``) was non-finite where a tensor-parallel peer's
    (every coordinate but ``tp`` equal) was finite in both passes: Megatron's vocab-parallel cross entropy
    all-reduces the logits' sums over the tensor-parallel group, so its ranks compute one loss from one
    micro-batch (broadcast to them)."""
    seen: Dict[Tuple[Any, ...], Dict[bool, List[int]]] = {}
    for record in reruns:
        nonfinite = loss_here_nonfinite(record.get("loss_here"))
        if nonfinite is not None and (record["rank"].get("tp_size") or 1) > 1:
            seen.setdefault(peers_key(record["rank"], "tp"), {}).setdefault(nonfinite, []).append(
                record["rank"].get("global_rank"))
    return tuple(sorted(rank for group in seen.values() if len(group) == 2 for rank in group[True]))


def _loss_scale_facts(at_step: Sequence[Dict[str, Any]], recurs: bool) -> Dict[str, Any]:
    """``Evidence``'s loss-scale fields from the step's fp16 skips (``loss_scale_overflow`` records): the
    ranks whose scaler held a non-finite scale and the first such value; and whether skips that recur with
    a finite loss recorded no scale at all."""
    overflows = [r for r in at_step if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW]
    bad = [r for r in overflows if r.get("loss_scale") in NONFINITE_WORDS]
    unread = (recurs and bool(overflows) and all(r.get("loss_scale") is None for r in overflows)
              and not any(r.get("loss_finite") is False for r in overflows)
              and not any(r["kind"] == RecordKind.NONFINITE_GRAD_NORM for r in at_step))
    return {"loss_scale_bad": tuple(sorted({r["rank"].get("global_rank") for r in bad})),
            "loss_scale": bad[0]["loss_scale"] if bad else None, "loss_scale_unread": unread}


class RankLabels(Mapping):
    """Each known rank's label ("rank 3 (tp1 pp0 dp1, host cuda:1)"), made when a wording asks for it: a
    summary names a few ranks of a job that may have 131,072."""

    def __init__(self, ranks: Dict[int, Dict[str, Any]]) -> None:
        self._ranks = ranks

    def __getitem__(self, rank: int) -> str:
        return rank_label(self._ranks[rank], "inside")

    def __iter__(self) -> Iterator[int]:
        return (rank for rank in self._ranks if rank is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def token_of(tp: Any, param: Dict[str, Any]) -> Optional[int]:
    """The token the first bad element's row holds, for a weight whose record gives ``vocab_rows``."""
    rows, index = param.get("vocab_rows"), param.get("first_bad_index")
    if isinstance(rows, int) and rows > 0 and isinstance(index, list) and len(index) == 2:
        return vocabulary_token(tp, rows, index[0])
    return None


def evidence_of(step: int, iteration: Optional[int], ranks: Dict[int, Dict[str, Any]],
                states: Sequence[Dict[str, Any]], gradient: Tuple[OriginBasis, Sequence[View]],
                pattern: Pattern, rerun: Optional[RerunFinding], at_step: Sequence[Dict[str, Any]],
                recurs: bool, iterations_seen: Tuple[int, ...] = (),
                reruns: Sequence[Dict[str, Any]] = (),
                divergences: Sequence[Dict[str, Any]] = (), saves: Sequence[Save] = (),
                unchecked: Tuple[int, ...] = ()) -> Evidence:
    """The typed facts the rules decide on, from the failing step's records (``reruns``: its ``rerun``
    records; ``divergences``: its ``replica_divergence`` records; ``unchecked``: its ``unchecked_ranks``;
    the training loop they name: ``loop_terms.loop_of``) and the run directory's checkpoint marks
    (``saves``)."""
    basis, origin = gradient
    conflicts = conflicts_of(at_step, states, reruns, divergences, ranks)
    compared = (any(len(group) > 1 for group in _peer_groups(states).values())
                if any((record["rank"].get("dp_size") or 1) > 1 for record in states) else None)
    odd, split = replica_digests(states)
    peers = weight_peers(states)
    weights = tuple(BadWeight(record["rank"].get("global_rank"), p["name"], p.get("copy", "model"),
                              tuple(p.get("first_bad_index") or ()), p["nan"], p["inf"],
                              p["order"] if isinstance(p.get("order"), int) else -1,
                              token_of(record["rank"].get("tp"), p))
                    for record in states for p in record["params"])
    faults = tuple(StateFault(record["rank"].get("global_rank"), f["name"], f["state"], f["nan"], f["inf"],
                              f["negative"]) for record in states for f in record["optimizer_state"])
    rows = tuple(OutlyingRow(record["rank"].get("global_rank"), row["name"], row["row"],
                             vocabulary_token(record["rank"].get("tp"), row["rows"], row["row"]),
                             row["largest"], row["median"], row.get("every_step") is not False)
                 for record in states for row in record.get("outlying_rows") or ())
    losses = [r for r in at_step if r["kind"] == RecordKind.NONFINITE_LOSS]
    conclusion = rerun.conclusion if rerun is not None else None
    reduction_fault = rerun is not None and any(view.get("reduction") == "collective"
                                                for view in rerun.origins)
    rerun_origins = tuple(view["global_rank"] for view in rerun.origins) if rerun is not None else ()
    largest = next((entry["largest_grad"] for entry in origin if entry.get("largest_grad")), None)
    failed_at = min((r.get("time") or math.inf for r in list(at_step) + list(reruns)), default=math.inf)
    clean, no_clean = newest_clean(saves, failed_at, iteration)
    # where the state came with the launch: older than the checkpoint it resumed from (iteration - step)
    resumed_from = "the checkpoint this launch resumed from, iteration"
    before_resume = (newest_clean(saves, failed_at, iteration - step, resumed_from)
                     if isinstance(iteration, int) and counted(iteration)
                     else (None, "the iteration this launch resumed from is not recorded"))
    return Evidence(
        step=step, iteration=iteration, iterations_seen=iterations_seen,
        loop=loop_of([*at_step, *reruns, *divergences]),
        labels=RankLabels(ranks),
        dp_size=max((entry.get("dp_size") or 1 for entry in origin), default=1),
        states_read=tuple(record["rank"].get("global_rank") for record in states),
        launch_first_step=step == 1 or any(record.get("launch_weights_finite") is False for record in states),
        bad_weights=weights, state_faults=faults, rate_fault=rate_fault(states, step), outlying_rows=rows,
        lone_weights=_lone_weights(states, at_step, peers),
        weights_unpeered=compared is not None and any(not group for group in peers.values()),
        odd_replicas=odd,
        replicas_compared=compared,
        expert_parallel=any((record["rank"].get("ep_size") or 1) > 1 for record in states),
        split_replicas=split, divergence=replica_divergence(divergences), rerun=conclusion,
        rerun_module=rerun.module if rerun is not None else None,
        rerun_class=rerun.module_class if rerun is not None else None, rerun_origins=rerun_origins,
        rerun_origins_absent=rerun.origins_absent if rerun is not None else (),
        loss_stage=_loss_ranks(rerun, ranks) if rerun is not None else (),
        tensor_parallel_loss_split=_tensor_parallel_loss_split(reruns),
        rerun_concluded_by=rerun.concluded_by if rerun is not None else (),
        own_failure=rerun.own_failure if rerun is not None else None,
        micro_batch=rerun.micro_batch if rerun is not None else None, reduction_fault=reduction_fault,
        grew_in=rerun.grew_in if rerun is not None else None,
        gradient_basis=basis, gradient_origin=tuple(entry["global_rank"] for entry in origin),
        unchecked=unchecked if basis is OriginBasis.UNCHECKED else (),
        silent_replicas=silent_replicas(at_step, ranks) if basis is OriginBasis.AFTER_COLLECTIVE else (),
        origin_replicas=tuple(sorted({entry["dp"] for entry in origin if isinstance(entry.get("dp"), int)})),
        forward_pattern=pattern.gradient_pass is GradientPass.FORWARD,
        share_nonfinite=pattern.share_nonfinite,
        first_in_backward=pattern.first_in_backward, first_rank=pattern.first_rank,
        near_limit=any(p.get("near_limit") for entry in origin for p in entry["params"]),
        recorded_norm=bool(at_step), largest_grad=largest,
        largest_before_collective=any(entry["kind"] == RecordKind.PRE_REDUCTION for entry in origin
                                      if entry.get("largest_grad")),
        rejected_losses=tuple(r["rank"].get("global_rank") for r in losses),
        losses_nonfinite=tuple(sorted({r["rank"].get("global_rank") for r in at_step
                                       if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW
                                       and r.get("loss_finite") is False})),
        rejected=({"global_rank": losses[0]["rank"].get("global_rank"),
                   "micro_batch": losses[0].get("micro_batch"),
                   "loss": losses[0].get("loss"), "rerun_skipped": losses[0].get("rerun_skipped"),
                   "batch": next((r["batch"]["path"] for r in losses if r.get("batch")),
                                 rerun.batch if rerun is not None else None)} if losses else None),
        recurs=recurs,
        **_loss_scale_facts(at_step, recurs),
        origin_params={entry["global_rank"]: tuple(p["name"] for p in entry["params"]) for entry in origin},
        largest_names={entry["global_rank"]: entry["largest_grad"]["name"] for entry in origin
                       if entry.get("largest_grad")},
        links=link_findings([*at_step, *states]),
        observed=_observed(at_step, states, rerun, pattern, origin, compared) | (
            {Fact.CHECKPOINT_MARKS} if saves else set()),
        clean_checkpoint=clean, no_clean_checkpoint=no_clean,
        clean_before_resume=before_resume[0], no_clean_before_resume=before_resume[1],
        conflicts=tuple(said for said, _ in conflicts),
        conflict_ranks=tuple(sorted({rank for _, ranks in conflicts for rank in ranks})))


def _rate(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else float(value or "nan")


def rate_fault(states: Sequence[Dict[str, Any]], step: int) -> Optional[RateFault]:
    """The first rank (by rank) whose update of step ``step - 1`` used a non-finite learning rate, or one
    ``RATE_JUMP`` times the largest finite positive one of the steps it kept before it."""
    for record in states:
        kept = record.get("learning_rates") or []
        used = next((entry for entry in kept if entry["step"] == step - 1), None)
        if used is None:
            continue
        before = [rate for entry in kept if entry["step"] < step - 1 for rate in map(_rate, entry["lr"])
                  if math.isfinite(rate) and rate > 0]
        earlier = max(before, default=None)
        for group, written in enumerate(used["lr"]):
            rate = _rate(written) if written is not None else 0.0
            if not math.isfinite(rate) or (earlier is not None and abs(rate) >= RATE_JUMP * earlier):
                return RateFault(record["rank"].get("global_rank"), step - 1, group, written, earlier)
    return None


def _observed(at_step: Sequence[Dict[str, Any]], states: Sequence[Dict[str, Any]],
              rerun: Optional[RerunFinding], pattern: Pattern, origin: Sequence[View],
              compared: Optional[bool]) -> FrozenSet[Fact]:
    """The kinds of evidence the failing step's files hold, or that it had none of to hold
    (``compared``: ``Evidence.replicas_compared``)."""
    facts = set(facts_of_step(at_step))
    if states:
        facts.add(Fact.STATES)
    if states and compared is not False:
        facts.add(Fact.REPLICA_DIGESTS)  # compared, or no replicas to compare them with
    if rerun is not None:
        facts.add(Fact.RERUN)
    if any(record.get("learning_rates") for record in states):
        facts.add(Fact.LEARNING_RATES)
    if pattern.gradient_pass is not GradientPass.UNKNOWN or not origin:
        facts.add(Fact.PARAMETER_MAPS)  # counted against, or no origin's gradients to count
    if any(record.get("pipeline_links") for record in [*at_step, *states]) or not any(
            (record["rank"].get("pp_size") or 1) > 1 for record in [*at_step, *states]):
        facts.add(Fact.PIPELINE_LINKS)  # checked at the links, or no pipeline to have links
    return frozenset(facts)


def _peer_groups(states: Sequence[Dict[str, Any]]) -> Dict[Tuple[Any, ...], List[Any]]:
    """The ranks of each group of data-parallel peers that read their state (``peers_key``)."""
    peers: Dict[Tuple[Any, ...], List[Any]] = {}
    for record in states:
        peers.setdefault(peers_key(record["rank"], "dp"), []).append(record["rank"].get("global_rank"))
    return peers


def counted(iteration: Any) -> bool:
    return isinstance(iteration, int) and not isinstance(iteration, bool)


def iterations_of(at_step: Sequence[Dict[str, Any]], rerun: Optional[RerunFinding],
                  step: int) -> Tuple[int, ...]:
    """Every Megatron-LM iteration the failing step's records (its incident and ``rerun`` records) and its
    rerun's origin name (one where they agree)."""
    named: List[Any] = [r.get("iteration") for r in at_step]
    if rerun is not None and rerun.step == step:
        named.append(rerun.iteration)
    return tuple(sorted({int(iteration) for iteration in named if counted(iteration)}))
