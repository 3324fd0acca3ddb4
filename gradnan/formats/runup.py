"""A rank's run-up (``gradnan.runup``): the last steps of each gradient bucket's largest magnitude before the
data-parallel collective, written at an incident, and which parameters each bucket holds.

One file per rank and incident step, ``runup/<rank tag>_<when>.json`` (docs/formats.md). The reader takes
it as untrusted input: every size is bounded (``MAX_RUNUP_STEPS`` rows, ``MAX_BUCKETS`` buckets,
``MAX_VALUES`` numbers, ``MAX_NAMES`` parameter names), every value is a magnitude (a number >= 0, or
"nan"/"inf"), every row as wide as its group has buckets, steps strictly increasing; anything else is one
problem naming the file, never an exception out of the report.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..errors import InputError
from .schema import (
    FilePath,
    Schema,
    check_rank,
    check_run,
    is_finite,
    is_int,
    is_text,
    optional,
    parse_document,
    read_bytes,
    read_document,
)

SCHEMA = Schema("gradnan.runup", 1)
STATISTIC = "abs_max"  # each bucket's largest |gradient| before the collective (the pre-reduction check's)
MAX_RUNUP_STEPS = 4096  # ``runup_steps`` at most, and the rows a reader accepts per group
MAX_BUCKETS = 1 << 16  # buckets in one file, all groups together
MAX_VALUES = 1 << 22  # numbers in one file
MAX_NAMES = 1 << 21  # parameter names in one file
MAX_RUNUP_BYTES = 64 << 20  # a JSON document this size parses in well under a GiB of memory


def is_magnitude(value: Any) -> bool:
    """A bucket's largest magnitude as written: a finite number >= 0, or "nan"/"inf" (``json_float``)."""
    return value in ("nan", "inf") or (is_finite(value) and value >= 0)


def to_json(coords: Mapping[str, Any], run: Mapping[str, Any], step: int, iteration: Optional[int],
            groups: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One rank's run-up at ``step``; ``groups``: per bucket group its ``bucket_group`` number, the
    ``steps`` its rows were written at (oldest first), its ``buckets`` (``bucket``, ``numel``, ``params``:
    global names) and ``values`` (one row per step, one magnitude per bucket)."""
    return {**SCHEMA.header(), "rank": dict(coords), "run": dict(run), "step": step, "iteration": iteration,
            "statistic": STATISTIC, "groups": [dict(group) for group in groups]}


def _all_text(names: List[Any]) -> bool:
    """Every item a string ``is_text`` accepts, checked at once: a bucket lists thousands of names (a join
    takes strings alone)."""
    try:
        return is_text("".join(names))
    except TypeError:
        return False


def _check_buckets(buckets: Any, where: str) -> int:
    """The parameter names the buckets list; InputError for a malformed entry."""
    if not isinstance(buckets, list) or not buckets:
        raise InputError(f"{where}: a group needs a non-empty 'buckets' list")
    names = 0
    for position, bucket in enumerate(buckets):
        params = bucket.get("params") if isinstance(bucket, dict) else None
        if not (isinstance(bucket, dict) and is_int(bucket.get("bucket")) and bucket["bucket"] >= 0
                and is_int(bucket.get("numel")) and bucket["numel"] >= 0 and isinstance(params, list)
                and _all_text(params)):
            raise InputError(f"{where}: buckets[{position}] needs integers 'bucket'/'numel' >= 0 and a"
                             " 'params' list of names")
        names += len(params)
    return names


def _check_group(group: Any, where: str) -> List[int]:
    """``[buckets, values, names]`` of one valid group; InputError otherwise."""
    if not isinstance(group, dict) or not is_int(group.get("bucket_group")) or group["bucket_group"] < 0:
        raise InputError(f"{where}: a group needs an integer 'bucket_group' >= 0")
    steps, values = group.get("steps"), group.get("values")
    if not (isinstance(steps, list) and all(is_int(step) for step in steps)
            and all(a < b for a, b in zip(steps, steps[1:]))):
        raise InputError(f"{where}: 'steps' must be a list of integers, strictly increasing")
    if len(steps) > MAX_RUNUP_STEPS:
        raise InputError(f"{where}: {len(steps)} steps (at most {MAX_RUNUP_STEPS})")
    names = _check_buckets(group.get("buckets"), where)
    width = len(group["buckets"])
    if not (isinstance(values, list) and len(values) == len(steps)):
        raise InputError(f"{where}: 'values' needs one row per step ({len(steps)})")
    for position, row in enumerate(values):
        if not (isinstance(row, list) and len(row) == width and all(map(is_magnitude, row))):
            raise InputError(f"{where}: values[{position}] needs {width} magnitudes (numbers >= 0, \"nan\""
                             " or \"inf\")")
    return [width, width * len(steps), names]


def from_json(document: Any, where: str) -> Dict[str, Any]:
    """One run-up, checked and bounded: InputError (one line) for anything a reader could not use."""
    document = SCHEMA.check(document, where)
    check_rank(document.get("rank"), where)
    check_run(document.get("run"), where)
    if not is_int(document.get("step")) or not optional(document.get("iteration"), is_int):
        raise InputError(f"{where}: a run-up needs an integer 'step' and an integer or null 'iteration'")
    if document.get("statistic") != STATISTIC:
        raise InputError(f"{where}: 'statistic' must be {STATISTIC!r}")
    groups = document.get("groups")
    if not isinstance(groups, list):
        raise InputError(f"{where}: a run-up needs a 'groups' list")
    totals = [0, 0, 0]
    for position, group in enumerate(groups):
        sizes = _check_group(group, f"{where}: groups[{position}]")
        totals = [total + size for total, size in zip(totals, sizes)]
    for total, bound, what in zip(totals, (MAX_BUCKETS, MAX_VALUES, MAX_NAMES), ("buckets", "values",
                                                                                  "parameter names")):
        if total > bound:
            raise InputError(f"{where}: {total} {what} (at most {bound})")
    if len({group["bucket_group"] for group in groups}) != len(groups):
        raise InputError(f"{where}: a 'bucket_group' appears twice")
    return document


def load(path: FilePath) -> Dict[str, Any]:
    return from_json(read_document(path, SCHEMA, MAX_RUNUP_BYTES), str(path))


def loader_naming(parameter: str) -> Callable[[FilePath], Optional[Dict[str, Any]]]:
    """``load`` for a file whose bytes can name ``parameter``; None for another, without parsing it: a file
    without a backslash writes every string as its own UTF-8 bytes, so a bucket listing the parameter
    holds its JSON string as is (one of 131,072 ranks' files costs a read and a search)."""
    needle = json.dumps(parameter, ensure_ascii=False).encode("utf-8", "surrogatepass")

    def load_naming(path: FilePath) -> Optional[Dict[str, Any]]:
        data = read_bytes(path, MAX_RUNUP_BYTES)
        if needle not in data and b"\\" not in data:
            return None
        return from_json(parse_document(data, path, SCHEMA), str(path))

    return load_naming
