"""One launch's incident, decided once from every rank's files (pure: ``RunFiles`` in, ``Report`` out).

The first failing step is the earliest step with a failure record (``runs.failing_step``). Its origin is
decided by evidence, best first: where the in-place rerun of that step saw a forward value first go
non-finite; ranks whose LOCAL gradients were non-finite before the data-parallel collective
(``pre_reduction`` records); else, where every checked rank was clean before the collective, the ranks
holding non-finite gradients at the grad norm (the value arose after the collective); else, with no
pre-reduction check at all, the holders, marked unconfirmed. Where no rank held a non-finite gradient but
the norm overflowed from finite ones (exploding gradients), the ranks with the largest gradient: those that
held it before the data-parallel collective, else those whose own float32 sum of squares overflowed at the
norm, else the largest. Every other rank with a record at that step
only received it.

The verdict is decided in one place (``_decide_verdict``) from all of it: the gradients' pattern, the
rerun's conclusion and the self-tests of the origin's devices. Nothing changes a ``Report`` afterwards:
the text view, ``--json`` and the plot only render it (``gradnan.offline.report``, ``.plot``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..errors import InputError
from ..formats.incident import (
    INCIDENT_KINDS,
    NORM_KINDS,
    Action,
    Cause,
    Conclusion,
    GradientPass,
    OriginBasis,
    OwnFailure,
    RecordKind,
    RerunRole,
    health_evidence,
    health_signs,
    values,
)
from ..formats.layout import AXES, host_device, rank_label, rank_ranges, shown_axes
from ..formats.records import FORWARD_SHARE
from ..formats.schema import Schema
from ..formats.text import plain, untrusted
from .causes import BadWeight, Decision, Evidence, StateFault, decide
from .frames_view import frames_summary, probes_summary
from .read import RunFiles
from .runs import SERIOUS_SKIPS, failing_step, split_runs
from .runup import RankRunUp, RunUp, culprit_bucket, rank_runup
from .runup import decide_ranks as runup_finding

SCHEMA = Schema("gradnan.report", 2)
View = Dict[str, Any]  # a rank's coordinates as the report shows them (``rank_view``), plus what it holds


@dataclass(frozen=True)
class Verdict:
    """What most likely made the step non-finite, in one line, and the evidence that says so."""

    cause: Cause
    summary: str
    evidence: Tuple[str, ...]
    rule: str  # the rule of ``causes.RULES`` that decided it

    def to_json(self) -> Dict[str, Any]:
        return {"cause": self.cause.value, "rule": self.rule, "summary": self.summary,
                "evidence": list(self.evidence)}


@dataclass(frozen=True)
class Pattern:
    """Which pass the origin's gradients point at, and the first non-finite one in backward order."""

    gradient_pass: GradientPass
    share_nonfinite: Optional[float]
    first_in_backward: Optional[str]
    first_rank: Optional[int]

    def to_json(self) -> Dict[str, Any]:
        return {"pass": self.gradient_pass.value, "share_nonfinite": self.share_nonfinite,
                "first_in_backward": self.first_in_backward, "first_rank": self.first_rank}


@dataclass(frozen=True)
class Concluded:
    """One conclusion and the ranks whose rerun records reached it (whole replicas: a replica's ranks all
    agree), with what of those replicas' own failed (``own_failure``; transient only)."""

    conclusion: str
    ranks: Tuple[int, ...]
    own_failure: Optional[OwnFailure] = None

    def to_json(self) -> Dict[str, Any]:
        return {"conclusion": self.conclusion, "ranks": list(self.ranks),
                "own_failure": None if self.own_failure is None else self.own_failure.value}


@dataclass(frozen=True)
class RerunFinding:
    """What the in-place rerun of the failing step found: the forward origin (the earliest non-finite call
    on its tensor-parallel group; several only on a tie), the ranks that only received it, the strongest
    conclusion any replica reached and every other one (``conclusions``), Megatron's own conclusions
    where its ranks disagree (``megatron_split``: each rank's state machine concludes for itself), and
    ``grew_in``: where a value first grew out of line before it went non-finite (the magnitude path's
    culprit; the record's ``grew_in`` with its ``global_rank``)."""

    step: int
    iteration: Optional[int]
    trigger: Optional[str]
    megatron: Optional[str]
    conclusion: Conclusion
    concluded_by: Tuple[int, ...]
    own_failure: Optional[OwnFailure]
    conclusions: Tuple[Concluded, ...]
    megatron_split: Tuple[Concluded, ...]
    module: Optional[str]
    module_class: Optional[str]
    rank: Optional[View]
    micro_batch: Optional[int]
    output_abs_max: Any
    bundle: Optional[str]
    batch: Optional[str]
    origins: Tuple[View, ...]
    receivers: Tuple[View, ...]
    grew_in: Optional[Dict[str, Any]] = None
    samples: Tuple[Dict[str, Any], ...] = ()  # the failing micro-batch in the data, per replica

    @property
    def global_rank(self) -> Optional[int]:
        return None if self.rank is None else self.rank["global_rank"]

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "iteration": self.iteration, "trigger": self.trigger,
                "megatron": self.megatron, "conclusion": self.conclusion.value,
                "concluded_by": list(self.concluded_by),
                "own_failure": None if self.own_failure is None else self.own_failure.value,
                "conclusions": [group.to_json() for group in self.conclusions],
                "megatron_split": [group.to_json() for group in self.megatron_split],
                "module": self.module, "class": self.module_class, "global_rank": self.global_rank,
                "rank": self.rank, "micro_batch": self.micro_batch, "output_abs_max": self.output_abs_max,
                "bundle": self.bundle, "batch": self.batch, "origins": list(self.origins),
                "receivers": list(self.receivers), "grew_in": self.grew_in, "samples": list(self.samples)}


@dataclass(frozen=True)
class HealthReading:
    """NVML's reading of an origin rank's device at the failing step (its record's ``device_health``), and
    what in it points at the device (``signs``, ``formats.incident.health_signs``)."""

    rank: View
    nvml_device: Dict[str, Any]
    values: Dict[str, Any]
    unread: Dict[str, str]
    signs: Tuple[str, ...]

    def to_json(self) -> Dict[str, Any]:
        return {**self.rank, "nvml_device": self.nvml_device, "values": self.values, "unread": self.unread,
                "signs": list(self.signs)}


