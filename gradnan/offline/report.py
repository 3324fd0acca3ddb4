"""Merge every rank's maps and records into one answer for the whole job (pure: RunFiles in, dict out).

The first failing step is the earliest step with any record. Its origin is decided by evidence, best
first: ranks whose LOCAL gradients were non-finite before the data-parallel collective
(``pre_reduction`` records); else, where every checked rank was clean before the collective, the ranks
holding non-finite gradients at the grad norm (the value arose after the collective); else, with no
pre-reduction check at all, the holders, marked unconfirmed. Every other rank with a record at that
step only received it. The text view is for people (one screen for a small job), the JSON
(``gradnan.report``, docs/formats.md) for scripts.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import InputError
from ..formats.layout import AXES, rank_label, shown_axes
from ..formats.records import FORWARD_SHARE, RERUN_CONCLUSIONS
from ..formats.schema import Schema, nonfinite_counts
from .frames_view import frames_summary, probes_summary, summary_lines
from .read import RunFiles

SCHEMA = Schema("gradnan.report", 1)  # what --json prints
NORM_KINDS = ("nonfinite_grad_norm", "loss_scale_overflow")
PRE_REDUCTION = "pre_reduction"
SERIOUS_SKIPS = 3
RUN_GAP_SECONDS = 300.0


def _rank_view(coords: Dict[str, Any]) -> Dict[str, Any]:
    view = {"global_rank": coords.get("global_rank"), "host": coords.get("host"),
            "device": coords.get("device")}
    for axis in shown_axes(coords):
        view[axis] = coords.get(axis)
    view["dp_size"] = coords.get("dp_size")
    return view


def _known_ranks(files: RunFiles) -> Dict[int, Dict[str, Any]]:
    ranks: Dict[int, Dict[str, Any]] = {}
    for document in files.maps.values():
        ranks.setdefault(document["rank"]["global_rank"], document["rank"])
    for record in files.all_records():
        ranks.setdefault(record["rank"].get("global_rank"), record["rank"])
    return ranks


def _params_per_rank(files: RunFiles) -> Dict[int, int]:
    counts: Dict[int, int] = {}
    for document in files.maps.values():
        rank = document["rank"]["global_rank"]
        counts[rank] = counts.get(rank, 0) + document["params_count"]
    return counts


def module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _backward_key(rank: Dict[str, Any], param: Dict[str, Any]):
    """Later pipeline stages and later-registered parameters come first in backward."""
    return (-(rank.get("pp") or 0), -(param.get("order") if isinstance(param.get("order"), int) else -1))


def _param_view(param: Dict[str, Any]) -> Dict[str, Any]:
    return {key: param.get(key) for key in ("id", "name", "kind", "nan", "inf", "first_bad_index",
                                            "abs_max_finite", "near_limit", "order")}


def _rank_entry(record: Dict[str, Any]) -> Dict[str, Any]:
    params = sorted(record["params"], key=lambda p: _backward_key(record["rank"], p))
    return {**_rank_view(record["rank"]), "kind": record["kind"],
            "params_total": record.get("params_total", len(params)),
            "params": [_param_view(p) for p in params]}


def _parameters_by_module(entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Offending parameters across the given ranks, grouped by module, modules in backward order."""
    modules: Dict[str, Dict[str, Any]] = {}
    keyed = sorted(((_backward_key(e, p), e["global_rank"], p) for e in entries for p in e["params"]),
                   key=lambda item: item[0])
    for _, rank, param in keyed:
        module = modules.setdefault(module_of(param["name"]),
                                    {"module": module_of(param["name"]), "params": {}})
        entry = module["params"].setdefault(param["name"], {"name": param["name"], "ranks": [], "nan": 0,
                                                            "inf": 0, "near_limit": False})
        entry["ranks"].append(rank)
        entry["nan"] += param["nan"]
        entry["inf"] += param["inf"]
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


def _decide_origin(at_step: List[Dict[str, Any]]) -> Dict[str, Any]:
    pre = [r for r in at_step if r["kind"] == PRE_REDUCTION and r["params"]]
    norm = [r for r in at_step if r["kind"] in NORM_KINDS]
    holders = [r for r in norm if r["params"]]
    checked = [r for r in norm if r.get("pre_reduction") in ("clean", "nonfinite")]
    if pre:
        return {"basis": "before_collective", "records": _per_rank(pre)}
    if holders and checked:
        return {"basis": "after_collective", "records": holders}
    if holders:
        return {"basis": "unconfirmed", "records": holders}
    return {"basis": "none", "records": []}


