"""Merge every rank's maps and records into one answer for the whole job (pure: RunFiles in, dict out).

The text view is for people (fits one screen for a small job), the JSON (``gradnan.report`` schema,
docs/formats.md) for scripts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .reader import RunFiles

REPORT_SCHEMA = "gradnan.report"
REPORT_VERSION = 1
INCIDENT_KINDS = ("nonfinite_grad_norm", "loss_scale_overflow")
_AXES = ("tp", "pp", "dp", "cp", "ep")


def _rank_view(coords: Dict[str, Any]) -> Dict[str, Any]:
    view = {"global_rank": coords.get("global_rank"), "host": coords.get("host"),
            "device": coords.get("device")}
    for axis in _AXES:
        if axis in ("tp", "pp", "dp") or (coords.get(f"{axis}_size") or 1) > 1:
            view[axis] = coords.get(axis)
    return view


def _known_ranks(files: RunFiles) -> Dict[int, Dict[str, Any]]:
    ranks: Dict[int, Dict[str, Any]] = {}
    for document in files.maps.values():
        ranks.setdefault(document["rank"]["global_rank"], document["rank"])
    for record in files.all_records():
        ranks.setdefault(record["rank"].get("global_rank"), record["rank"])
    return ranks


def module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _holder(record: Dict[str, Any]) -> Dict[str, Any]:
    return {
        **_rank_view(record["rank"]),
        "kind": record["kind"],
        "params_total": record.get("params_total", len(record["params"])),
        "params": [
            {key: param.get(key) for key in
             ("id", "name", "kind", "nan", "inf", "first_bad_index", "abs_max_finite", "near_limit")}
            for param in record["params"]
        ],
    }


def _parameters_by_module(holders: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    modules: Dict[str, Dict[str, Any]] = {}
    for holder in holders:
        for param in holder["params"]:
            module = modules.setdefault(module_of(param["name"]), {"module": module_of(param["name"]),
                                                                   "params": {}})
            entry = module["params"].setdefault(
                param["name"], {"name": param["name"], "ranks": [], "nan": 0, "inf": 0,
                                "near_limit": False})
            entry["ranks"].append(holder["global_rank"])
            entry["nan"] += param["nan"]
            entry["inf"] += param["inf"]
            entry["near_limit"] = entry["near_limit"] or bool(param.get("near_limit"))
    return [{"module": m["module"], "params": list(m["params"].values())} for m in modules.values()]


def build_report(files: RunFiles) -> Dict[str, Any]:
    ranks = _known_ranks(files)
    incidents = [r for r in files.all_records() if r.get("kind") in INCIDENT_KINDS]
    report: Dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
        "run_dir": str(files.run_dir),
        "ranks_seen": sorted(ranks),
        "problems": list(files.problems),
        "first_step": None,
        "incident": None,
        "later_steps": [],
    }
    if not incidents:
        return report
    first_step = min(r["step"] for r in incidents)
    at_first = sorted((r for r in incidents if r["step"] == first_step),
                      key=lambda r: r["rank"].get("global_rank", -1))
    holders = [_holder(r) for r in at_first if r["params"]]
    holder_ranks = {h["global_rank"] for h in holders}
    recorded = {r["rank"].get("global_rank") for r in at_first}
    report["first_step"] = first_step
    report["incident"] = {
        "step": first_step,
        "kinds": sorted({r["kind"] for r in at_first}),
        "holders": holders,
        "receivers": [_rank_view(r["rank"]) for r in at_first
                      if r["rank"].get("global_rank") not in holder_ranks],
        "silent": [_rank_view(ranks[rank]) for rank in sorted(ranks) if rank not in recorded],
        "parameters": _parameters_by_module(holders),
    }
    later: Dict[int, Dict[str, Any]] = {}
    for record in incidents:
        if record["step"] > first_step:
            step = later.setdefault(record["step"], {"step": record["step"], "ranks": set(), "holders": set()})
            step["ranks"].add(record["rank"].get("global_rank"))
            if record["params"]:
                step["holders"].add(record["rank"].get("global_rank"))
    report["later_steps"] = [{"step": s["step"], "ranks": sorted(s["ranks"]), "holders": sorted(s["holders"])}
                             for _, s in sorted(later.items())]
    return report


def _rank_label(view: Dict[str, Any]) -> str:
    axes = " ".join(f"{axis}{view[axis]}" for axis in _AXES if axis in view)
    return f"rank {view['global_rank']} ({axes}) on {view.get('host')} {view.get('device')}"


def _counts(entry: Dict[str, Any]) -> str:
    parts = [f"{entry[key]} {label}" for key, label in (("nan", "NaN"), ("inf", "Inf")) if entry.get(key)]
    return ", ".join(parts)


def format_text(report: Dict[str, Any], max_params: int = 12) -> str:
    lines = [f"gradnan report for {report['run_dir']}  ({len(report['ranks_seen'])} rank(s) wrote files)"]
    incident: Optional[Dict[str, Any]] = report["incident"]
    if incident is None:
        lines.append("No non-finite gradient was recorded.")
    else:
        lines.append(f"First failing step: {incident['step']}  ({', '.join(incident['kinds'])})")
        lines.append("Ranks holding non-finite gradients:")
        for holder in incident["holders"] or []:
            lines.append(f"  {_rank_label(holder)}: {holder['params_total']} parameter(s)")
        if not incident["holders"]:
            lines.append("  none (every recording rank's own gradients were finite)")
        if incident["receivers"]:
            lines.append("Ranks that only saw the non-finite norm (their gradients were finite):")
            lines += [f"  {_rank_label(view)}" for view in incident["receivers"]]
        if incident["silent"]:
            lines.append("Ranks with no record at this step (finite norm, or died first):")
            lines += [f"  {_rank_label(view)}" for view in incident["silent"]]
        lines.append("Offending parameters by module:")
        shown = 0
        for module in incident["parameters"]:
            lines.append(f"  {module['module']}")
            for entry in module["params"]:
                if shown == max_params:
                    break
                hint = "  [near dtype limit: overflow?]" if entry["near_limit"] else ""
                ranks = ",".join(str(r) for r in entry["ranks"])
                lines.append(f"    {entry['name'].rsplit('.', 1)[-1]}: {_counts(entry)} on rank(s) {ranks}{hint}")
                shown += 1
        total = sum(len(module["params"]) for module in incident["parameters"])
        if total > shown:
            lines.append(f"    ... and {total - shown} more (see --json)")
        if report["later_steps"]:
            steps = report["later_steps"]
            lines.append(f"Later steps with records: {', '.join(str(s['step']) for s in steps[:8])}"
                         + (" ..." if len(steps) > 8 else ""))
    if report["problems"]:
        lines.append("Files that could not be read:")
        lines += [f"  {problem}" for problem in report["problems"]]
    return "\n".join(lines)