@dataclass(frozen=True)
class NextStep:
    """One thing to do about the verdict: what and why (``text``), and what to type (``command``, an
    argument list, or the option to add; None where there is nothing to type). A device to drain carries
    NVML's readings of it at the incident (``health``), where its ranks' records hold them."""

    action: Action
    text: str
    command: Optional[Tuple[str, ...]] = None
    health: Tuple[HealthReading, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        drained = ({"health": [reading.to_json() for reading in self.health]}
                   if self.action in (Action.DRAIN, Action.SELFTEST) else {})
        return {"action": self.action.value, "text": self.text,
                "command": None if self.command is None else list(self.command), **drained}


@dataclass(frozen=True)
class Incident:
    """The first failing step of a launch: who produced it, who received it, and the verdict."""

    step: int
    iteration: Optional[int]
    kinds: Tuple[str, ...]
    origin_basis: OriginBasis
    origin: Tuple[View, ...]  # each with ``kind``, ``params_total`` and its offending ``params``
    receivers: Tuple[View, ...]  # each with ``holds_nonfinite`` and the ``modules`` it holds them in
    silent: Tuple[View, ...]  # known ranks with no record at this step
    parameters: Tuple[Dict[str, Any], ...]  # the origin's offending parameters by module, backward order
    pattern: Pattern
    verdict: Verdict
    rerun: Optional[RerunFinding]
    capture_settings: Optional[Dict[str, str]]  # GRADNAN_CAPTURE_* to capture it on a rerun from a checkpoint
    next_steps: Tuple[NextStep, ...] = ()
    health: Tuple[HealthReading, ...] = ()  # the origin devices' NVML readings at the step, where recorded
    runup: Optional[RunUp] = None  # did the culprit's gradients grow first (None: no run-up was written)

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "iteration": self.iteration, "kinds": list(self.kinds),
                "origin_basis": self.origin_basis.value, "origin": list(self.origin),
                "receivers": list(self.receivers), "silent": list(self.silent),
                "parameters": list(self.parameters), "pattern": self.pattern.to_json(),
                "verdict": self.verdict.to_json(),
                "rerun": None if self.rerun is None else self.rerun.to_json(),
                "next": [step.to_json() for step in self.next_steps],
                "health": [reading.to_json() for reading in self.health],
                "runup": None if self.runup is None else self.runup.to_json()}


@dataclass(frozen=True)
class Report:
    """One launch of a run directory: its incident (None: no failure), and what else its files hold."""

    run_dir: str
    ranks_seen: Tuple[int, ...]
    problems: Tuple[str, ...]
    problems_total: int  # how many there were: ``problems`` holds the first ``read.MAX_PROBLEMS``
    run: Optional[str]
    runs: Tuple[Dict[str, Any], ...]  # every launch: ``run`` key, ``first_step``, ``ranks``
    incident: Optional[Incident]
    later_steps: Tuple[Dict[str, Any], ...]  # later steps with failure records, and their ranks
    loss_scale_overflow_steps: Tuple[int, ...]
    selftests: Tuple[Dict[str, Any], ...]
    bundles: Tuple[Dict[str, Any], ...]
    frames: Tuple[Dict[str, Any], ...]
    probes: Tuple[Dict[str, Any], ...]

    @property
    def first_step(self) -> Optional[int]:
        return None if self.incident is None else self.incident.step

    def to_json(self) -> Dict[str, Any]:
        """The ``gradnan.report`` document (docs/formats.md), what ``gradnan report --json`` prints."""
        incident = self.incident
        return plain({**SCHEMA.header(), "run_dir": self.run_dir, "ranks_seen": list(self.ranks_seen),
                "problems": list(self.problems),
                "problems_total": self.problems_total, "first_step": self.first_step,
                "incident": None if incident is None else incident.to_json(),
                "later_steps": list(self.later_steps),
                "loss_scale_overflow_steps": list(self.loss_scale_overflow_steps),
                "selftests": list(self.selftests), "bundles": list(self.bundles),
                "rerun_capture": None if incident is None else incident.capture_settings,
                "frames": list(self.frames), "probes": list(self.probes), "run": self.run,
                "runs": list(self.runs)})


def rank_view(coords: Dict[str, Any]) -> View:
    view = {"global_rank": coords.get("global_rank"), "host": coords.get("host"),
            "device": coords.get("device")}
    for axis in shown_axes(coords):
        view[axis] = coords.get(axis)
    view["dp_size"] = coords.get("dp_size")
    return view


def module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _known_ranks(files: RunFiles) -> Dict[int, Dict[str, Any]]:
    ranks: Dict[int, Dict[str, Any]] = {}
    for document in files.maps.values():
        ranks.setdefault(document["rank"]["global_rank"], document["rank"])
    for record in files.all_records():
        ranks.setdefault(record["rank"].get("global_rank"), record["rank"])
    return ranks


def _params_per_rank(files: RunFiles, ranks: Collection[Any]) -> Dict[int, int]:
    """The parameters these ranks' maps list (every optimizer's), by global rank."""
    counts: Dict[int, int] = {}
    for _, document in files.maps_of(ranks):
        rank = document["rank"]["global_rank"]
        counts[rank] = counts.get(rank, 0) + document["params_count"]
    return counts


def _backward_key(rank: Dict[str, Any], param: Dict[str, Any]):
    """Later pipeline stages and later-registered parameters come first in backward."""
    order = param.get("order")
    return (-(rank.get("pp") or 0), -(order if isinstance(order, int) else -1))


def _param_view(param: Dict[str, Any], dtype: Optional[str]) -> Dict[str, Any]:
    return {**{key: param.get(key) for key in ("id", "name", "kind", "nan", "inf", "first_bad_index",
                                               "abs_max_finite", "near_limit", "order", "copy")},
            "dtype": dtype}


def _param_dtypes(files: RunFiles, ranks: Collection[Any]) -> Dict[Tuple[Any, str], str]:
    """The model dtype of every parameter of these ranks' maps, by (global rank, name): the dtype whose
    limit a gradient's largest finite magnitude is measured against (``near_limit``; the plot's line)."""
    dtypes: Dict[Tuple[Any, str], str] = {}
    for path, document in files.maps_of(ranks):
        rank = document["rank"]["global_rank"]
        dtypes.update(((rank, param["name"]), param["dtype"])
                      for param in files.params_of_map(path, document) if isinstance(param.get("dtype"), str))
    return dtypes