def _pattern(origin: List[Dict[str, Any]], params_per_rank: Dict[int, int]) -> Dict[str, Any]:
    """Forward: (nearly) every gradient on the origin rank is bad, so the loss or an activation already
    was. Backward: only some are; the first in backward order is where it started."""
    shares = [entry["params_total"] / params_per_rank[entry["global_rank"]]
              for entry in origin if params_per_rank.get(entry["global_rank"])]
    if shares and min(shares) >= FORWARD_SHARE:
        return {"pass": "forward", "share_nonfinite": min(shares), "first_in_backward": None,
                "first_rank": None}
    firsts = [(_backward_key(entry, entry["params"][0]), entry["params"][0]["name"], entry["global_rank"])
              for entry in origin if entry["params"]]
    _, first, first_rank = min(firsts) if firsts else (None, None, None)
    return {"pass": "backward" if shares else "unknown",
            "share_nonfinite": min(shares) if shares else None, "first_in_backward": first,
            "first_rank": first_rank}


def _verdict(origin: List[Dict[str, Any]], basis: str, pattern: Dict[str, Any],
             parameters: List[Dict[str, Any]]) -> Dict[str, Any]:
    evidence = []
    replicas = sorted({entry["dp"] for entry in origin if isinstance(entry.get("dp"), int)})  # a file may lack it
    dp_size = max((entry.get("dp_size") or 1 for entry in origin), default=1)
    overflow = any(p["near_limit"] for module in parameters for p in module["params"])
    if overflow:
        evidence.append("the largest finite gradient values are near the dtype's limit (overflow)")
    if basis == "unconfirmed":
        evidence.append("no pre-reduction check ran (pre_reduction=off or no Megatron DDP): the ranks "
                        "named hold the bad values but may have received them")
    if pattern["pass"] == "forward":
        evidence.append(f"{pattern['share_nonfinite']:.0%} of the origin's gradients are non-finite: "
                        "the loss or an activation was already bad in the forward pass")
    elif pattern["first_in_backward"]:
        evidence.append(f"first non-finite gradient in backward order: {pattern['first_in_backward']}"
                        f" on rank {pattern['first_rank']}")
    if basis == "after_collective":
        evidence.append("every rank's local gradients were finite before the data-parallel collective: "
                        "the value arose after it (optimizer main grads, a TP/PP gradient all-reduce)")
    if not origin:
        cause, summary = "unknown", "no rank held a non-finite gradient (only the norm was non-finite)"
    elif dp_size == 1 and pattern["pass"] != "forward" and not overflow:  # before_collective from here
        where = ", ".join(f"rank {e['global_rank']} ({e['host']} {e['device']})" for e in origin)
        cause = "undetermined"
        summary = (f"{where} produced it; with one data-parallel replica there is no peer on other data"
                   " to compare with: replay the step or run a self-test to tell hardware from data")
    elif basis != "before_collective" and pattern["pass"] != "forward" and not overflow:
        cause = "undetermined"
        summary = ("the ranks named hold the bad values, but no check saw each rank's own gradients before"
                   " the data-parallel collective: run with pre_reduction (the default) to tell who produced it")
    elif dp_size > 1 and len(replicas) == 1 and pattern["pass"] != "forward" and not overflow:
        first = sorted(origin, key=lambda e: e["global_rank"] != pattern["first_rank"])
        where = f"{first[0]['host']} {first[0]['device']} (rank {first[0]['global_rank']})"
        if len(origin) > 1:
            where += "; its model-parallel peers in the replica received it in backward"
        cause = "hardware"
        summary = (f"one data-parallel replica of {dp_size} (dp{replicas[0]}) produced it while its peers, "
                   f"on different data, did not: suspect {where}; or a batch only it saw")
        evidence.append(f"origin: dp replica {replicas[0]} only; the other {dp_size - 1} replica(s) were "
                        "clean before the collective")
    else:
        cause = "data_or_numerics"
        scope = ("the only data-parallel replica" if dp_size == 1 else "every data-parallel replica"
                 if len(replicas) == dp_size else f"replica(s) {replicas}")
        summary = (f"{scope} went non-finite"
                   + (" in the forward pass" if pattern["pass"] == "forward" else "")
                   + (": overflow" if overflow else "")
                   + "; points at the data or the numerics, not one device")
    return {"cause": cause, "summary": summary, "evidence": evidence}


