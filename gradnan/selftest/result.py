"""The ``gradnan.selftest`` result (docs/selftest.md): built from every rank's checks on rank 0 and
written to ``<out>/selftest/selftest-<UTC time>.json``, never over an earlier result."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..errors import InputError
from ..formats import selftest as result_format
from ..formats.layout import SELFTEST_DIR
from ..formats.schema import write_json_atomic


def failing_ranks(checks: Sequence[Dict[str, Any]], unreachable: Optional[Dict[str, Any]],
                  ranks: Mapping[int, Dict[str, Any]], timeout: float) -> List[Dict[str, Any]]:
    """Every rank named by a check or by a timed-out barrier, with host, device and why."""
    reasons: Dict[int, List[str]] = {}
    for check in checks:
        for row in check["ranks"]:
            if not row["agrees"]:
                reasons.setdefault(row["rank"], []).append(f"{check['name']}: {row['detail']}")
    if unreachable:
        for rank in unreachable["ranks"]:
            reasons.setdefault(rank, []).append(f"did not reach {unreachable['phase']} within {timeout:g} s")
    return [{"rank": rank, "host": ranks.get(rank, {}).get("host"),
             "device": ranks.get(rank, {}).get("device"), "reasons": why}
            for rank, why in sorted(reasons.items())]


def build_document(*, started: datetime.datetime, world_size: int, layout: Optional[Dict[str, int]],
                   backend: str, size: int, seconds: Optional[float], repeats: int, timeout: float,
                   torch_version: str, cuda_version: Optional[str], ranks: Mapping[int, Dict[str, Any]],
                   checks: List[Dict[str, Any]], skipped: List[Dict[str, Any]],
                   unreachable: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``gradnan.selftest`` result (docs/selftest.md)."""
    failing = failing_ranks(checks, unreachable, ranks, timeout)
    return {
        **result_format.SCHEMA.header(),
        "time": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "world_size": world_size, "layout": layout, "backend": backend, "size": size,
        "seconds": seconds, "repeats": repeats, "timeout": timeout,
        "torch_version": torch_version, "cuda_version": cuda_version,
        "ranks": [{"rank": rank, **ranks[rank]} for rank in sorted(ranks)],
        "checks": checks, "skipped": skipped, "unreachable": unreachable,
        "failing_ranks": failing,
        "pass": not failing and unreachable is None and all(check["pass"] for check in checks),
    }


def result_path(out_dir: Path, started: datetime.datetime) -> Path:
    """``<out>/selftest/selftest-<UTC time>.json``, claimed exclusively: an existing file is never
    replaced."""
    directory = out_dir / SELFTEST_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"selftest-{started.strftime('%Y%m%dT%H%M%SZ')}"
    attempt = 1
    while True:
        path = directory / (f"{stem}.json" if attempt == 1 else f"{stem}-{attempt}.json")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            attempt += 1


def write_result(out_dir: Path, started: datetime.datetime, document: Dict[str, Any]) -> Path:
    """Write ``document`` to a new result file under ``out_dir``; ``InputError`` when it cannot be written."""
    try:
        path = result_path(out_dir, started)
        write_json_atomic(path, document, root=out_dir)
    except OSError as exc:
        raise InputError(f"--out {out_dir}: cannot write the result: {exc}") from None
    return path
