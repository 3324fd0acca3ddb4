"""What the in-place rerun of the failing step found (pure: ``rerun`` records in, ``RerunFinding`` out):
the forward origin and the ranks that only received it, each replica's conclusion and Megatron's own,
where a value first grew out of line, and where the failing micro-batch sits in the data.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...decision.origin import forward_origins
from ...decision.replica import PRECEDENCE, conclusion_of, own_failure_of
from ...formats.incident import Conclusion, OwnFailure, RecordKind, RerunRole
from ...formats.rerun_record import loss_here_nonfinite
from .gradients import rank_view
from .verdict import Concluded, RerunFinding


def _grouped(records: Sequence[Dict[str, Any]], conclusion: Callable[[Dict[str, Any]], Optional[Conclusion]],
             ) -> List[Concluded]:
    """The records' ranks grouped by their ``conclusion``, in ``replica.PRECEDENCE`` (first wins), with
    what of a transient replica's own failed."""
    groups: Dict[Conclusion, List[int]] = {}
    own: Dict[Conclusion, Optional[OwnFailure]] = {}
    for record in records:
        value = conclusion(record)
        if value is not None:
            groups.setdefault(value, []).append(record["rank"].get("global_rank"))
            failed = own_failure_of(record)
            if failed is not None and value is Conclusion.TRANSIENT:
                own.setdefault(value, failed)
    return [Concluded(value.value, tuple(groups[value]), own.get(value)) for value in PRECEDENCE
            if value in groups]


def _megatron(record: Dict[str, Any]) -> Optional[Conclusion]:
    return None if record.get("megatron") is None else Conclusion(record["megatron"])


def _growth(at_step: List[Dict[str, Any]], origin: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Where a value first grew out of line: on the origin's rank where it saw it, else the first rank
    that did, earliest pipeline stage first (a stage's growth reaches the later stages)."""
    grown = sorted((r for r in at_step if r.get("grew_in")),
                   key=lambda r: (r is not origin, r["rank"].get("pp") or 0,
                                  r["rank"].get("global_rank", -1)))
    return {**grown[0]["grew_in"], "global_rank": grown[0]["rank"].get("global_rank")} if grown else None


def _failing_samples(at_step: List[Dict[str, Any]], failing: Sequence[int]) -> List[Dict[str, Any]]:
    """Where the failing replicas' micro-batch sits in Megatron-LM's data: one entry per data-parallel rank
    (its tensor- and pipeline-parallel ranks share the micro-batch), from the rank that named its dataset's
    documents where one did (the ranks that read the data), else the lowest."""
    chosen: Dict[int, Dict[str, Any]] = {}
    for record in at_step:
        samples = record.get("samples")
        if samples is None or record["rank"].get("global_rank") not in failing:
            continue
        kept = chosen.get(samples["data_parallel_rank"])
        if kept is None or (samples.get("sources") and not kept.get("sources")):
            chosen[samples["data_parallel_rank"]] = {
                "global_rank": record["rank"].get("global_rank"), "micro_batch": record.get("micro_batch"),
                "nonfinite_at": record.get("nonfinite_at"), **samples}
    return [chosen[dp_rank] for dp_rank in sorted(chosen)]


def rerun_finding(records: List[Dict[str, Any]]) -> Optional[RerunFinding]:
    """What the ``rerun`` records say (one step per launch); each record gives its replica's conclusion,
    and Megatron's own conclusion as that rank's state machine reached it."""
    reruns = [r for r in records if r.get("kind") == RecordKind.RERUN]
    if not reruns:
        return None
    step = min(r["step"] for r in reruns)
    at_step = sorted((r for r in reruns if r["step"] == step), key=lambda r: r["rank"].get("global_rank", -1))
    named = [r for r in at_step if r["role"] == RerunRole.ORIGIN]
    # among origins that tie (each went non-finite first on its rank), the one where a value grew out of
    # line first: under expert parallelism the expert that grew it lives on one rank, its output reaches
    # every rank through the token exchange
    origins = sorted(forward_origins(named), key=lambda r: not r.get("grew_in"))
    later_stages = {id(r) for r in named} - {id(r) for r in origins}
    first = origins[0] if origins else None
    # the origin's copy of the micro-batch: it marks where its output went non-finite (``nonfinite_at``)
    # else, where the loss went non-finite: the copy of a rank whose own loss did (expert parallelism
    # reruns several replicas together, each on its own data)
    own_loss_first = sorted(at_step, key=lambda r: loss_here_nonfinite(r.get("loss_here")) is not True)
    batch = next((r["batch"] for r in origins + own_loss_first if r.get("batch")), None)
    conclusions = _grouped(at_step, conclusion_of)
    megatron = _grouped(at_step, _megatron)
    strongest = conclusions[0]
    return RerunFinding(
        step=step, iteration=(first or at_step[0]).get("iteration"), trigger=at_step[0].get("trigger"),
        megatron=megatron[0].conclusion if megatron else None, conclusion=Conclusion(strongest.conclusion),
        concluded_by=strongest.ranks, own_failure=strongest.own_failure, conclusions=tuple(conclusions),
        megatron_split=tuple(megatron) if len(megatron) > 1 else (),
        module=first.get("module") if first else None, module_class=first.get("class") if first else None,
        rank=rank_view(first["rank"]) if first else None,
        micro_batch=first.get("micro_batch") if first else next(
            (r["micro_batch"] for r in at_step if r.get("micro_batch") is not None
             and conclusion_of(r).value == strongest.conclusion), None),
        output_abs_max=first.get("output_abs_max") if first else None,
        bundle=_bundle_of(origins),
        batch=batch["path"] if batch else None,
        origins=tuple({**rank_view(r["rank"]), "module": r.get("module"), "reduction": r.get("reduction")}
                      for r in origins),
        receivers=tuple({**rank_view(r["rank"]), "module": r.get("module")} for r in at_step
                        if r["role"] == RerunRole.RECEIVER or (id(r) in later_stages)),
        grew_in=_growth(at_step, first), samples=tuple(_failing_samples(at_step, strongest.ranks)),
        origins_absent=_origins_absent(at_step),
        losses_finite_here=tuple(sorted(r["rank"]["global_rank"] for r in at_step
                                        if isinstance(r["rank"].get("global_rank"), int)
                                        and loss_here_nonfinite(r.get("loss_here")) is False)),
        concluded_replicas=tuple(sorted({r["rank"]["dp"] for r in at_step if r["rank"].get("global_rank")
                                         in strongest.ranks and isinstance(r["rank"].get("dp"), int)})))


def _bundle_of(origins: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The capture of the call the text names (the first origin's): its own, else a tied origin's of the same
    module and call; never another call's, whose replay would answer another question."""
    if not origins:
        return None
    first = origins[0]
    return next((r["bundle"] for r in origins if r.get("bundle") and r.get("module") == first.get("module")
                 and r.get("call") == first.get("call")), None)


def _origins_absent(at_step: List[Dict[str, Any]]) -> Tuple[int, ...]:
    """The ranks the records name as their group's forward origin (``origin_rank``: under expert
    parallelism the origin is often on another data-parallel replica) that wrote no rerun record: the
    origin's own record, with its module, is not in the run directory."""
    present = {r["rank"].get("global_rank") for r in at_step}
    return tuple(sorted({r["origin_rank"] for r in at_step if r.get("origin_rank") is not None} - present))