def _rank_entry(record: Dict[str, Any], dtypes: Dict[Tuple[Any, str], str]) -> View:
    params = sorted(record["params"], key=lambda p: _backward_key(record["rank"], p))
    rank = record["rank"].get("global_rank")
    entry = {**rank_view(record["rank"]), "kind": record["kind"],
             "params_total": record.get("params_total", len(params)),
             "params": [_param_view(p, dtypes.get((rank, p["name"]))) for p in params]}
    if record.get("largest_grad"):
        entry["largest_grad"] = record["largest_grad"]
    if record.get("optimizer_state"):
        entry["optimizer_state"] = record["optimizer_state"]
    return entry


def _receiver(view: View, params: Sequence[Dict[str, Any]]) -> View:
    """A rank that received the value: its coordinates (``view``, a new one: added to, not copied, for
    each of 131,072 ranks), and the modules its own gradients went bad in."""
    view["holds_nonfinite"] = bool(params)
    view["modules"] = sorted({module_of(param["name"]) for param in params})
    return view


def _parameters_by_module(entries: Sequence[View]) -> List[Dict[str, Any]]:
    """Offending parameters across the given ranks, grouped by module, modules in backward order; each
    parameter's ``nan`` and ``inf`` are the counts on ``ranks[0]``, the lowest rank holding it (a count
    summed over ranks would exceed the tensor)."""
    modules: Dict[str, Dict[str, Any]] = {}
    keyed = sorted(((_backward_key(e, p), e["global_rank"], p) for e in entries for p in e["params"]),
                   key=lambda item: item[0])
    for _, rank, param in keyed:
        module = modules.setdefault(module_of(param["name"]),
                                    {"module": module_of(param["name"]), "params": {}})
        entry = module["params"].setdefault(param["name"], {"name": param["name"], "ranks": [], "nan": 0,
                                                            "inf": 0, "near_limit": False})
        entry["ranks"].append(rank)
        if len(entry["ranks"]) == 1:
            entry["nan"], entry["inf"] = param["nan"], param["inf"]
        entry["near_limit"] = entry["near_limit"] or bool(param.get("near_limit"))
    return [{"module": m["module"], "params": list(m["params"].values())} for m in modules.values()]


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


def _gradient_origin(at_step: List[Dict[str, Any]]) -> Tuple[OriginBasis, List[Dict[str, Any]]]:
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


def _pattern(origin: Sequence[View], params_per_rank: Dict[int, int]) -> Pattern:
    """Forward: (nearly) every gradient on the origin rank is bad, so the loss or an activation already
    was. Backward: only some are; the first in backward order is where it started."""
    # a distributed optimizer's map lists the parameters of its shard, a record every one it checked
    shares = [min(1.0, entry["params_total"] / params_per_rank[entry["global_rank"]])
              for entry in origin if params_per_rank.get(entry["global_rank"])]
    if shares and min(shares) >= FORWARD_SHARE:
        return Pattern(GradientPass.FORWARD, min(shares), None, None)
    firsts = [(_backward_key(entry, entry["params"][0]), entry["params"][0]["name"], entry["global_rank"])
              for entry in origin if entry["params"]]
    _, first, first_rank = min(firsts) if firsts else (None, None, None)
    return Pattern(GradientPass.BACKWARD if shares else GradientPass.UNKNOWN,
                   min(shares) if shares else None, first, first_rank)


def _grouped(records: Sequence[Dict[str, Any]], key: str, order: Sequence[str]) -> List[Concluded]:
    """The records' ranks grouped by the value of ``key``, in ``order`` (strongest first)."""
    groups: Dict[str, List[int]] = {}
    own: Dict[str, Optional[OwnFailure]] = {}
    for record in records:
        value = record.get(key)
        if value is not None:
            groups.setdefault(value, []).append(record["rank"].get("global_rank"))
            if record.get("own_failure") and value == Conclusion.TRANSIENT:
                own.setdefault(value, OwnFailure(record["own_failure"]))
    return [Concluded(value, tuple(groups[value]), own.get(value)) for value in order if value in groups]


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


