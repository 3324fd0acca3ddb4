"""Reading frame and probe records back: the report's summary lines and ``gradnan frames``' listing, laid
out as Hugging Face's DebugUnderflowOverflow prints its frames (abs min, abs max, what)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ...formats.incident import RecordKind
from ...formats.layout import rank_label
from ...formats.records import DTYPE_MAX
from ...formats.schema import nonfinite_counts
from ...formats.text import printable_lines, shell_word, untrusted


def _module_text(frame: Dict[str, Any]) -> str:
    return f"{untrusted(frame['module'] or '<model>')} {untrusted(frame['class'])}"


def frames_summary(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per frames record: where, which step, and the frame that went non-finite first."""
    summary = []
    for record in records:
        if record.get("kind") != "frames":
            continue
        first = record.get("first_nonfinite")
        frames = record["frames"]
        bad = frames[first] if first is not None and 0 <= first < len(frames) else None
        summary.append({"global_rank": record["rank"]["global_rank"], "step": record["step"],
                        "mode": record.get("mode"), "frames": len(frames),
                        "first_nonfinite_module": None if bad is None else bad["module"],
                        "first_nonfinite_class": None if bad is None else bad["class"],
                        "rank": record["rank"]})
    return sorted(summary, key=lambda entry: (entry["step"], entry["global_rank"]))


def probes_summary(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every probe the records list that saw a non-finite value, with its rank and step."""
    return [{"global_rank": record["rank"]["global_rank"], "step": record["step"], "label": probe["label"],
             "module": probe.get("module"), "nan": probe["nan"], "inf": probe["inf"]}
            for record in records if record.get("kind") == RecordKind.PROBE for probe in record["probes"]]


def probes_total(records: List[Dict[str, Any]]) -> int:
    """How many non-finite probes the records counted, listed or not."""
    return sum(max(record.get("probes_total", 0), len(record["probes"])) for record in records
               if record.get("kind") == RecordKind.PROBE)


def summary_lines(run_dir: str, frames: Sequence[Dict[str, Any]], probes: Sequence[Dict[str, Any]],
                  total_probes: int, limit: int = 4) -> List[str]:
    lines, command = [], f"gradnan frames {shell_word(run_dir)}"
    detected = [entry for entry in frames if entry["mode"] == "detect"]
    for entry in detected[:limit]:
        lines.append(f"Forward frames: {rank_label(entry['rank'])} step {entry['step']}: first non-finite in"
                     f" {untrusted(entry['first_nonfinite_module'] or '<model>')}"
                     f" ({untrusted(entry['first_nonfinite_class'])});"
                     f" {command} --rank {entry['global_rank']} --step {entry['step']}")
    traced = sorted({entry["step"] for entry in frames if entry["mode"] == "trace"})
    if traced:
        lines.append(f"Traced frames at step(s) {', '.join(map(str, traced[:8]))}"
                     f"{' ...' if len(traced) > 8 else ''}: {command} --step {traced[0]}")
    for probe in probes[:limit]:
        where = untrusted(probe["module"] or "code outside any module")
        lines.append(f"gradnan.check({untrusted(repr(probe['label']))}) in {where}:"
                     f" {nonfinite_counts(probe)} at step {probe['step']} on rank {probe['global_rank']}")
    if total_probes > limit:  # ``probes_total``: never fewer than the probes listed
        lines.append(f"  ... and {total_probes - limit} more probe finding(s) (see --json)")
    return lines


def _stat(number: Any) -> str:
    if number is None:
        return f"{'-':>8}"
    if isinstance(number, str):
        return f"{untrusted(number):>8}"
    return f"{number:8.2e}"


def _near_limit(entry: Dict[str, Any]) -> str:
    """A marker where a finite abs-max is within 2x of its dtype's largest value: the climb to an overflow."""
    limit, value = DTYPE_MAX.get(entry["dtype"]), entry["abs_max"]
    if limit is None or not isinstance(value, (int, float)) or value * 2 < limit:
        return ""
    return f"  [near {untrusted(entry['dtype'].replace('torch.', ''))} max {limit:.2e}]"


def format_frames(record: Dict[str, Any], limit: Optional[int] = None) -> str:
    """A frames record as DebugUnderflowOverflow lays its frames out; ``limit``: the last so many frames."""
    frames = record["frames"] if limit is None else record["frames"][-limit:]
    first = record.get("first_nonfinite")
    head = (f"{rank_label(record['rank'])} step {record['step']}, {untrusted(record.get('mode'))} mode:"
            f" {len(frames)} forward frame(s)")
    if first is not None:
        bad = record["frames"][first]
        head += f"; first non-finite: {_module_text(bad)}"
    lines = [head, f"{'abs min':>8} {'abs max':>8} metadata"]
    for frame in frames:
        recomputed = f" (recomputed x{frame['recomputed']})" if frame["recomputed"] else ""
        lines.append(f"{'':17} {_module_text(frame)}{recomputed}")
        for entry in frame["entries"]:
            lines.append(f"{_stat(entry['abs_min'])} {_stat(entry['abs_max'])}"
                         f" {untrusted(entry['name'])}{_near_limit(entry)}")
    return printable_lines(lines)
