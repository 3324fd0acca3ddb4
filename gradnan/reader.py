"""Strict readers for the files gradnan writes. JSON only: opening a file never executes code from it.

Each problem becomes a one-line message naming the file and what is wrong. A run directory in which
some files are bad is still read: the good files are returned and the bad ones listed in ``problems``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

from .records import MAP_SCHEMA, MAPS_DIR, RECORD_SCHEMA, RECORDS_DIR, SCHEMA_VERSION

SELFTEST_SCHEMA = "gradnan.selftest"
SELFTEST_DIR = "selftest"
BUNDLE_MANIFESTS = "bundles/*/*/manifest.json"


class ReadError(Exception):
    """A file or directory gradnan cannot use; the message is one line."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_schema(document: Any, schema: str, where: str) -> None:
    if not isinstance(document, dict):
        raise ReadError(f"{where}: not a JSON object")
    if document.get("schema") != schema:
        raise ReadError(f"{where}: not a {schema} document (schema={document.get('schema')!r})")
    version = document.get("version")
    if not _is_int(version):
        raise ReadError(f"{where}: missing or invalid schema version")
    if version > SCHEMA_VERSION:
        raise ReadError(
            f"{where}: {schema} version {version} is newer than this gradnan reads ({SCHEMA_VERSION});"
            " upgrade gradnan"
        )


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReadError(f"{where}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise ReadError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python converts
        raise ReadError(f"{where}: invalid JSON ({str(exc).splitlines()[0][:80]})") from None


def _is_number(value: Any) -> bool:
    """A usable number: not a bool, not NaN/Inf, and small enough for a float (time stamps, counts)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e15 < value < 1e15


def _optional(value: Any, check) -> bool:
    return value is None or check(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)


_RANK_INTS = ("tp", "pp", "dp", "cp", "ep", "tp_size", "pp_size", "dp_size", "cp_size", "ep_size",
              "world_size", "local_rank", "pid")
_PARAM_INTS = ("nan", "inf", "pos_inf", "neg_inf", "numel", "order", "id", "first_bad_flat")


def check_rank(rank: Any, where: str) -> None:
    """The rank object every reader and the report rely on: integers where integers go, text for host."""
    if not isinstance(rank, dict) or not _is_int(rank.get("global_rank")):
        raise ReadError(f"{where}: needs a 'rank' object with an integer 'global_rank'")
    for key in _RANK_INTS:
        if not _optional(rank.get(key), _is_int):
            raise ReadError(f"{where}: rank.{key} must be an integer")
    for key in ("host", "device"):
        if not _optional(rank.get(key), _is_text):
            raise ReadError(f"{where}: rank.{key} must be text")


def _check_record(record: Dict[str, Any], where: str) -> None:
    if not _is_int(record.get("step")):
        raise ReadError(f"{where}: a record needs an integer 'step'")
    check_rank(record.get("rank"), where)
    params = record.get("params")
    if not isinstance(params, list):
        raise ReadError(f"{where}: a record needs a 'params' list")
    for position, entry in enumerate(params):
        if not isinstance(entry, dict) or not _is_text(entry.get("name")) or not all(
                _optional(entry.get(key), _is_int) for key in _PARAM_INTS) or not all(
                _is_int(entry.get(key)) for key in ("nan", "inf")):
            raise ReadError(f"{where}: params[{position}] needs a text 'name' and integer counts")
    for key in ("params_total", "consecutive_skips", "iteration", "optimizer_index", "bucket_group"):
        if not _optional(record.get(key), _is_int):
            raise ReadError(f"{where}: '{key}' must be an integer")
    if not _optional(record.get("time"), _is_number) or not _optional(record.get("scale_collapsed"),
                                                                       lambda v: isinstance(v, bool)):
        raise ReadError(f"{where}: 'time' must be a number and 'scale_collapsed' a boolean")
    run = record.get("run")
    if run is not None and not (isinstance(run, dict) and _optional(run.get("started"), _is_number)
                                and _optional(run.get("id"), _is_text)
                                and _optional(run.get("attempt"), lambda v: _is_int(v) or _is_text(v))):
        raise ReadError(f"{where}: 'run' needs a numeric 'started', a text 'id' and an 'attempt'")
    for key in ("kind", "pre_reduction", "mode", "map"):
        if not _optional(record.get(key), _is_text):
            raise ReadError(f"{where}: '{key}' must be text")
    if record.get("kind") == "frames":
        _check_frames(record, where)
    elif record.get("kind") == "probe":
        _check_probes(record, where)


def _is_stat(value: Any) -> bool:
    """An abs-min/abs-max as written: a number, "nan"/"inf"/"-inf", or null (not measured)."""
    return value is None or value in ("nan", "inf", "-inf") or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def _check_frames(record: Dict[str, Any], where: str) -> None:
    frames, first = record.get("frames"), record.get("first_nonfinite")
    if not isinstance(frames, list) or not (first is None or (_is_int(first) and 0 <= first < len(frames))):
        raise ReadError(f"{where}: a frames record needs a 'frames' list and 'first_nonfinite' null or the index"
                        " of one of them")
    for position, frame in enumerate(frames):
        if not (isinstance(frame, dict) and _is_text(frame.get("module")) and _is_text(frame.get("class"))
                and all(_is_int(frame.get(key)) for key in ("step", "call", "recomputed"))
                and isinstance(frame.get("entries"), list)):
            raise ReadError(f"{where}: frames[{position}] needs text 'module'/'class', integer 'step'/'call'/"
                            "'recomputed' and an 'entries' list")
        for entry in frame["entries"]:
            if not (isinstance(entry, dict) and all(_is_text(entry.get(key)) for key in ("name", "kind", "dtype"))
                    and _is_stat(entry.get("abs_min")) and _is_stat(entry.get("abs_max"))):
                raise ReadError(f"{where}: frames[{position}] has an entry without text 'name'/'kind'/'dtype'"
                                " and numeric 'abs_min'/'abs_max'")


def _check_probes(record: Dict[str, Any], where: str) -> None:
    probes = record.get("probes")
    if not isinstance(probes, list) or not all(
            isinstance(probe, dict) and _is_text(probe.get("label")) and _optional(probe.get("module"), _is_text)
            and _is_int(probe.get("nan")) and _is_int(probe.get("inf")) and _is_stat(probe.get("abs_min"))
            and _is_stat(probe.get("abs_max")) for probe in probes):
        raise ReadError(f"{where}: a probe record needs a 'probes' list of text 'label', integer 'nan'/'inf'")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReadError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ReadError(f"{path}: cannot read ({exc.strerror or exc})") from None


def load_map(path: Path) -> Dict[str, Any]:
    document = parse_json(read_text(path), str(path))
    check_schema(document, MAP_SCHEMA, str(path))
    params = document.get("params")
    rank = document.get("rank")
    if not isinstance(params, list) or not isinstance(rank, dict):
        raise ReadError(f"{path}: a map needs a 'params' list and a 'rank' object")
    for position, entry in enumerate(params):
        if not (isinstance(entry, dict) and _is_int(entry.get("id")) and _is_text(entry.get("name"))):
            raise ReadError(f"{path}: params[{position}] needs an integer 'id' and a string 'name'")
    check_rank(rank, str(path))
    return document


def load_records(path: Path) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The records of one rank's file, and a problem per line that could not be used.

    A last line without its newline is a record cut short (the process died while writing it)."""
    text = read_text(path)
    records, problems = [], []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = parse_json(line, where)
            check_schema(record, RECORD_SCHEMA, where)
            _check_record(record, where)
        except ReadError as exc:
            cut_short = number == len(lines) and not text.endswith("\n")
            problems.append(f"{where}: truncated last line (the rank died while writing it)"
                            if cut_short else str(exc))
            continue
        records.append(record)
    return records, problems


def load_selftest(path: Path) -> Dict[str, Any]:
    document = parse_json(read_text(path), str(path))
    check_schema(document, SELFTEST_SCHEMA, str(path))
    failing = document.get("failing_ranks")
    if not isinstance(document.get("pass"), bool) or not isinstance(failing, list) or not all(
            isinstance(entry, dict) and _is_int(entry.get("rank")) and _optional(entry.get("host"), _is_text)
            and _optional(entry.get("device"), _is_text) for entry in failing) or not _optional(
            document.get("world_size"), _is_int) or not _optional(document.get("time"), _is_text):
        raise ReadError(f"{path}: a self-test result needs 'pass' and a 'failing_ranks' list of ranks")
    return document


def load_bundle_manifest(path: Path) -> Dict[str, Any]:
    """A capture bundle's manifest alone (its tensors are read by ``gradnan replay``)."""
    document = parse_json(read_text(path), str(path))
    check_schema(document, "gradnan.bundle", str(path))
    module = document.get("module")
    if not isinstance(module, dict) or not _is_text(module.get("path")) or not _is_int(document.get("step")):
        raise ReadError(f"{path}: a bundle manifest needs a 'module' with a 'path' and an integer 'step'")
    check_rank(document.get("rank"), str(path))
    return document


@dataclass
class RunFiles:
    """Everything readable in a run directory, with one line per file or line that was not."""

    run_dir: Path
    maps: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    records: Dict[Path, List[Dict[str, Any]]] = field(default_factory=dict)
    selftests: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    bundles: Dict[Path, Dict[str, Any]] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)

    def all_records(self) -> List[Dict[str, Any]]:
        return [record for records in self.records.values() for record in records]