def _earliest_stages(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Of the ranks a rerun named as origins, those of each data-parallel replica's earliest pipeline
    stage: a forward value flows from the first stage to the last, so a later stage that went non-finite
    too received it (a stage's input arrives through the point-to-point exchange, not as an argument its
    hooks see)."""
    def stage(record: Dict[str, Any]) -> int:
        return record["rank"].get("pp") or 0

    earliest: Dict[Any, int] = {}
    for record in records:
        replica = record["rank"].get("dp")
        earliest[replica] = min(earliest.get(replica, stage(record)), stage(record))
    return [record for record in records if stage(record) == earliest[record["rank"].get("dp")]]


def _rerun_finding(records: List[Dict[str, Any]]) -> Optional[RerunFinding]:
    """What the ``rerun`` records say (one step per launch); each record gives its replica's conclusion,
    and Megatron's own conclusion as that rank's state machine reached it."""
    reruns = [r for r in records if r.get("kind") == RecordKind.RERUN]
    if not reruns:
        return None
    step = min(r["step"] for r in reruns)
    at_step = sorted((r for r in reruns if r["step"] == step), key=lambda r: r["rank"].get("global_rank", -1))
    named = [r for r in at_step if r["role"] == RerunRole.ORIGIN]
    origins = _earliest_stages(named)
    later_stages = {id(r) for r in named} - {id(r) for r in origins}
    first = origins[0] if origins else None
    # the origin's copy of the micro-batch: it marks where its output went non-finite (``nonfinite_at``)
    batch = next((r["batch"] for r in origins + at_step if r.get("batch")), None)
    conclusions = _grouped(at_step, "conclusion", values(Conclusion))
    megatron = _grouped(at_step, "megatron", values(Conclusion))
    strongest = conclusions[0]
    return RerunFinding(
        step=step, iteration=(first or at_step[0]).get("iteration"), trigger=at_step[0].get("trigger"),
        megatron=megatron[0].conclusion if megatron else None, conclusion=Conclusion(strongest.conclusion),
        concluded_by=strongest.ranks, own_failure=strongest.own_failure, conclusions=tuple(conclusions),
        megatron_split=tuple(megatron) if len(megatron) > 1 else (),
        module=first["module"] if first else None, module_class=first["class"] if first else None,
        rank=rank_view(first["rank"]) if first else None,
        micro_batch=first["micro_batch"] if first else next(
            (r["micro_batch"] for r in at_step if r.get("micro_batch") is not None
             and r["conclusion"] == strongest.conclusion), None),
        output_abs_max=first.get("output_abs_max") if first else None,
        bundle=next((r["bundle"] for r in origins if r.get("bundle")), None),
        batch=batch["path"] if batch else None,
        origins=tuple({**rank_view(r["rank"]), "module": r["module"], "reduction": r.get("reduction")}
                      for r in origins),
        receivers=tuple({**rank_view(r["rank"]), "module": r["module"]} for r in at_step
                        if r["role"] == RerunRole.RECEIVER or (id(r) in later_stages)),
        grew_in=_growth(at_step, first), samples=tuple(_failing_samples(at_step, strongest.ranks)))


def _rejected_entries(losses: List[Dict[str, Any]]) -> List[View]:
    """Losses Megatron's check rejected before any gradient existed (it raised in the loss function)."""
    return [{**rank_view(r["rank"]), "kind": r["kind"], "params_total": 0, "params": [],
             "micro_batch": r.get("micro_batch"), "loss": r.get("loss")} for r in losses]


def _selftest_evidence(origin: Sequence[View], selftests: Sequence[Dict[str, Any]]) -> List[str]:
    """What self-tests in the run directory say about the origin's devices."""
    devices = {(entry.get("host"), entry.get("device")) for entry in origin}
    evidence = []
    for result in selftests:
        failed_here = [entry for entry in result["failing_ranks"]
                       if (entry["host"], entry["device"]) in devices]
        if failed_here:
            named = ", ".join(f"rank {e['rank']} ({host_device(e)})" for e in failed_here)
            evidence.append(f"self-test {result['time']} FAILED on the origin's device: {named}")
        elif result["pass"]:
            evidence.append(f"self-test {result['time']} passed on all {result['world_size']} ranks: no"
                            " persistent device fault seen (a transient one, or the data, remain)")
    return evidence


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


def _health_evidence(readings: Sequence[HealthReading]) -> List[str]:
    """What NVML said of the origin's devices at the incident."""
    return [health_evidence(f"{host_device(reading.rank)} (rank"
                            f" {reading.rank['global_rank']})", reading.signs, len(reading.unread))
            for reading in readings]


def _capture_settings(pattern: Pattern, origin: Sequence[View], step: int,
                      iteration: Optional[int]) -> Optional[Dict[str, str]]:
    """The GRADNAN_CAPTURE_* settings that capture the failing step's implicated module on the origin
    ranks when the job is rerun from a checkpoint (step filters use Megatron-LM's iteration where its
    loop ran, else steps count from the launch that is rerun)."""
    if not pattern.first_in_backward or not origin:
        return None
    return {"GRADNAN_CAPTURE_MODULES": module_of(pattern.first_in_backward),
            "GRADNAN_CAPTURE_STEPS": str(iteration if isinstance(iteration, int) else step),
            "GRADNAN_CAPTURE_RANKS": ",".join(str(e["global_rank"]) for e in origin)}


MAX_DRAINED = 8  # devices named to drain, at most (a hardware verdict names one replica's few devices)


def _state_records(files: RunFiles, launch: List[Dict[str, Any]], step: int) -> List[Dict[str, Any]]:
    """The weights and optimizer state the ranks read at the run's first incident: the ``state`` records
    of the first step at or after the failing one that has any (a run of fp16 skips, which apply no update,
    becomes an incident a few steps after the step the report starts from). A rank whose first incident
    came later read weights another update had changed: not comparable, left out."""
    first = min((record["step"] for record in launch if record.get("kind") == RecordKind.STATE
                 and record["step"] >= step), default=None)
    chosen = {record["rank"].get("global_rank"): record for record in launch
              if record.get("kind") == RecordKind.STATE and record["step"] == first}
    return [files.full(chosen[rank]) for rank in sorted(chosen, key=lambda rank: (rank is None, rank or 0))]


def _lone_weights(states: Sequence[Dict[str, Any]], at_step: Sequence[Dict[str, Any]]) -> Tuple[int, ...]:
    """The ranks holding a non-finite weight that a data-parallel peer (equal coordinates but ``dp``) holds
    finite (its own ``state`` record says so), or whose peer's forward pass was finite at that step (an
    fp16 skip recorded with a finite loss: a replica that did not fail reads no state): that replica's
    copy went bad alone."""
    bad = {record["rank"].get("global_rank"): {p["name"] for p in record["params"]} for record in states}
    peers: Dict[Tuple[Any, ...], List[Any]] = {}
    for record in states:
        peers.setdefault(_peer_key(record["rank"]), []).append(record["rank"].get("global_rank"))
    finite_forward = {_peer_key(r["rank"]) for r in at_step
                      if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW and r.get("loss_finite") is True}
    lone = set()
    for key, group in peers.items():
        for rank in group:
            if bad[rank] and (key in finite_forward or any(
                    name not in bad[peer] for peer in group if peer != rank for name in bad[rank])):
                lone.add(rank)
    return tuple(sorted(lone))


def _peer_key(coords: Dict[str, Any]) -> Tuple[Any, ...]:
    """What data-parallel peers share: every coordinate but ``dp``."""
    return tuple(coords.get(axis) for axis in AXES if axis != "dp")


def replica_digests(states: Sequence[Dict[str, Any]]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Data-parallel peers (equal coordinates but ``dp``) compared by their weights' digests: the ranks
    whose digest differs from a strict majority's (``odd``), and the ranks of groups that differ with no
    majority (``split``, e.g. two replicas)."""
    groups: Dict[Tuple[Any, ...], Dict[str, List[int]]] = {}
    for record in states:
        coords = record["rank"]
        digests = groups.setdefault(_peer_key(coords), {})
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


def _recurs(at_step: Sequence[Dict[str, Any]], launch: Sequence[Dict[str, Any]], step: int) -> bool:
    """An fp16 overflow that fails again at the next step, where no update was applied in between: the same
    numerics, other data."""
    return (any(r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW for r in at_step)
            and any(r.get("kind") == RecordKind.LOSS_SCALE_OVERFLOW and r["step"] == step + 1
                    for r in launch))


def _loss_ranks(rerun: RerunFinding, ranks: Dict[int, Dict[str, Any]]) -> Tuple[int, ...]:
    """Every rank of the last pipeline stage (which computes the loss) of the replicas whose loss was
    non-finite again from finite outputs: the tensor-parallel ranks there compute the same loss, whether
    or not they wrote a record (one whose data iterator gave nothing keeps no micro-batch)."""
    def coordinate(rank: Any, axis: str) -> Any:
        return (ranks.get(rank) or {}).get(axis)

    replicas = {coordinate(rank, "dp") for rank in rerun.concluded_by}
    last = max((coordinate(rank, "pp") or 0 for rank in ranks if coordinate(rank, "dp") in replicas),
               default=0)
    return tuple(sorted(rank for rank in ranks if coordinate(rank, "dp") in replicas
                        and (coordinate(rank, "pp") or 0) == last))


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


def evidence_of(step: int, iteration: Optional[int], ranks: Dict[int, Dict[str, Any]],
                states: Sequence[Dict[str, Any]], gradient: Tuple[OriginBasis, Sequence[View]],
                pattern: Pattern, rerun: Optional[RerunFinding], at_step: Sequence[Dict[str, Any]],
                recurs: bool, iterations_seen: Tuple[int, ...] = ()) -> Evidence:
    """The typed facts the rules decide on, from the failing step's records."""
    basis, origin = gradient
    odd, split = replica_digests(states)
    weights = tuple(BadWeight(record["rank"].get("global_rank"), p["name"], p.get("copy", "model"),
                              tuple(p.get("first_bad_index") or ()), p["nan"], p["inf"])
                    for record in states for p in record["params"])
    faults = tuple(StateFault(record["rank"].get("global_rank"), f["name"], f["state"], f["nan"], f["inf"],
                              f["negative"]) for record in states for f in record["optimizer_state"])
    losses = [r for r in at_step if r["kind"] == RecordKind.NONFINITE_LOSS]
    conclusion = rerun.conclusion if rerun is not None else None
    reduction_fault = rerun is not None and any(view.get("reduction") == "collective"
                                                for view in rerun.origins)
    rerun_origins = (_loss_ranks(rerun, ranks) if rerun is not None and conclusion is Conclusion.LOSS else
                     tuple(view["global_rank"] for view in rerun.origins) if rerun is not None else ())
    largest = next((entry["largest_grad"] for entry in origin if entry.get("largest_grad")), None)
    return Evidence(
        step=step, iteration=iteration, iterations_seen=iterations_seen,
        labels=RankLabels(ranks),
        dp_size=max((entry.get("dp_size") or 1 for entry in origin), default=1),
        states_read=tuple(record["rank"].get("global_rank") for record in states),
        launch_first_step=step == 1 or any(record.get("launch_weights_finite") is False for record in states),
        bad_weights=weights, state_faults=faults, lone_weights=_lone_weights(states, at_step),
        odd_replicas=odd,
        split_replicas=split, rerun=conclusion,
        rerun_module=rerun.module if rerun is not None else None,
        rerun_class=rerun.module_class if rerun is not None else None, rerun_origins=rerun_origins,
        rerun_concluded_by=rerun.concluded_by if rerun is not None else (),
        own_failure=rerun.own_failure if rerun is not None else None,
        micro_batch=rerun.micro_batch if rerun is not None else None, reduction_fault=reduction_fault,
        grew_in=rerun.grew_in if rerun is not None else None,
        gradient_basis=basis, gradient_origin=tuple(entry["global_rank"] for entry in origin),
        origin_replicas=tuple(sorted({entry["dp"] for entry in origin if isinstance(entry.get("dp"), int)})),
        forward_pattern=pattern.gradient_pass is GradientPass.FORWARD,
        share_nonfinite=pattern.share_nonfinite,
        first_in_backward=pattern.first_in_backward, first_rank=pattern.first_rank,
        near_limit=any(p.get("near_limit") for entry in origin for p in entry["params"]),
        recorded_norm=bool(at_step), largest_grad=largest,
        largest_before_collective=any(entry["kind"] == RecordKind.PRE_REDUCTION for entry in origin
                                      if entry.get("largest_grad")),
        rejected_losses=tuple(r["rank"].get("global_rank") for r in losses),
        rejected=({"global_rank": losses[0]["rank"].get("global_rank"),
                   "micro_batch": losses[0].get("micro_batch"),
                   "loss": losses[0].get("loss"), "rerun_skipped": losses[0].get("rerun_skipped"),
                   "batch": next((r["batch"]["path"] for r in losses if r.get("batch")),
                                 rerun.batch if rerun is not None else None)} if losses else None),
        recurs=recurs)


def _evidence_lines(e: Evidence) -> List[str]:
    """What the decision rests on, fact by fact (none of them a competing verdict)."""
    lines = []
    if e.states_read:
        weights = (f"non-finite on rank(s) {rank_ranges(sorted({w.rank for w in e.bad_weights}))}"
                   if e.bad_weights else "every one finite")
        state = (f"bad on rank(s) {rank_ranges(sorted({f.rank for f in e.state_faults}))}" if e.state_faults
                 else "finite")
        replicas = ("equal across data-parallel replicas" if not (e.odd_replicas or e.split_replicas) else
                    f"unlike their peers' on rank(s) {rank_ranges(list(e.odd_replicas or e.split_replicas))}")
        lines.append(f"weights when the step began (read on {len(e.states_read)} rank(s)): {weights};"
                     f" optimizer state {state}; weights {replicas}")
    if e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE:
        lines.append("own gradients non-finite before the data-parallel collective on rank(s)"
                     f" {rank_ranges(list(e.gradient_origin))}")
    elif e.gradient_basis is OriginBasis.AFTER_COLLECTIVE:
        lines.append("every rank's own gradients were finite before the data-parallel collective")
    if e.forward_pattern and e.share_nonfinite is not None:
        lines.append(f"{e.share_nonfinite:.0%} of the origin's gradients are non-finite (what a non-finite"
                     " activation or loss does in backward)")
    elif e.first_in_backward:
        lines.append(f"first non-finite gradient in backward order: {untrusted(e.first_in_backward)} on rank"
                     f" {e.first_rank}")
    if e.near_limit:
        lines.append("the largest finite gradient values are near the dtype's limit (overflow)")
    if e.rejected:
        lines.append("Megatron's loss check rejected a non-finite loss"
                     f" ({untrusted(e.rejected['loss'])}) on rank {e.rejected['global_rank']}, micro-batch"
                     f" {e.rejected['micro_batch']}, and raised (--rerun-mode disabled)")
    if e.recurs:
        lines.append("the next step overflowed too, with no update applied in between: the numerics, not one"
                     " batch")
    return lines


def _origin_entries(decision: Decision, gradient_origin: Sequence[View], states: Sequence[Dict[str, Any]],
                    rejected: Sequence[View], reruns: Sequence[Dict[str, Any]],
                    dtypes: Dict[Tuple[Any, str], str]) -> List[View]:
    """The decision's origin ranks, each with what it is named for: its offending gradients, its bad weights
    (a ``state`` record's params), its rejected loss, what of its replica's own failed (its ``rerun``
    record), or its coordinates alone."""
    by_rank: Dict[Any, View] = {r["rank"].get("global_rank"): {
        **rank_view(r["rank"]), "kind": r["kind"], "params_total": 0, "params": [],
        "own_failure": r.get("own_failure")} for r in reruns}
    by_rank.update((entry["global_rank"], entry) for entry in rejected)
    if decision.basis is OriginBasis.STATE:
        by_rank.update((record["rank"].get("global_rank"), _rank_entry(record, dtypes)) for record in states)
    else:
        by_rank.update((entry["global_rank"], entry) for entry in gradient_origin)
    return [by_rank.get(rank) or {"global_rank": rank, "kind": None, "params_total": 0, "params": []}
            for rank in decision.origin]


def _next_steps(decision: Decision, e: Evidence, rerun: Optional[RerunFinding], origin: Sequence[View],
                ranks: Dict[int, Dict[str, Any]], run_dir: str, health: Sequence[HealthReading],
                capture: Optional[Dict[str, str]], captured: Optional[str]) -> List[NextStep]:
    """What the cause calls for, every cause at least one step. ``captured``: a bundle of the origin's
    first bad gradient's module on an origin rank, where capture took one after the detection."""
    cause, steps = decision.cause, []
    devices = list(dict.fromkeys((entry.get("host"), entry.get("device")) for entry in origin))[:MAX_DRAINED]
    if cause is Cause.DEVICE:
        for host, device in devices:
            named = [entry["global_rank"] for entry in origin if (entry.get("host"), entry.get("device"))
                     == (host, device)]
            steps.append(NextStep(Action.DRAIN, Action.DRAIN.wording(
                f"{host_device({'host': host, 'device': device})}"
                f" (rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))})"),
                health=tuple(reading for reading in health if reading.rank["global_rank"] in named)))
    if cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE):
        steps.append(NextStep(Action.RESUME, Action.RESUME.wording(_resume_before(e, cause))))
    if cause is Cause.COLLECTIVE:
        hosts = ", ".join(dict.fromkeys(str(host) for host, _ in devices)) or "the ranks named"
        steps.append(NextStep(Action.CHECK_INTERCONNECT, Action.CHECK_INTERCONNECT.wording(hosts)))
    if cause is Cause.LOSS:
        steps.append(NextStep(Action.FIX_LOSS, Action.FIX_LOSS.wording(f"micro-batch {e.micro_batch}")))
    if cause in (Cause.NORM_OVERFLOW,) or (cause is Cause.FORWARD_OP and e.recurs):
        steps.append(NextStep(Action.TUNE_NUMERICS, Action.TUNE_NUMERICS.wording(
            "a lower learning rate, a tighter --clip-grad, bf16 instead of fp16, or a lower"
            " --initial-loss-scale; skipping the iteration cannot help where every step fails")))
    batch = rerun.batch if rerun is not None else (e.rejected or {}).get("batch")
    if cause in (Cause.FORWARD_OP, Cause.LOSS) and batch:
        steps.append(NextStep(Action.INSPECT_BATCH,
                              Action.INSPECT_BATCH.wording(f"micro-batch {e.micro_batch}"),
                              ("gradnan", "batch", batch)))
    if cause in (Cause.FORWARD_OP, Cause.LOSS) and e.iterations_seen and not e.recurs and rerun is not None:
        refusal = _skip_refusal(e)
        # a checkpoint written by Megatron's own validate_results exit runs the iteration again on restart,
        # then exits (17) rather than skipping it: that restart goes without the rerun state machine
        restarted_rerun = ("--rerun-mode", "disabled") if rerun.megatron else ()
        steps.append(NextStep(Action.SKIP_ITERATION, f"no --iterations-to-skip option: {refusal}")
                     if refusal or e.iteration is None else
                     NextStep(Action.SKIP_ITERATION, Action.SKIP_ITERATION.wording(str(e.iteration)),
                              ("--iterations-to-skip", str(e.iteration - 1), *restarted_rerun)))
    if rerun is not None and rerun.bundle and cause is Cause.FORWARD_OP:
        steps.append(NextStep(Action.REPLAY,
                              Action.REPLAY.wording(f"{untrusted(rerun.module)} on rank {rerun.global_rank}"),
                              ("gradnan", "replay", rerun.bundle)))
    if cause is Cause.BACKWARD_OP and captured:
        steps.append(NextStep(Action.REPLAY, Action.REPLAY.wording(module_of(e.first_in_backward or "")),
                              ("gradnan", "replay", captured)))
    elif cause is Cause.BACKWARD_OP and capture:
        modules = untrusted(capture["GRADNAN_CAPTURE_MODULES"])
        steps.append(NextStep(Action.CAPTURE, Action.CAPTURE.wording(modules)))
    if cause in (Cause.DEVICE, Cause.COLLECTIVE, Cause.BACKWARD_OP) or (
            cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE) and not e.launch_first_step):
        drained = cause is Cause.DEVICE  # NVML's readings are printed beside the drain, else the self-test
        for host in dict.fromkeys(host for host, _ in devices):
            processes = sum(1 for coords in ranks.values() if coords.get("host") == host) or 1
            steps.append(NextStep(Action.SELFTEST, Action.SELFTEST.wording(f"{untrusted(host)}'s devices"), (
                "torchrun", f"--nproc_per_node={processes}", "-m", "gradnan", "selftest", "--out", run_dir),
                health=() if drained else tuple(reading for reading in health
                                                if reading.rank.get("host") == host)))
    if cause is Cause.UNDETERMINED:
        steps.append(NextStep(Action.DECIDE, Action.DECIDE.wording(_DECIDERS.get(decision.rule, _DECIDER))))
    steps += [NextStep(Action.BISECT, Action.BISECT.wording("torch, megatron-core, TE"), (
        *step.command, "--against", "OLD_STACK/bin/python", "--against", "NEW_STACK/bin/python"))
        for step in list(steps) if step.action is Action.REPLAY and step.command]
    return steps