def _rerun_summary(records: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """What the in-place rerun of the failing step found (``rerun`` records, one step per run): the
    forward origin (the earliest non-finite call on its tensor-parallel group, several only on a tie),
    the ranks that only received it, and the conclusion: each record gives its data-parallel replica's,
    the strongest one is the job's (a replica that failed again outweighs one that was clean)."""
    reruns = [r for r in records if r.get("kind") == "rerun"]
    if not reruns:
        return None
    step = min(r["step"] for r in reruns)
    at_step = sorted((r for r in reruns if r["step"] == step), key=lambda r: r["rank"].get("global_rank", -1))
    origins = [r for r in at_step if r["role"] == "origin"]
    first = origins[0] if origins else None
    batch = next((r["batch"] for r in at_step if r.get("batch")), None)
    conclusion = min((r["conclusion"] for r in at_step), key=RERUN_CONCLUSIONS.index)
    return {
        "step": step, "iteration": at_step[0].get("iteration"), "trigger": at_step[0].get("trigger"),
        "megatron": at_step[0].get("megatron"),
        "conclusion": conclusion,
        "concluded_by": [r["rank"].get("global_rank") for r in at_step if r["conclusion"] == conclusion],
        "module": first["module"] if first else None, "class": first["class"] if first else None,
        "global_rank": first["rank"].get("global_rank") if first else None,
        "rank": _rank_view(first["rank"]) if first else None,
        "micro_batch": first["micro_batch"] if first else next(
            (r["micro_batch"] for r in at_step if r.get("micro_batch") is not None), None),
        "output_abs_max": first.get("output_abs_max") if first else None,
        "bundle": next((r["bundle"] for r in origins if r.get("bundle")), None),
        "batch": batch["path"] if batch else None,
        "origins": [{**_rank_view(r["rank"]), "module": r["module"]} for r in origins],
        "receivers": [{**_rank_view(r["rank"]), "module": r["module"]} for r in at_step if r["role"] == "receiver"],
    }


_RERUN_VERDICTS = {
    "reproducible": ("data_or_numerics", "the failing step, run again in place with the same micro-batches and RNG"
                     " state, went non-finite again in the forward pass, in {module} on rank {rank}, micro-batch"
                     " {micro_batch}: the data"
                     " or the numerics (an overflow), not a passing fault; `gradnan replay` of its bundle on another"
                     " device tells a persistently faulty device apart"),
    "transient": ("hardware", "the failing step, run again in place with the same micro-batches and RNG state,"
                  " was finite on every rank of the replica that failed, although its loss was not: a transient"
                  " fault; suspect the device of the ranks named below and run gradnan selftest there"),
}


def _weigh_rerun(incident: Dict[str, Any]) -> None:
    """The rerun's conclusion outranks the pattern-based verdict: it saw the same step again."""
    rerun = incident["rerun"]
    if rerun is None:
        return
    verdict = incident["verdict"]
    if rerun["conclusion"] in _RERUN_VERDICTS:
        cause, summary = _RERUN_VERDICTS[rerun["conclusion"]]
        if rerun["conclusion"] == "transient" or rerun["module"]:
            # the pattern-based reading (and its evidence, taken from the gradients) gives way to what the
            # rerun saw; it stays as one line
            verdict["evidence"] = [f"pattern-based reading: {verdict['cause']}: {verdict['summary']}"]
            verdict["cause"], verdict["summary"] = cause, summary.format(
                module=rerun["module"], rank=rerun["global_rank"], micro_batch=rerun["micro_batch"])
    elif rerun["conclusion"] == "backward":
        verdict["evidence"].insert(0, "the step's forward pass, run again in place, was finite on every rank of the"
                                      " replica(s) that failed, and so was the loss: the non-finite values arose"
                                      " in the backward pass")
    _origin_from_rerun(incident, {o["global_rank"] for o in rerun["origins"]})


def _origin_from_rerun(incident: Dict[str, Any], rerun_origins: set) -> None:
    """Where the rerun named the forward origin, the other ranks whose gradients went bad in the replica
    (every one of them, after a forward-pass failure) only received it."""
    if not rerun_origins or not any(entry["global_rank"] in rerun_origins for entry in incident["origin"]):
        return
    moved = [entry for entry in incident["origin"] if entry["global_rank"] not in rerun_origins]
    incident["origin"] = [entry for entry in incident["origin"] if entry["global_rank"] in rerun_origins]
    incident["origin_basis"] = "rerun"
    incident["receivers"] = sorted(incident["receivers"] + [
        {**{key: value for key, value in entry.items() if key not in ("params", "params_total", "kind")},
         "holds_nonfinite": True, "modules": sorted({module_of(p["name"]) for p in entry["params"]})}
        for entry in moved], key=lambda view: view["global_rank"])


def _failing_step(incidents: List[Dict[str, Any]], serious_skips: int) -> Optional[int]:
    """The first step that is a failure, not a routine fp16 loss-scale skip (one of a few in a row, or any
    number while the scale warms up before the first applied update, short of its collapse). For a run
    of consecutive skips that became serious, the step where that run began (its origin is the
    interesting one)."""
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    for record in incidents:
        by_step.setdefault(record["step"], []).append(record)
    for step in sorted(by_step):
        records = by_step[step]
        overflows = [r for r in records if r["kind"] == "loss_scale_overflow"]
        serious = [r for r in overflows if r.get("scale_collapsed")
                   or (not r.get("warmup") and (r.get("consecutive_skips") or 1) >= serious_skips)]
        if any(r["kind"] == "nonfinite_grad_norm" for r in records) or (not overflows and records):
            return step
        if serious:
            start = step - max((r.get("consecutive_skips") or 1) for r in serious) + 1
            return min((s for s in by_step if start <= s <= step), default=step)
    return None


def _weigh_selftests(incident: Dict[str, Any], selftests: List[Dict[str, Any]]) -> None:
    """Add what self-tests in the run directory say about the origin's devices to the verdict."""
    origin = {(entry.get("host"), entry.get("device")) for entry in incident["origin"]}
    for result in selftests:
        failed_here = [entry for entry in result["failing_ranks"] if (entry["host"], entry["device"]) in origin]
        if failed_here:
            named = ", ".join(f"rank {e['rank']} ({e['host']} {e['device']})" for e in failed_here)
            incident["verdict"]["evidence"].append(f"self-test {result['time']} FAILED on the origin's device: {named}")
        elif result["pass"]:
            incident["verdict"]["evidence"].append(
                f"self-test {result['time']} passed on all {result['world_size']} ranks: no persistent"
                " device fault seen (a transient one, or the data, remain)")


def _rerun_capture(incident: Dict[str, Any]) -> Optional[Dict[str, str]]:
    """The GRADNAN_CAPTURE_* settings that capture the failing step's implicated module on the origin
    ranks when the job is rerun from a checkpoint (step filters use Megatron-LM's iteration where its
    loop ran, else steps count from the launch that is rerun)."""
    first = incident["pattern"].get("first_in_backward")
    if not first or not incident["origin"]:
        return None
    step = incident["iteration"] if isinstance(incident.get("iteration"), int) else incident["step"]
    return {"GRADNAN_CAPTURE_MODULES": module_of(first), "GRADNAN_CAPTURE_STEPS": str(step),
            "GRADNAN_CAPTURE_RANKS": ",".join(str(e["global_rank"]) for e in incident["origin"])}


def _started(record: Dict[str, Any]) -> float:
    run = record.get("run") if isinstance(record.get("run"), dict) else {}
    value = run.get("started", record.get("time", 0.0))
    return float(value) if isinstance(value, (int, float)) else 0.0


def split_runs(records: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Records by launch: the launcher's run id and restart attempt where known, else launches told
    apart by their rendezvous (two jobs at once cannot share one) and their processes' start times (a
    gap of more than RUN_GAP_SECONDS starts a new one)."""
    runs: Dict[str, List[Dict[str, Any]]] = {}
    anonymous: Dict[Any, List[Dict[str, Any]]] = {}
    for record in records:
        run = record.get("run") if isinstance(record.get("run"), dict) else {}
        if run.get("id"):
            runs.setdefault(f"{run['id']}#{run.get('attempt', 0)}", []).append(record)
        else:
            anonymous.setdefault(run.get("rendezvous"), []).append(record)
    for rendezvous, group in anonymous.items():
        for launch in _split_by_start(group):
            key = "started@" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_started(launch[0])))
            runs.setdefault(f"{key} via {rendezvous}" if key in runs else key, []).extend(launch)
    return dict(sorted(runs.items(), key=lambda item: min(_started(r) for r in item[1])))


def _split_by_start(records: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """Records in launches: a gap of more than RUN_GAP_SECONDS between start times starts a new one."""
    launches: List[List[Dict[str, Any]]] = []
    for record in sorted(records, key=_started):
        if not launches or _started(record) - _started(launches[-1][-1]) > RUN_GAP_SECONDS:
            launches.append([])
        launches[-1].append(record)
    return launches


def build_report(files: RunFiles, serious_skips: int = SERIOUS_SKIPS,
                 run: Optional[str] = None) -> Dict[str, Any]:
    """The report of one launch: ``run`` (a key of ``split_runs``), else the latest launch with a
    failure, else the latest launch."""
    ranks = _known_ranks(files)
    runs = split_runs(files.all_records())
    if run is not None and run not in runs:
        raise InputError(f"{files.run_dir}: no run {run!r} (runs: {', '.join(runs) or 'none'})")
    failing = {key: _failing_step([r for r in records if r.get("kind") in NORM_KINDS + (PRE_REDUCTION,)],
                                  serious_skips) for key, records in runs.items()}
    chosen = run or next((key for key in reversed(list(runs)) if failing[key] is not None),
                         next(reversed(list(runs)), None))
    incidents = [r for r in runs.get(chosen, []) if r.get("kind") in NORM_KINDS + (PRE_REDUCTION,)]
    overflow_steps = sorted({r["step"] for r in incidents if r["kind"] == "loss_scale_overflow"})
    report: Dict[str, Any] = {
        **SCHEMA.header(), "run_dir": str(files.run_dir),
        "ranks_seen": sorted(ranks), "problems": list(files.problems), "first_step": None,
        "incident": None, "later_steps": [], "loss_scale_overflow_steps": overflow_steps,
        "selftests": [], "bundles": [], "rerun_capture": None,
        "frames": frames_summary(runs.get(chosen, [])), "probes": probes_summary(runs.get(chosen, [])), "run": chosen, "runs": [{"run": key, "first_step": failing[key],
                                "ranks": sorted({r["rank"].get("global_rank") for r in records})}
                               for key, records in runs.items()],
    }
    in_run = split_runs(list(files.bundles.values()) + runs.get(chosen, []))
    report["bundles"] = [
        {"path": str(path), "module": doc["module"]["path"], "step": doc["step"],
         "global_rank": doc["rank"]["global_rank"], "trigger": doc.get("trigger")}
        for path, doc in sorted(files.bundles.items())
        if any(doc is other for other in in_run.get(chosen, []))]
    report["selftests"] = [
        {"file": str(path), "time": doc.get("time"), "pass": doc["pass"], "world_size": doc.get("world_size"),
         "failing_ranks": [{key: entry.get(key) for key in ("rank", "host", "device", "reasons")}
                           for entry in doc["failing_ranks"]]}
        for path, doc in sorted(files.selftests.items())]
    first_step = _failing_step(incidents, serious_skips)
    if first_step is None:
        return report
    at_step = sorted((files.full(r) for r in incidents if r["step"] == first_step),
                     key=lambda r: (r["rank"].get("global_rank", -1), r["kind"] != PRE_REDUCTION))
    decision = _decide_origin(at_step)
    origin = [_rank_entry(r) for r in decision["records"]]
    origin_ranks = {entry["global_rank"] for entry in origin}
    recorded = {r["rank"].get("global_rank") for r in at_step}
    parameters = _parameters_by_module(origin)
    pattern = _pattern(origin, _params_per_rank(files))
    report["first_step"] = first_step
    report["incident"] = {
        "step": first_step,
        "iteration": next((r.get("iteration") for r in at_step if isinstance(r.get("iteration"), int)), None),
        "kinds": sorted({r["kind"] for r in at_step}),
        "origin_basis": decision["basis"],
        "origin": origin,
        "receivers": [{**_rank_view(r["rank"]), "holds_nonfinite": bool(r["params"]),
                       "modules": sorted({module_of(p["name"]) for p in r["params"]})}
                      for r in at_step if r["kind"] in NORM_KINDS
                      and r["rank"].get("global_rank") not in origin_ranks],
        "silent": [_rank_view(ranks[rank]) for rank in sorted(ranks) if rank not in recorded],
        "parameters": parameters,
        "pattern": pattern,
        "verdict": _verdict(origin, decision["basis"], pattern, parameters),
        "rerun": _rerun_summary(runs.get(chosen, [])),
    }
    _weigh_rerun(report["incident"])
    _weigh_selftests(report["incident"], report["selftests"])
    report["rerun_capture"] = _rerun_capture(report["incident"])
    later: Dict[int, set] = {}
    for record in incidents:
        if record["step"] > first_step:
            later.setdefault(record["step"], set()).add(record["rank"].get("global_rank"))
    report["later_steps"] = [{"step": step, "ranks": sorted(r)} for step, r in sorted(later.items())]
    return report


def _rank_label(view: Dict[str, Any]) -> str:
    return rank_label(view, "after", [axis for axis in AXES if axis in view])


_BASIS_TEXT = {
    "before_collective": "local gradients non-finite before the data-parallel collective",
    "after_collective": "holds the non-finite gradients; clean before the collective",
    "unconfirmed": "holds the non-finite gradients (unconfirmed: no pre-reduction check)",
    "none": "",
    "rerun": "where a forward value first went non-finite when the failing step was run again in place",
}


MAX_TABLE_RANKS = 16
MAX_ORIGIN_LINES = 6  # and receivers or silent ranks listed one a line; more are summarised
MAX_LISTED = 3  # bundles, self-tests, problems: the first ones, then a count
WIDTH = 110
_POSITION = ("tp", "pp", "cp", "ep")


def _same(view: Dict[str, Any], other: Dict[str, Any], axes: Sequence[str]) -> bool:
    return all(view.get(axis) == other.get(axis) for axis in axes)


def rank_role(view: Dict[str, Any], origin: List[Dict[str, Any]]) -> str:
    """How a rank stands to the origin: ``dp_peer`` (same model-parallel position, another data-parallel
    replica: where the collective carries the NaN), ``mp_peer`` (same replica, another position), ``other``."""
    if any(_same(view, entry, _POSITION) for entry in origin):
        return "dp_peer"
    if any(_same(view, entry, ("dp",)) for entry in origin):
        return "mp_peer"
    return "other"


def focus_ranks(incident: Dict[str, Any], limit: int) -> List[int]:
    """The ranks worth a column, at most ``limit``, by number: the origin; then, nearest the origin first,
    the ranks holding the NaN and the origin's model-parallel peers, half the columns left each (one
    kind's unused share goes to the other); then the ranks nearest the origin."""
    origin = incident["origin"]
    anchor = min((entry["global_rank"] for entry in origin), default=0)
    chosen = list(dict.fromkeys(entry["global_rank"] for entry in origin))[:limit]
    views = [view for view in incident["receivers"] + incident["silent"] if view["global_rank"] not in chosen]

    def nearest(ranks):
        return sorted(ranks, key=lambda rank: (abs(rank - anchor), rank))

    holding = nearest(view["global_rank"] for view in views if view.get("holds_nonfinite"))
    peers = nearest(view["global_rank"] for view in views
                    if not view.get("holds_nonfinite") and rank_role(view, origin) == "mp_peer")
    left = limit - len(chosen)
    chosen += holding[:max(left // 2, left - len(peers))]
    chosen += peers[:limit - len(chosen)]
    taken = set(chosen)
    chosen += [rank for rank in nearest(view["global_rank"] for view in views) if rank not in taken][:limit - len(chosen)]
    return sorted(chosen)


def rank_ranges(ranks: Sequence[int], max_chars: int = 72) -> str:
    """ "0-482, 484-4095" or "3-251 every 8, 300": runs of three or more at a constant step written as one
    range (a job's data-parallel peers are one range), cut to ``max_chars`` with the count of all."""
    ranks = sorted(set(ranks))
    parts, start = [], 0
    while start < len(ranks):
        end, step = start, ranks[start + 1] - ranks[start] if start + 1 < len(ranks) else 1
        while end + 1 < len(ranks) and ranks[end + 1] - ranks[end] == step:
            end += 1
        if end - start >= 2:
            parts.append(f"{ranks[start]}-{ranks[end]}" + (f" every {step}" if step > 1 else ""))
        else:
            end = start
            parts.append(str(ranks[start]))
        start = end + 1
    text = ""
    for position, part in enumerate(parts):
        if len(text) + len(part) > max_chars:
            return f"{text}... ({len(ranks)} in all)"
        text += part + (", " if position + 1 < len(parts) else "")
    return text


_ROLE_TEXT = {"dp_peer": "data-parallel peer(s) of the origin (same tp/pp)",
              "mp_peer": "model-parallel peer(s) of the origin (same dp replica)",
              "other": "other rank(s)"}


def _grouped_lines(views: List[Dict[str, Any]], origin: List[Dict[str, Any]]) -> List[str]:
    """One line per role (and whether the rank's own gradients hold the NaN): how many, which ranks."""
    groups: Dict[Tuple[str, bool], List[int]] = {}
    for view in views:
        key = (rank_role(view, origin), bool(view.get("holds_nonfinite")))
        groups.setdefault(key, []).append(view["global_rank"])
    lines = []
    for role in _ROLE_TEXT:
        for holds in (True, False):
            ranks = groups.get((role, holds))
            if ranks:
                state = ", holding the NaN/Inf" if holds else ""
                lines.append(f"  {len(ranks)} {_ROLE_TEXT[role]}{state}: {rank_ranges(ranks)}")
    return lines


def _ranks_section(title: str, views: List[Dict[str, Any]], origin: List[Dict[str, Any]]) -> List[str]:
    """A line per rank in a small job; in a large one, a line per role (``_grouped_lines``)."""
    if not views:
        return []
    if len(views) <= MAX_ORIGIN_LINES:
        return [f"{title}:"] + [f"  {_rank_label(view)}" + ("" if view.get("holds_nonfinite", True)
                                                             else "  (own gradients finite)") for view in views]
    return [f"{title}: {len(views)} rank(s)"] + _grouped_lines(views, origin)


def _module_table(incident: Dict[str, Any], max_modules: int) -> List[str]:
    """One line per offending module, in backward order, with a column per rank (``focus_ranks``): O origin,
    r received (holds a non-finite gradient there), . clean; and the origin's counts per parameter."""
    marks: Dict[int, Dict[str, str]] = {}
    for entry in incident["origin"]:
        marks[entry["global_rank"]] = {module_of(p["name"]): "O" for p in entry["params"]}
    for view in incident["receivers"]:
        marks[view["global_rank"]] = {module: "r" for module in view["modules"]}
    ranks = focus_ranks(incident, MAX_TABLE_RANKS)
    modules = incident["parameters"]
    width = max((len(m["module"]) for m in modules[:max_modules]), default=6)
    cell = max([3] + [len(str(rank)) + 1 for rank in ranks])
    lines = ["Offending modules in backward order (O origin, r received, . clean):",
             f"  {'module':<{width}}  " + " ".join(f"{'r' + str(rank):<{cell}}" for rank in ranks) + "  on the origin"]
    for module in modules[:max_modules]:
        cells = " ".join(f"{marks.get(rank, {}).get(module['module'], '.'):<{cell}}" for rank in ranks)
        counts = ", ".join(f"{p['name'].rsplit('.', 1)[-1]} {nonfinite_counts(p)}"
                           + (" [near dtype limit]" if p["near_limit"] else "") for p in module["params"])
        lines.append(f"  {module['module']:<{width}}  {cells}  {counts}")
    if len(modules) > max_modules:
        lines.append(f"  ... and {len(modules) - max_modules} more module(s) (see --json)")
    total = len(incident["origin"]) + len(incident["receivers"]) + len(incident["silent"])
    if total > len(ranks):
        lines.append(f"  ({total - len(ranks)} more rank(s) not shown: the columns are the origin, the ranks"
                     " holding the NaN and the origin's peers; see --json)")
    return lines


def _listed(items: List[Any], describe, what: str) -> List[str]:
    """The first ``MAX_LISTED`` items' lines, then how many more."""
    lines = [line for item in items[:MAX_LISTED] for line in describe(item)]
    if len(items) > MAX_LISTED:
        lines.append(f"  ... and {len(items) - MAX_LISTED} more {what} (see --json)")
    return lines


def _selftest_lines(result: Dict[str, Any]) -> List[str]:
    failing = result["failing_ranks"]
    state = "PASS" if result["pass"] else "FAIL: " + "; ".join(
        f"rank {e['rank']} ({e['host']} {e['device']})" for e in failing[:MAX_LISTED]) + (
        f" ... ({len(failing)} ranks failed)" if len(failing) > MAX_LISTED else "")
    return [f"Self-test {result['time']}: {state}"]


_CONCLUSION_TEXT = {"reproducible": "REPRODUCIBLE (same micro-batches, same RNG state)",
                    "transient": "NOT reproduced: transient", "backward": "forward pass clean: the backward pass",
                    "after_collective": "forward pass and local gradients clean: it arose at or after the data-parallel collective",
                    "not_reproduced": "not reproduced"}


def _rerun_lines(rerun: Optional[Dict[str, Any]]) -> List[str]:
    """The headline of the in-place rerun: the forward origin, its micro-batch, the conclusion."""
    if rerun is None:
        return []
    when = f"iteration {rerun['iteration']}" if rerun.get("iteration") else f"step {rerun['step']}"
    conclusion = _CONCLUSION_TEXT[rerun["conclusion"]]
    megatron = [f"  Megatron's own rerun of it (validate_results): {rerun['megatron']}"] if rerun.get("megatron") else []
    if rerun["module"] is None:
        return [f"Rerun of {when} in place: {conclusion}, on the replica of rank(s)"
                f" {rank_ranges(rerun['concluded_by'])}"] + megatron
    lines = [f"Forward origin ({when} run again in place): {rerun['module']} ({rerun['class']})",
             f"  on {_rank_label(rerun['rank'])}, micro-batch {rerun['micro_batch']}: {conclusion}"]
    lines += megatron
    ties = rerun["origins"][1:]
    if ties:
        same = all(o["module"] == rerun["module"] for o in ties)
        lines.append(f"  the same on rank(s) {rank_ranges([o['global_rank'] for o in ties])} (a tie: each went non-finite"
                     " there first)" if same else "  tied with: " + ", ".join(
                         f"{o['module']} on rank {o['global_rank']}" for o in ties[:MAX_LISTED]))
    if rerun["receivers"]:
        lines.append(f"  received it from there (not origins): rank(s) "
                     f"{rank_ranges([r['global_rank'] for r in rerun['receivers']])}")
    if rerun["bundle"]:
        lines.append(f"  replay it: gradnan replay {rerun['bundle']}")
    if rerun["batch"]:
        lines.append(f"  the micro-batch: {rerun['batch']}")
    return lines


def format_text(report: Dict[str, Any], max_modules: int = 10) -> str:
    lines = [f"gradnan report for {report['run_dir']}  ({len(report['ranks_seen'])} rank(s) wrote files)"]
    if len(report["runs"]) > 1:
        listed = ", ".join(f"{r['run']}" + (f" (fails at step {r['first_step']})" if r["first_step"] else "")
                           for r in report["runs"])
        lines.append(f"Launches here: {listed}; showing {report['run']} (--run KEY for another)")
    incident: Optional[Dict[str, Any]] = report["incident"]
    if incident is None and report["loss_scale_overflow_steps"]:
        steps = report["loss_scale_overflow_steps"]
        lines.append(f"No failure: {len(steps)} routine fp16 loss-scale overflow step(s) (skipped by dynamic"
                     f" loss scaling by design), the last at step {steps[-1]}.")
    elif incident is None:
        lines.append("No non-finite gradient was recorded.")
    else:
        verdict = incident["verdict"]
        iteration = f", Megatron iteration {incident['iteration']}" if incident.get("iteration") else ""
        lines.append(f"First failing step: {incident['step']}{iteration}  ({', '.join(incident['kinds'])})")
        lines += _rerun_lines(incident["rerun"])
        lines += textwrap.wrap(f"Verdict: {verdict['cause']}: {verdict['summary']}", WIDTH,
                               subsequent_indent="    ")
        for item in verdict["evidence"]:
            lines += textwrap.wrap(item, WIDTH, initial_indent="  - ", subsequent_indent="    ")
        origin = incident["origin"]
        lines.append(f"Origin ({_BASIS_TEXT[incident['origin_basis']]}):")
        lines += [f"  {_rank_label(entry)}: {entry['params_total']} parameter(s)" for entry in origin[:MAX_ORIGIN_LINES]]
        if len(origin) > MAX_ORIGIN_LINES:
            lines.append(f"  ... and {len(origin) - MAX_ORIGIN_LINES} more origin entries, ranks "
                         f"{rank_ranges([entry['global_rank'] for entry in origin[MAX_ORIGIN_LINES:]])}")
        if not origin:
            lines.append("  none found")
        lines += _ranks_section("Received it (through a collective or the norm's all-reduce)", incident["receivers"],
                                origin)
        lines += _ranks_section("No record at this step (finite norm, or died first)", incident["silent"], origin)
        lines += _module_table(incident, max_modules)
        if report["later_steps"]:
            steps = report["later_steps"]
            lines.append(f"Later steps with records: {', '.join(str(s['step']) for s in steps[:8])}"
                         + (" ..." if len(steps) > 8 else ""))
    lines += summary_lines(report["run_dir"], report.get("frames", []), report.get("probes", []))
    shown = (report["incident"] or {}).get("rerun") or {}
    others = [bundle for bundle in report.get("bundles", []) if bundle["path"] != shown.get("bundle")]
    if others:
        lines.append("Captured for replay:" if not shown.get("bundle") else "Also captured for replay:")
        lines += _listed(others, lambda bundle: [
            f"  {bundle['module']} on rank {bundle['global_rank']}, step {bundle['step']}:",
            f"    gradnan replay {bundle['path']}"], "bundle(s)")
    if report.get("rerun_capture"):
        lines.append("To capture this step on a rerun from a checkpoint, set:")
        lines.append("  " + " ".join(f"{key}={value}" for key, value in report["rerun_capture"].items()))
    lines += _listed(report.get("selftests", []), _selftest_lines, "self-test result(s)")
    if report["problems"]:
        lines.append(f"Files that could not be read: {len(report['problems'])}")
        lines += _listed(report["problems"], lambda problem: [f"  {problem}"], "problem(s)")
    return "\n".join(lines)