def read_run(run_dir: Path) -> RunFiles:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReadError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise ReadError(f"{run_dir}: not a directory")
    map_files = sorted((run_dir / MAPS_DIR).glob("*.json"))
    record_files = sorted((run_dir / RECORDS_DIR).glob("*.jsonl"))
    selftest_files = sorted((run_dir / SELFTEST_DIR).glob("*.json"))
    if not map_files and not record_files and not selftest_files:
        raise ReadError(f"{run_dir}: no gradnan maps or records here (expected {MAPS_DIR}/ and"
                        f" {RECORDS_DIR}/ as written by gradnan.install(out_dir=...))")
    files = RunFiles(run_dir)
    for path in map_files:
        try:
            files.maps[path] = load_map(path)
        except ReadError as exc:
            files.problems.append(str(exc))
    for path in selftest_files:
        try:
            files.selftests[path] = load_selftest(path)
        except ReadError as exc:
            files.problems.append(str(exc))
    for path in sorted(run_dir.glob(BUNDLE_MANIFESTS)):
        if path.parent.name.startswith("."):  # a bundle still being written (or its writer died)
            continue
        try:
            files.bundles[path.parent] = load_bundle_manifest(path)
        except ReadError as exc:
            files.problems.append(str(exc))
    for path in record_files:
        try:
            records, problems = load_records(path)
        except ReadError as exc:
            files.problems.append(str(exc))
            continue
        files.records[path] = records
        files.problems += problems
    return files