def _resume_before(e: Evidence, cause: Cause) -> str:
    """The point a restart must go back before: the checkpoint the launch resumed from (Megatron-LM's
    iteration before its first where the loop gives it), the update that wrote the weights, or the step."""
    if e.launch_first_step and cause is Cause.WEIGHTS:
        resumed = "" if e.iteration is None else f" (iteration {e.iteration - e.step})"
        return (f"the checkpoint this launch resumed from{resumed}, which holds them (Megatron-LM: --load a"
                " directory whose latest_checkpointed_iteration.txt names the earlier one)")
    if cause is Cause.OPTIMIZER_UPDATE:
        when = f"step {e.step - 1}" + ("" if e.iteration is None else f" (iteration {e.iteration - 1})")
        return f"the update of {when}, which wrote them"
    return f"step {e.step}" + ("" if e.iteration is None else f" (iteration {e.iteration})")


_DECIDER = ("run a self-test on the origin's node and replay the captured step on another device, or rerun"
            " from the last checkpoint with gradnan's defaults")
_DECIDERS = {
    "forward_not_rerun": "rerun from the last checkpoint with rerun='auto' (the default) so the failing step"
                         " is run again in place and its forward operator named",
    "rejected_loss": "replay the kept micro-batch, or rerun with --rerun-mode validate_results",
    "unconfirmed_holders": "rerun from the last checkpoint with pre_reduction='deferred' (the default)",
}


