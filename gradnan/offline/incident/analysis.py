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

The verdict is decided in one place (``causes.decide``, a declared rule table over ``evidence_of``'s typed
facts) from all of it: the gradients' pattern, the rerun's conclusion, the weights and optimizer state,
and the self-tests of the origin's devices. Nothing changes a ``Report`` afterwards:
the text view, ``--json`` and the plot only render it (``gradnan.offline.report``, ``.plot``).

The facts come from ``gradients`` (the origin and pattern the gradients show), ``rerun_finding`` and
``evidence``, from the records of the job ``world`` keeps; ``evidence_lines`` words them; ``next_steps``
says what to do; the typed result is ``verdict``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

from ...decision.actions import Setting, next_steps
from ...decision.causes import Decision, decide
from ...decision.evidence import View
from ...decision.origin import decide_gradient_origin, per_rank, unchecked_ranks
from ...decision.replica import own_failure_of
from ...errors import InputError
from ...formats.incident import INCIDENT_KINDS, NORM_KINDS, OriginBasis, RecordKind
from .checkpoints import after_failure, saves_of
from .evidence import counted, evidence_of, health_readings, iterations_of, overflow_recurs, state_records
from .evidence_lines import evidence_lines, health_lines, selftest_evidence, selftest_summary
from .frames_view import frames_summary, probes_summary, probes_total
from .gradients import backward_key, capture_settings, module_of, pattern_of, rank_entry, rank_view
from .read import RunFiles
from .rerun_finding import rerun_finding
from .runs import SERIOUS_SKIPS, failing_step, split_runs
from .runup import RankRunUp, RunUp, culprit_bucket, rank_runup
from .runup import decide_ranks as runup_finding
from .verdict import Incident, Report, Verdict
from .world import inside_job, job_records


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


