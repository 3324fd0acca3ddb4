"""Which launch each record belongs to, and which step of a launch is its first failure.

A run directory may hold several launches (a restart, a requeue, another job writing into the same
``out_dir``); the report speaks of one at a time.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ...formats.incident import RecordKind
from ...formats.schema import NONFINITE_WORDS

SERIOUS_SKIPS = 3  # consecutive fp16 loss-scale skips that are a failure (``gradnan report --fp16-skips``)
RUN_GAP_SECONDS = 300.0


def _started(record: Dict[str, Any]) -> float:
    run = record.get("run")
    value = run.get("started", record.get("time", 0.0)) if isinstance(run, dict) else record.get("time", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def split_runs(records: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Records by launch: the launcher's run id and restart attempt where known, else launches told
    apart by their rendezvous (two jobs at once cannot share one) and their processes' start times (a
    gap of more than RUN_GAP_SECONDS starts a new one)."""
    runs: Dict[str, List[Dict[str, Any]]] = {}
    anonymous: Dict[Any, List[Dict[str, Any]]] = {}
    for record in records:
        run = record.get("run")
        if not isinstance(run, dict):
            run = {}
        if run.get("id"):
            runs.setdefault(f"{run['id']}#{run.get('attempt', 0)}", []).append(record)
        else:
            anonymous.setdefault(run.get("rendezvous"), []).append(record)
    for rendezvous, group in anonymous.items():
        for launch in _split_by_start(group):
            key = "started@" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_started(launch[0])))
            runs.setdefault(f"{key} via {rendezvous}" if key in runs else key, []).extend(launch)
    return dict(sorted(runs.items(), key=lambda item: min(map(_started, item[1]))))


def _split_by_start(records: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """Records in launches: a gap of more than RUN_GAP_SECONDS between start times starts a new one."""
    launches: List[List[Dict[str, Any]]] = []
    for record in sorted(records, key=_started):
        if not launches or _started(record) - _started(launches[-1][-1]) > RUN_GAP_SECONDS:
            launches.append([])
        launches[-1].append(record)
    return launches


def failing_step(incidents: List[Dict[str, Any]], serious_skips: int) -> Optional[int]:
    """The first step that is a failure, not a routine fp16 loss-scale skip (one of a few in a row, or any
    number while the scale warms up before the first applied update, short of its collapse). A skip whose
    loss was non-finite (``loss_finite: false``) is a failure at its own step, warm-up or not. For a run
    of consecutive skips that became serious, the step where that run began (its origin is the
    interesting one)."""
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    for record in incidents:
        by_step.setdefault(record["step"], []).append(record)
    for step in sorted(by_step):
        records = by_step[step]
        overflows = [r for r in records if r["kind"] == RecordKind.LOSS_SCALE_OVERFLOW]
        serious = [r for r in overflows if r.get("scale_collapsed") or r.get("loss_scale") in NONFINITE_WORDS
                   or (not r.get("warmup") and (r.get("consecutive_skips") or 1) >= serious_skips)]
        if (any(r["kind"] == RecordKind.NONFINITE_GRAD_NORM for r in records) or (not overflows and records)
                or any(r.get("loss_finite") is False for r in overflows)):
            return step
        if serious:
            start = step - max((r.get("consecutive_skips") or 1) for r in serious) + 1
            return min((s for s in by_step if start <= s <= step), default=step)
        if any(r["kind"] == RecordKind.RERUN for r in records):  # run again in place: never routine
            return step
    return None