def _counted(iteration: Any) -> bool:
    return isinstance(iteration, int) and not isinstance(iteration, bool)


def _iterations(at_step: Sequence[Dict[str, Any]], rerun: Optional[RerunFinding],
                step: int) -> Tuple[int, ...]:
    """Every Megatron-LM iteration the failing step's records (its incident and ``rerun`` records) and its
    rerun's origin name (one where they agree)."""
    named: List[Any] = [r.get("iteration") for r in at_step]
    if rerun is not None and rerun.step == step:
        named.append(rerun.iteration)
    return tuple(sorted({int(iteration) for iteration in named if _counted(iteration)}))


def _skip_refusal(e: Evidence) -> Optional[str]:
    """Why the failing iteration cannot be named to ``--iterations-to-skip`` (None: it can)."""
    if len(e.iterations_seen) > 1:
        seen = ", ".join(map(str, e.iterations_seen))
        return (f"the ranks' records disagree on the failing iteration ({seen}); read it from Megatron-LM's"
                " log before skipping one")
    if e.iteration is None or e.iteration < 1:
        return f"the records name iteration {e.iteration}, and Megatron-LM counts its iterations from 1"
    return None


def _incident(files: RunFiles, step: int, at_step: List[Dict[str, Any]], launch: List[Dict[str, Any]],
              ranks: Dict[int, Dict[str, Any]], selftests: Sequence[Dict[str, Any]]) -> Incident:
    """``at_step``: the step's incident records; none where Megatron's validation ran the step again and
    exited before any norm (only ``rerun`` records then)."""
    gradient_basis, origin_records = _gradient_origin(at_step)
    states = _state_records(files, launch, step)
    dtypes = _param_dtypes(files, {r["rank"].get("global_rank") for r in origin_records + states})
    gradient_origin = [_rank_entry(r, dtypes) for r in origin_records]
    pattern = _pattern(gradient_origin,
                       _params_per_rank(files, {entry["global_rank"] for entry in gradient_origin}))
    rerun = _rerun_finding(launch)
    reruns_here = [r for r in launch if r.get("kind") == RecordKind.RERUN and r["step"] == step]
    iterations = _iterations(list(at_step) + reruns_here, rerun, step)
    iteration = (rerun.iteration if rerun is not None and rerun.step == step and _counted(rerun.iteration)
                 else iterations[0] if iterations else None)
    evidence = evidence_of(step, iteration, ranks, states, (gradient_basis, gradient_origin), pattern,
                           rerun, at_step, _recurs(at_step, launch, step), iterations)
    decision = decide(evidence)
    rejected = _rejected_entries([r for r in at_step if r["kind"] == RecordKind.NONFINITE_LOSS])
    origin = _origin_entries(decision, gradient_origin, states, rejected, reruns_here, dtypes)
    named = {entry["global_rank"] for entry in origin}
    # the table's counts are those of the first rank holding each parameter: the decided origin's first
    parameters = _parameters_by_module(sorted(gradient_origin,
                                              key=lambda entry: entry["global_rank"] not in named))
    receivers = [_receiver(rank_view(r["rank"]), r["params"]) for r in at_step
                 if r["kind"] in NORM_KINDS and r["rank"].get("global_rank") not in named]
    listed = named | {view["global_rank"] for view in receivers}
    receivers += [_receiver({key: value for key, value in entry.items()
                             if key not in ("params", "params_total", "kind", "largest_grad")},
                            entry["params"])
                  for entry in gradient_origin if entry["global_rank"] not in listed]
    recorded = {r["rank"].get("global_rank") for r in at_step + reruns_here + states}
    health = health_readings(at_step, origin)
    verdict = Verdict(decision.cause, decision.summary, tuple(
        _evidence_lines(evidence) + _selftest_evidence(origin, selftests) + _health_evidence(health)),
        decision.rule)
    capture = _capture_settings(pattern, origin, step, iteration)
    captured = next((str(path) for path, doc in sorted(files.bundles.items())
                     if capture and doc["module"]["path"] == capture["GRADNAN_CAPTURE_MODULES"]
                     and doc["rank"]["global_rank"] in named and doc["step"] >= step), None)
    return Incident(
        step=step, iteration=iteration,
        kinds=tuple(sorted({r["kind"] for r in at_step})) or (RecordKind.RERUN.value,),
        origin_basis=decision.basis, origin=tuple(origin),
        receivers=tuple(sorted(receivers, key=lambda view: view["global_rank"])),
        silent=tuple(rank_view(ranks[rank]) for rank in sorted(ranks) if rank not in recorded),
        parameters=tuple(parameters), pattern=pattern,
        verdict=verdict, rerun=rerun, capture_settings=capture,
        next_steps=tuple(_next_steps(decision, evidence, rerun, origin, ranks, str(files.run_dir), health,
                                     capture, captured)),
        health=tuple(health),
        runup=_runup(files, launch, step, _culprit_parameter(pattern, gradient_origin, origin, rerun,
                                                             decision.cause)))