def _param_dtypes(files: RunFiles, ranks: Collection[Any]) -> Dict[Tuple[Any, str], str]:
    """The model dtype of every parameter of these ranks' maps, by (global rank, name): the dtype whose
    limit a gradient's largest finite magnitude is measured against (``near_limit``; the plot's line)."""
    dtypes: Dict[Tuple[Any, str], str] = {}
    for path, document in files.maps_of(ranks):
        rank = document["rank"]["global_rank"]
        dtypes.update(((rank, param["name"]), param["dtype"])
                      for param in files.params_of_map(path, document) if isinstance(param.get("dtype"), str))
    return dtypes


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
    keyed = sorted(((backward_key(e, p), e["global_rank"], p) for e in entries for p in e["params"]),
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


def _rejected_entries(losses: List[Dict[str, Any]]) -> List[View]:
    """Losses Megatron's check rejected before any gradient existed (it raised in the loss function)."""
    return [{**rank_view(r["rank"]), "kind": r["kind"], "params_total": 0, "params": [],
             "micro_batch": r.get("micro_batch"), "loss": r.get("loss")} for r in losses]


def _own_failure(rerun: Dict[str, Any]) -> Optional[str]:
    failed = own_failure_of(rerun)
    return None if failed is None else failed.value


def _origin_entries(decision: Decision, gradient_origin: Sequence[View], states: Sequence[Dict[str, Any]],
                    rejected: Sequence[View], reruns: Sequence[Dict[str, Any]],
                    dtypes: Dict[Tuple[Any, str], str], known: Dict[int, Dict[str, Any]],
                    at_step: Sequence[Dict[str, Any]]) -> List[View]:
    """The decision's origin ranks, each with what it is named for: its offending gradients, its bad weights
    (a ``state`` record's params), its rejected loss, what of its replica's own failed (its ``rerun``
    record), or its coordinates alone (from any record of it in ``reruns``: a ``replica_divergence`` one;
    ``absent``: no file of the run names it, of the ``known`` ranks)."""
    by_rank: Dict[Any, View] = {r["rank"].get("global_rank"): {
        **rank_view(r["rank"]), "kind": r["kind"], "params_total": 0, "params": [],
        "own_failure": _own_failure(r), **({"diverged": r["diverged"]} if "diverged" in r else {})}
        for r in reruns}
    by_rank.update((entry["global_rank"], entry) for entry in rejected)
    if decision.basis is OriginBasis.UNCHECKED:
        by_rank.update((rank, {**rank_view(known[rank]), "kind": None, "params_total": 0, "params": [],
                               "unchecked": True}) for rank in decision.origin if rank in known)
    if decision.basis is OriginBasis.STATE:
        by_rank.update((record["rank"].get("global_rank"), rank_entry(record, dtypes)) for record in states)
    elif decision.basis is OriginBasis.LOSS_SCALE:  # the scaler, not a parameter
        by_rank.update((r["rank"].get("global_rank"), {
            **rank_view(r["rank"]), "kind": r["kind"], "params_total": 0, "params": [],
            "loss_scale": r.get("loss_scale")})
            for r in at_step if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW)
    else:
        if decision.basis is OriginBasis.LINK:  # a link's sender may hold no non-finite gradient of its own
            by_rank.update((r["rank"].get("global_rank"), {**rank_view(r["rank"]), "kind": None,
                                                           "params_total": 0, "params": []}) for r in states)
            by_rank.update((r["rank"].get("global_rank"), rank_entry(r, dtypes)) for r in at_step
                           if r["kind"] in NORM_KINDS)
        by_rank.update((entry["global_rank"], entry) for entry in gradient_origin)
    return [by_rank.get(rank) or {"global_rank": rank, "kind": None, "params_total": 0, "params": [],
                                  "absent": rank not in known}
            for rank in decision.origin]


def _incident(files: RunFiles, step: int, at_step: List[Dict[str, Any]], launch: List[Dict[str, Any]],
              ranks: Dict[int, Dict[str, Any]], selftests: Sequence[Dict[str, Any]],
              launch_key: str) -> Incident:
    """``at_step``: the step's incident records; none where Megatron's validation ran the step again and
    exited before any norm (only ``rerun`` records then); ``launch_key``: the launch's
    (``runs.split_runs``)."""
    unchecked = unchecked_ranks(at_step, ranks)
    gradient_basis, origin_records = decide_gradient_origin(at_step, unchecked)
    states = state_records(files, launch, step)
    dtypes = _param_dtypes(files, {r["rank"].get("global_rank") for r in origin_records + states})
    gradient_origin = [rank_entry(r, dtypes) for r in origin_records]
    pattern = pattern_of(gradient_origin,
                         _params_per_rank(files, {entry["global_rank"] for entry in gradient_origin}))
    rerun = rerun_finding(launch)
    reruns_here = [r for r in launch if r.get("kind") == RecordKind.RERUN and r["step"] == step]
    divergences = sorted((files.full(r) for r in launch
                          if r.get("kind") == RecordKind.REPLICA_DIVERGENCE and r["step"] == step),
                         key=lambda r: r["rank"].get("global_rank", -1))
    iterations = iterations_of(list(at_step) + reruns_here + divergences, rerun, step)
    iteration = (rerun.iteration if rerun is not None and rerun.step == step and counted(rerun.iteration)
                 else iterations[0] if iterations else None)
    evidence = evidence_of(step, iteration, ranks, states, (gradient_basis, gradient_origin), pattern,
                           rerun, at_step, overflow_recurs(at_step, launch, step), iterations,
                           reruns_here, divergences,
                           after_failure(saves_of(files.all_records()), launch_key, step), unchecked)
    decision = decide(evidence)
    rejected = _rejected_entries([r for r in at_step if r["kind"] == RecordKind.NONFINITE_LOSS])
    origin = _origin_entries(decision, gradient_origin, states, rejected, reruns_here + divergences, dtypes,
                             ranks, at_step)
    named = {entry["global_rank"] for entry in origin}
    # the table's counts are those of the first rank holding each parameter: the decided origin's first
    parameters = _parameters_by_module(sorted(gradient_origin,
                                              key=lambda entry: entry["global_rank"] not in named))
    receivers = [_receiver(rank_view(r["rank"]), r["params"])
                 for r in per_rank([r for r in at_step if r["kind"] in NORM_KINDS])
                 if r["rank"].get("global_rank") not in named]
    listed = named | {view["global_rank"] for view in receivers}
    receivers += [_receiver({key: value for key, value in entry.items()
                             if key not in ("params", "params_total", "kind", "largest_grad")},
                            entry["params"])
                  for entry in gradient_origin if entry["global_rank"] not in listed]
    recorded = {r["rank"].get("global_rank") for r in at_step + reruns_here + states + divergences}
    health = health_readings(at_step, origin)
    lines = evidence_lines(evidence, decision) + selftest_evidence(origin, selftests)
    verdict = Verdict(decision.cause, decision.summary, tuple(lines + health_lines(health)),
                      decision.rule, decision.not_observed)
    capture = capture_settings(pattern, origin, step, iteration)
    captured = next((str(path) for path, doc in sorted(files.bundles.items())
                     if capture and doc["module"]["path"] == capture["GRADNAN_CAPTURE_MODULES"]
                     and doc["rank"]["global_rank"] in named and doc["step"] >= step), None)
    setting = Setting(origin, ranks, str(files.run_dir), health, capture, captured,
                      bundle=rerun.bundle if rerun is not None else None,
                      bundle_module=rerun.module if rerun is not None else None,
                      bundle_rank=rerun.global_rank if rerun is not None else None,
                      batch=rerun.batch if rerun is not None else (evidence.rejected or {}).get("batch"),
                      reran=rerun is not None, megatron_reran=bool(rerun is not None and rerun.megatron))
    return Incident(
        step=step, iteration=iteration,
        kinds=tuple(sorted({r["kind"] for r in at_step + divergences})) or (RecordKind.RERUN.value,),
        origin_basis=decision.basis, origin=tuple(origin),
        receivers=tuple(sorted(receivers, key=lambda view: view["global_rank"])),
        silent=tuple(rank_view(ranks[rank]) for rank in sorted(ranks) if rank not in recorded),
        parameters=tuple(parameters), pattern=pattern,
        verdict=verdict, rerun=rerun, capture_settings=capture,
        next_steps=next_steps(decision.actions, evidence, setting),
        health=tuple(health),
        runup=_runup(files, launch, step, decision.culprit))


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
    where Megatron's validation ran the step again and exited before the grad norm; or a
    ``replica_divergence`` record: a replica corrupted, whether or not anything went non-finite."""
    return record.get("kind") in INCIDENT_KINDS or record.get("kind") in (RecordKind.RERUN,
                                                                          RecordKind.REPLICA_DIVERGENCE)


def analyze(files: RunFiles, serious_skips: int = SERIOUS_SKIPS, run: Optional[str] = None) -> Report:
    """The report of one launch: ``run`` (a key of ``runs.split_runs``), else the latest launch with a
    failure, else the latest launch."""
    ranks = _known_ranks(files)
    jobs = {key: job_records(records) for key, records in split_runs(files.all_records()).items()}
    runs = {key: kept for key, (_, kept, _) in jobs.items()}
    if run is not None and run not in runs:
        raise InputError(f"{files.run_dir}: no run {run!r} (runs: {', '.join(runs) or 'none'})")
    failing = {key: failing_step([r for r in records if _marks_failure(r)], serious_skips)
               for key, records in runs.items()}
    chosen = run or next((key for key in reversed(list(runs)) if failing[key] is not None),
                         next(reversed(list(runs)), None))
    world, launch, outside = jobs[chosen] if chosen is not None else (None, [], ())
    ranks = {rank: coords for rank, coords in ranks.items() if inside_job(coords, world)}
    incidents = [r for r in launch if r.get("kind") in INCIDENT_KINDS]
    by_launch = split_runs(list(files.bundles.values()) + launch) if files.bundles else {}
    if chosen is None and by_launch:  # no records (a healthy run): the latest launch its bundles tell
        chosen = next(reversed(list(by_launch)))
    in_launch = by_launch.get(chosen, []) if chosen is not None else []
    bundles = tuple({"path": str(path), "module": doc["module"]["path"], "step": doc["step"],
                     "global_rank": doc["rank"]["global_rank"], "trigger": doc.get("trigger")}
                    for path, doc in sorted(files.bundles.items())
                    if any(doc is other for other in in_launch))
    selftests = tuple(selftest_summary(path, doc) for path, doc in sorted(files.selftests.items()))
    first_step = failing.get(chosen) if chosen is not None else None
    incident: Optional[Incident] = None
    later: Dict[int, set] = {}
    if first_step is not None:
        at_step = sorted((files.full(r) for r in incidents if r["step"] == first_step),
                         key=lambda r: (r["rank"].get("global_rank", -1),
                                        r["kind"] != RecordKind.PRE_REDUCTION))
        incident = _incident(files, first_step, at_step, launch, ranks,
                             [doc for _, doc in sorted(files.selftests.items())], chosen or "")
        for record in incidents:
            if record["step"] > first_step:
                later.setdefault(record["step"], set()).add(record["rank"].get("global_rank"))
    return Report(
        run_dir=str(files.run_dir), ranks_seen=tuple(sorted(ranks)), problems=tuple(files.problems) + outside,
        problems_total=max(getattr(files.problems, "total", 0), len(files.problems)) + len(outside),
        run=chosen,
        runs=tuple({"run": key, "first_step": failing[key],
                    "ranks": sorted({r["rank"].get("global_rank") for r in records})}
                   for key, records in runs.items()),
        incident=incident,
        later_steps=tuple({"step": step, "ranks": sorted(r)} for step, r in sorted(later.items())),
        loss_scale_overflow_steps=tuple(sorted({r["step"] for r in incidents
                                               if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW})),
        selftests=selftests, bundles=bundles, frames=tuple(frames_summary(launch)),
        probes=tuple(probes_summary(launch)), probes_total=probes_total(launch))
