"""Shared assertions over what a real run wrote."""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from gradnan.offline.read import read_run


def environ_without_gradnan() -> Dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("GRADNAN_")}


@contextlib.contextmanager
def gradnan_variables_cleared() -> Iterator[pytest.MonkeyPatch]:
    """For a module-scoped fixture: no ``GRADNAN_*`` variable is set inside the block (restored after)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [key for key in os.environ if key.startswith("GRADNAN_")]:
            patch.delenv(key)
        yield patch


def records_by_rank(run_dir: Path) -> Dict[int, List[Dict[str, Any]]]:
    files = read_run(run_dir)
    assert not files.problems, files.problems
    by_rank: Dict[int, List[Dict[str, Any]]] = {}
    for record in files.all_records():
        by_rank.setdefault(record["rank"]["global_rank"], []).append(record)
    return by_rank


def map_names(map_file: str) -> Dict[int, str]:
    from gradnan.formats.maps import load as load_map

    return {entry["id"]: entry["name"] for entry in load_map(Path(map_file))["params"]}


def assert_origin(run_dir: Path, *, rank: int, step: int, param: str, value: str, index: int,
                  kind: str) -> Dict[str, Any]:
    """The first record on ``rank`` is at ``step``, names exactly ``param`` (one bad element at ``index``),
    and the map file resolves the reported id to the same name. Returns that record."""
    by_rank = records_by_rank(run_dir)
    assert rank in by_rank, f"no record on rank {rank}; ranks with records: {sorted(by_rank)}"
    record = min(by_rank[rank], key=lambda r: r["step"])
    assert record["step"] == step
    assert record["kind"] == kind
    assert [p["name"] for p in record["params"]] == [param]
    found = record["params"][0]
    assert found["first_bad_flat"] == index
    expected_counts = {"nan": (1, 0), "inf": (0, 1)}[value]
    assert (found["nan"], found["inf"]) == expected_counts
    assert map_names(record["map"])[found["id"]] == param
    return record


def assert_clean_elsewhere(run_dir: Path, *, origin: int, step: int) -> None:
    """Every other rank's records at ``step`` (if any) name no local parameter."""
    for rank, records in records_by_rank(run_dir).items():
        if rank == origin:
            continue
        at_step = [r for r in records if r["step"] == step]
        assert all(not r["params"] and not r["local_nonfinite"] for r in at_step), (rank, at_step)


def step_trace(outcome) -> Dict[int, List[tuple]]:
    """Each rank's (loss, grad norm, update applied) per step, floats as exact hex: compares bitwise."""
    def bits(value):
        return None if value is None else float(value).hex()

    return {rank: [(bits(s.loss), bits(s.grad_norm), s.update_successful) for s in result.steps]
            for rank, result in outcome.items()}


def weight_digests(outcome) -> Dict[int, str]:
    """Each rank's SHA-256 of its weights after the last step: equal digests, bitwise equal weights."""
    return {rank: result.param_digest for rank, result in outcome.items()}


def rerun_block(text: str) -> List[str]:
    """The report's lines about the rerun of the failing step (``Forward origin (...`` or ``Rerun of ...``
    and the indented lines under it): evidence, after the verdict, the origin and the next steps."""
    lines = text.splitlines()
    start = next(number for number, line in enumerate(lines)
                 if line.startswith(("Forward origin (", "Rerun of ")))
    end = next((number for number in range(start + 1, len(lines)) if not lines[number].startswith(" ")),
               len(lines))
    return lines[start:end]


def printed_commands(text: str, command: str) -> List[List[str]]:
    """The copyable ``gradnan COMMAND ...`` lines of a report, as a shell splits them: under ``Next:``, or
    in the rerun's lines where no next step prints them (``replay it: ...``, ``the micro-batch: PATH``,
    which ``gradnan batch PATH`` reads)."""
    found = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("replay it: "):
            stripped = stripped.split(": ", 1)[1]
        elif stripped.startswith("the micro-batch: "):
            stripped = "gradnan batch " + stripped.split(": ", 1)[1]
        if stripped.startswith(f"gradnan {command} "):
            found.append(shlex.split(stripped))
    return found