def _culprit_parameter(pattern: Pattern, gradients: Sequence[View], origin: Sequence[View],
                       rerun: Optional[RerunFinding], cause: Cause) -> Optional[str]:
    """The parameter whose run-up is read, on the decided origin: a bad weight it is named for; for a
    forward operator, the origin's first offending parameter inside the module that grew or went
    non-finite; the first non-finite gradient in backward order where that is on the origin; its largest
    gradient (a norm overflow from finite ones); else the origin's first offending parameter."""
    named = {entry["global_rank"] for entry in origin}
    if origin and origin[0].get("kind") == RecordKind.STATE and origin[0]["params"]:
        return origin[0]["params"][0]["name"]
    params = [param["name"] for entry in gradients if entry["global_rank"] in named
              for param in entry["params"]]
    if cause is Cause.FORWARD_OP and rerun is not None:
        modules = [module for module in ((rerun.grew_in or {}).get("module"), rerun.module) if module]
        inside = [name for module in modules for name in params if name.startswith(module + ".")]
        if inside:
            return inside[0]
    if pattern.first_in_backward and pattern.first_rank in named:
        return pattern.first_in_backward
    largest = [entry["largest_grad"]["name"] for entry in origin if entry.get("largest_grad")]
    return (largest or params or [pattern.first_in_backward])[0]


