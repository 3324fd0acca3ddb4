"""Where and how every rank writes its files. Formats are documented in docs/formats.md.

    <out_dir>/maps/<rank tag>[_opt<k>].json     one parameter map per optimizer, written atomically
    <out_dir>/records/<rank tag>.jsonl          append-only JSON lines, flushed and fsynced per record

The rank tag starts with the global rank (unique per process) and carries the tp/pp/dp coordinates,
plus cp/ep where their sizes are above 1: ``rank00003_tp1_pp0_dp1``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping

SCHEMA_VERSION = 1
MAP_SCHEMA = "gradnan.map"
RECORD_SCHEMA = "gradnan.record"
MAPS_DIR = "maps"
RECORDS_DIR = "records"


AXES = ("tp", "pp", "dp", "cp", "ep")
FORWARD_SHARE = 0.9  # this share of a rank's gradients non-finite: the forward pass already was


def shown_axes(coords: Mapping[str, Any]) -> List[str]:
    """The parallel axes worth naming for a rank: tp, pp and dp always, cp and ep where used (size > 1)."""
    return [axis for axis in AXES if axis in ("tp", "pp", "dp") or (coords.get(f"{axis}_size") or 1) > 1]


def rank_tag(coords: Mapping[str, Any]) -> str:
    parts = [f"rank{int(coords['global_rank']):05d}"]
    for axis in shown_axes(coords):
        value = coords.get(axis)
        parts.append(f"{axis}{value if value is not None else 'x'}")
    return "_".join(parts)


def map_path(out_dir: str, coords: Mapping[str, Any], optimizer_index: int) -> Path:
    suffix = f"_opt{optimizer_index}" if optimizer_index else ""
    return Path(out_dir) / MAPS_DIR / f"{rank_tag(coords)}{suffix}.json"


def records_path(out_dir: str, coords: Mapping[str, Any]) -> Path:
    return Path(out_dir) / RECORDS_DIR / f"{rank_tag(coords)}.jsonl"


def run_identity(run_id: str, environ: Mapping[str, str], started: float) -> Dict[str, Any]:
    """Names this launch in every record: all ranks of one launch agree on ``id`` and ``attempt``
    without talking to each other (launcher variables); ``started`` tells launches apart otherwise."""
    launcher_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if launcher_id in ("", "none"):
        launcher_id = environ.get("SLURM_JOB_ID", "")
    counts = [environ.get(name, "") for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
    attempt = ".".join(count for count in counts if count.isdigit()) or "0"  # requeue.restart under both
    return {"id": run_id or launcher_id or None, "attempt": attempt, "started": started}


def json_float(value: float) -> Any:
    """JSON has no NaN/Inf: non-finite floats are written as the strings "nan", "inf", "-inf"."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def write_json_atomic(path: Path, document: Mapping[str, Any]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(temporary, 0o644)  # mkstemp makes it 0600; maps are read by other users' tools
        with os.fdopen(handle, "w") as stream:
            json.dump(document, stream, indent=1, allow_nan=False)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def append_record(path: Path, record: Mapping[str, Any]) -> None:
    """One JSON line, flushed and fsynced before returning: the process may die right after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
    with open(path, "a") as stream:
        stream.write(line)
        stream.flush()
        os.fsync(stream.fileno())
