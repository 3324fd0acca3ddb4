"""The ``gradnan.selftest`` result (docs/selftest.md): built from every rank's checks on rank 0 and
written to ``<out>/selftest/selftest-<UTC time>.json``, never over an earlier result."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..errors import InputError
from ..formats import selftest as result_format
from ..formats.layout import SELFTEST_DIR
from ..formats.safe_write import write_json_atomic


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


def write_result(out_dir: Path, started: datetime.datetime, document: Dict[str, Any]) -> Path:
    """Write ``document`` to a new result file, ``<out>/selftest/selftest-<UTC time>[-N].json``: never over
    an earlier result, never through a symbolic link below ``out_dir`` (a linked ``selftest/``: nothing is
    created there). ``InputError`` when it cannot be written."""
    stem = out_dir / SELFTEST_DIR / f"selftest-{started.strftime('%Y%m%dT%H%M%SZ')}"
    attempt = 1
    while True:
        path = stem.with_name(stem.name + (".json" if attempt == 1 else f"-{attempt}.json"))
        try:
            write_json_atomic(path, document, replace=False, root=out_dir)
            return path
        except FileExistsError:
            attempt += 1
        except OSError as exc:
            raise InputError(f"--out {out_dir}: cannot write the result: {exc}") from None