def _run_key(document: Dict[str, Any]) -> str:
    """The launch a document names, as a hashable key (a file may hold any JSON value in ``run``)."""
    run = document.get("run")
    return json.dumps(run, sort_keys=True) if isinstance(run, dict) else ""


def _runup(files: RunFiles, launch: List[Dict[str, Any]], step: int,
           parameter: Optional[str]) -> Optional[RunUp]:
    """The run-up finding from this launch's run-up files (a file names its launch as every record does):
    each rank's first at or after the failing ``step`` of those whose buckets hold ``parameter`` (a run of
    fp16 skips writes it where the run became an incident, a few steps after the one the report starts
    from; the rule reads the rows up to ``step``); None where no rank wrote one. Only the files that can
    name the parameter are parsed (``RunFiles.runups_naming``); every one only where none holds it."""
    launches = {_run_key(record) for record in launch}

    def first_per_rank(documents: Iterator[Tuple[Path, Dict[str, Any]]]) -> List[Optional[RankRunUp]]:
        """The rule on each rank's first run-up at or after ``step`` in this launch, in one pass: a
        rank's groups are not kept."""
        first: Dict[Any, Tuple[int, str, Optional[RankRunUp]]] = {}
        for path, doc in documents:
            rank = doc["rank"]["global_rank"]
            if doc["step"] >= step and _run_key(doc) in launches and (
                    rank not in first or (doc["step"], str(path)) < first[rank][:2]):
                found = None if parameter is None else rank_runup(doc, doc["groups"], parameter, step)
                first[rank] = (doc["step"], str(path), found)
        return [found for _, _, found in first.values()]

    found = [] if parameter is None else first_per_rank(
        (path, doc) for path, doc in files.runups_naming(parameter)
        if culprit_bucket(doc["groups"], parameter))
    if not found:  # none names the parameter (or none is named): did any rank write one, to say so?
        found = first_per_rank(files.all_runups())
    return runup_finding(found, parameter, step) if found else None


def _marks_failure(record: Dict[str, Any]) -> bool:
    """An incident record, or a ``rerun`` record: written only at an incident, it is the only record of one
    where Megatron's validation ran the step again and exited before the grad norm."""
    return record.get("kind") in INCIDENT_KINDS or record.get("kind") == RecordKind.RERUN


def analyze(files: RunFiles, serious_skips: int = SERIOUS_SKIPS, run: Optional[str] = None) -> Report:
    """The report of one launch: ``run`` (a key of ``runs.split_runs``), else the latest launch with a
    failure, else the latest launch."""
    ranks = _known_ranks(files)
    runs = split_runs(files.all_records())
    if run is not None and run not in runs:
        raise InputError(f"{files.run_dir}: no run {run!r} (runs: {', '.join(runs) or 'none'})")
    failing = {key: failing_step([r for r in records if _marks_failure(r)], serious_skips)
               for key, records in runs.items()}
    chosen = run or next((key for key in reversed(list(runs)) if failing[key] is not None),
                         next(reversed(list(runs)), None))
    launch = runs.get(chosen, []) if chosen is not None else []
    incidents = [r for r in launch if r.get("kind") in INCIDENT_KINDS]
    in_launch = (split_runs(list(files.bundles.values()) + launch).get(chosen, [])
                 if chosen is not None and files.bundles else [])
    bundles = tuple({"path": str(path), "module": doc["module"]["path"], "step": doc["step"],
                     "global_rank": doc["rank"]["global_rank"], "trigger": doc.get("trigger")}
                    for path, doc in sorted(files.bundles.items())
                    if any(doc is other for other in in_launch))
    selftests = tuple({"file": str(path), "time": doc.get("time"), "pass": doc["pass"],
                       "world_size": doc.get("world_size"),
                       "failing_ranks": [{key: entry.get(key)
                                          for key in ("rank", "host", "device", "reasons")}
                                         for entry in doc["failing_ranks"]]}
                      for path, doc in sorted(files.selftests.items()))
    first_step = failing[chosen] if chosen is not None else None
    incident: Optional[Incident] = None
    later: Dict[int, set] = {}
    if first_step is not None:
        at_step = sorted((files.full(r) for r in incidents if r["step"] == first_step),
                         key=lambda r: (r["rank"].get("global_rank", -1),
                                        r["kind"] != RecordKind.PRE_REDUCTION))
        incident = _incident(files, first_step, at_step, launch, ranks, selftests)
        for record in incidents:
            if record["step"] > first_step:
                later.setdefault(record["step"], set()).add(record["rank"].get("global_rank"))
    return Report(
        run_dir=str(files.run_dir), ranks_seen=tuple(sorted(ranks)), problems=tuple(files.problems),
        problems_total=max(getattr(files.problems, "total", 0), len(files.problems)),
        run=chosen,
        runs=tuple({"run": key, "first_step": failing[key],
                    "ranks": sorted({r["rank"].get("global_rank") for r in records})}
                   for key, records in runs.items()),
        incident=incident,
        later_steps=tuple({"step": step, "ranks": sorted(r)} for step, r in sorted(later.items())),
        loss_scale_overflow_steps=tuple(sorted({r["step"] for r in incidents
                                               if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW})),
        selftests=selftests, bundles=bundles, frames=tuple(frames_summary(launch)),
        probes=tuple(probes_summary(launch)))
