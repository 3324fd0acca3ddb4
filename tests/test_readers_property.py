"""Property-based tests (hypothesis) for every reader and for what runs on what the readers accept.

Issue "Hardening": arbitrary bytes and mutated valid files never crash a reader with anything but the
clear error (a one-line ``ReadError`` naming the file); the report and the CLI never crash on a run
directory the readers accepted; and no reader ever executes code from a file.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradnan.cli import main
from gradnan.maps import ParamSlot, map_document
from gradnan.reader import (
    SELFTEST_DIR,
    SELFTEST_SCHEMA,
    ReadError,
    load_map,
    load_records,
    load_selftest,
    read_run,
)
from gradnan.records import MAPS_DIR, RECORD_SCHEMA, RECORDS_DIR, SCHEMA_VERSION, rank_tag
from gradnan.report import build_report, format_text

# --- a fresh directory per example ------------------------------------------------------------


@contextlib.contextmanager
def fresh_dir() -> Iterator[Path]:
    """A new directory for each hypothesis example: ``tmp_path`` is created once per test function,
    so every example of a test would share it and one example's files would leak into the next."""
    with tempfile.TemporaryDirectory(prefix="gradnan-property-") as name:
        yield Path(name)


def write_files(run_dir: Path, files: Dict[str, bytes]) -> Path:
    for relative, content in files.items():
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return run_dir


# --- valid documents, shaped like the runtime and the self-test write them ----------------------

WORLD_SIZE = 4
PARAM_NAMES = (
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.1.mlp.linear_fc2.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)
INCIDENT_KINDS = ("nonfinite_grad_norm", "loss_scale_overflow", "pre_reduction")
ranks = st.integers(0, WORLD_SIZE - 1)


def coords(rank: int) -> Dict[str, Any]:
    """A 4-rank TP2 x DP2 job, as ``rank_coordinates()`` describes one rank of it."""
    return {"global_rank": rank, "world_size": WORLD_SIZE, "local_rank": rank % 2,
            "host": f"node-{rank // 2}", "device": f"cuda:{rank % 2}", "pid": 1000 + rank,
            "tp": rank % 2, "tp_size": 2, "pp": 0, "pp_size": 1, "dp": rank // 2, "dp_size": 2,
            "cp": 0, "cp_size": 1, "ep": 0, "ep_size": 1}


@st.composite
def map_documents(draw, rank: st.SearchStrategy[int] = ranks) -> Dict[str, Any]:
    names = draw(st.lists(st.sampled_from(PARAM_NAMES), min_size=1, max_size=4, unique=True))
    slots = [ParamSlot(id=position, name=name, shape=(4, 2), dtype="torch.bfloat16", numel=8, group=0,
                       wd_mult=1.0, lr_mult=None, is_expert=False, optimizer=0,
                       shard=draw(st.sampled_from([None, (0, 4)])), main_dtype="torch.float32",
                       order=position)
             for position, name in enumerate(names)]
    document = map_document(coords(draw(rank)), {"megatron-core": "0.16.1", "torch": "2.13.0"}, 0,
                            "DistributedOptimizer", slots)
    document["written_at"] = 1.7e9  # not the clock: hypothesis needs the same bytes for the same draws
    return document


def param_entry(position: int, name: str, bad: str, near_limit: bool) -> Dict[str, Any]:
    return {"id": position, "name": name, "kind": bad, "nan": int(bad == "nan"), "inf": int(bad == "inf"),
            "pos_inf": int(bad == "inf"), "neg_inf": 0, "first_bad_flat": 3, "first_bad_index": [1, 1],
            "abs_max_finite": 6.0e4 if near_limit else 0.25, "near_limit": near_limit, "numel": 8,
            "shard": None, "is_expert": False, "order": position}


@st.composite
def record_documents(draw, rank: st.SearchStrategy[int] = ranks) -> Dict[str, Any]:
    names = draw(st.lists(st.sampled_from(PARAM_NAMES), max_size=3, unique=True))
    params = [param_entry(PARAM_NAMES.index(name), name, draw(st.sampled_from(["nan", "inf"])),
                          draw(st.booleans())) for name in names]
    kind = draw(st.sampled_from(INCIDENT_KINDS))
    step = draw(st.integers(0, 6))
    record = {
        "schema": RECORD_SCHEMA, "version": SCHEMA_VERSION, "kind": kind, "step": step,
        "time": 1.7e9 + step, "rank": coords(draw(rank)),
        "run": {"id": draw(st.sampled_from([None, "job-7"])), "attempt": draw(st.integers(0, 1)),
                "started": draw(st.sampled_from([1.7e9, 1.7e9 + 3600]))},
        "local_nonfinite": bool(params), "params": params,
        "params_total": len(params) + draw(st.integers(0, 2)),
        "optimizer_index": 0, "map": "maps/rank.json",
        "pre_reduction": draw(st.sampled_from([None, "clean", "nonfinite"])),
    }
    if kind == "nonfinite_grad_norm":
        record["grad_norm"] = draw(st.sampled_from(["nan", "inf", None]))
    if kind == "loss_scale_overflow":
        record.update(loss_scale=1024.0, min_loss_scale=1.0, sub_optimizer=0,
                      consecutive_skips=draw(st.integers(1, 5)), scale_collapsed=draw(st.booleans()))
    return record


@st.composite
def selftest_documents(draw) -> Dict[str, Any]:
    failing = draw(st.lists(ranks, max_size=2, unique=True))
    return {
        "schema": SELFTEST_SCHEMA, "version": 1, "time": "2026-11-22T12:00:00Z", "world_size": WORLD_SIZE,
        "layout": {"tp": 2, "pp": 1, "dp": 2}, "backend": "gloo", "size": 1024, "seconds": None,
        "repeats": 1, "timeout": 60.0, "ranks": [{"rank": r, **coords(r)} for r in range(WORLD_SIZE)],
        "checks": [], "skipped": [], "unreachable": None,
        "failing_ranks": [{"rank": r, "host": coords(r)["host"], "device": coords(r)["device"],
                           "reasons": ["matmul: checksum differs"]} for r in failing],
        "pass": not failing,
    }


def as_json(document: Any, **options: Any) -> bytes:
    """NaN and Infinity go in as the literals Python's json writes and reads (not strict JSON)."""
    return json.dumps(document, allow_nan=True, **options).encode("utf-8")


def as_record_line(record: Any) -> bytes:
    return as_json(record, separators=(",", ":"))


# --- arbitrary input and mutations ------------------------------------------------------------

HUGE_INTS = st.sampled_from([2**63, -(2**63) - 1, 2**1024, -(10**400)])  # below the 4300-digit limit
AWKWARD_TEXT = st.text(st.characters(categories=["Cs", "Cc", "Zl"]), max_size=3)  # lone surrogates, \n
json_scalars = (st.none() | st.booleans() | st.integers() | HUGE_INTS
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10) | AWKWARD_TEXT)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)

arbitrary_bytes = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    json_values.map(as_json),
    st.lists(json_values.map(as_record_line), max_size=4).map(b"\n".join),
)


def value_paths(value: Any, prefix: Tuple = ()) -> List[Tuple]:
    """The key/index path to every value inside a JSON document (the root excluded)."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    paths = []
    for key, child in children:
        paths.append(prefix + (key,))
        paths += value_paths(child, prefix + (key,))
    return paths


@st.composite
def mutated_values(draw, document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with one to three values anywhere in it deleted or replaced by arbitrary JSON:
    a file from another version of gradnan, edited by hand, or from another tool."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        paths = value_paths(document)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return document


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """Cut short and/or random bytes inserted: what a crash mid-write or a bad disk leaves."""
    cut = draw(st.booleans())
    if cut:
        data = data[: draw(st.integers(0, len(data)))]
    for _ in range(draw(st.integers(0 if cut else 1, 2))):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return data


@st.composite
def broken_files(draw, documents: st.SearchStrategy, *, values: bool, encode=as_json) -> bytes:
    """A valid document, then its values mutated (when ``values``) and/or its bytes damaged."""
    document = draw(documents)
    how = draw(st.sampled_from(["values", "bytes", "both"] if values else ["bytes"]))
    if how != "bytes":
        document = draw(mutated_values(document))
    data = encode(document)
    return draw(damaged(data)) if how != "values" else data


def some_file(documents: st.SearchStrategy, *, values: bool) -> st.SearchStrategy[bytes]:
    """Valid, broken, or plain garbage."""
    return st.one_of(documents.map(as_json), broken_files(documents, values=values), st.binary(max_size=40))


@st.composite
def records_files(draw, rank: st.SearchStrategy[int] = ranks, *, values: bool) -> bytes:
    """A rank's records file: each line valid or broken, the last maybe cut short without its newline."""
    line = st.one_of(record_documents(rank).map(as_record_line),
                     broken_files(record_documents(rank), values=values, encode=as_record_line))
    text = b"\n".join(draw(st.lists(line, max_size=4)))
    return text + b"\n" if draw(st.booleans()) else text


@st.composite
def run_directories(draw, *, values: bool) -> Dict[str, bytes]:
    """Relative path -> content of a run directory: maps, records and self-test results, each valid
    or broken (``values``: also valid JSON with values deleted or replaced)."""
    files = {}
    for rank in draw(st.lists(ranks, max_size=3, unique=True)):
        tag = rank_tag(coords(rank))
        if draw(st.booleans()):
            files[f"{MAPS_DIR}/{tag}.json"] = draw(some_file(map_documents(st.just(rank)), values=values))
        if draw(st.booleans()):
            files[f"{RECORDS_DIR}/{tag}.jsonl"] = draw(records_files(st.just(rank), values=values))
    for number in range(draw(st.integers(0, 1))):
        files[f"{SELFTEST_DIR}/selftest-{number}.json"] = draw(some_file(selftest_documents(), values=values))
    return files


# --- what a reader may do: return what it promises, or raise the one clear error ---------------


def assert_clear_error(error: ReadError, path: Path) -> None:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert str(path) in message, message


def assert_clear_problems(problems: List[str], path: Path) -> None:
    for problem in problems:
        assert isinstance(problem, str) and "\n" not in problem and "\r" not in problem, problem
        assert problem.startswith(f"{path}"), problem


def check_map(path: Path) -> None:
    document = load_map(path)
    assert isinstance(document, dict) and isinstance(document["params"], list)
    assert isinstance(document["rank"]["global_rank"], int)


def check_records(path: Path) -> None:
    records, problems = load_records(path)
    assert all(record["schema"] == RECORD_SCHEMA and isinstance(record["step"], int) for record in records)
    assert_clear_problems(problems, path)


def check_selftest(path: Path) -> None:
    document = load_selftest(path)
    assert isinstance(document["pass"], bool) and isinstance(document["failing_ranks"], list)


READER_CHECKS: Dict[str, Callable[[Path], None]] = {
    "load_map": check_map, "load_records": check_records, "load_selftest": check_selftest,
}
VALID_DOCUMENTS = {"load_map": map_documents(), "load_records": record_documents(),
                   "load_selftest": selftest_documents()}


def read_or_clear_error(reader: str, data: bytes) -> None:
    with fresh_dir() as directory:
        path = directory / "input.json"
        path.write_bytes(data)
        try:
            READER_CHECKS[reader](path)
        except ReadError as error:
            assert_clear_error(error, path)


# --- 1, 2: single files ---------------------------------------------------------------------


@pytest.mark.parametrize("reader", READER_CHECKS)
@settings(max_examples=150, deadline=None)
@given(data=arbitrary_bytes)
def test_a_reader_given_arbitrary_bytes_returns_or_raises_the_clear_error(reader, data):
    read_or_clear_error(reader, data)


@pytest.mark.parametrize("reader", READER_CHECKS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_reader_given_a_mutated_valid_file_returns_or_raises_the_clear_error(reader, data):
    encode = as_record_line if reader == "load_records" else as_json
    read_or_clear_error(reader, data.draw(broken_files(VALID_DOCUMENTS[reader], values=True, encode=encode)))


# --- 3, 4: run directories, the report and the CLI ----------------------------------------------


def read_run_checked(run_dir: Path, files: Dict[str, bytes]):
    """``read_run`` raises only when the directory holds no candidate file at all; otherwise every
    file is either read or named in ``problems``."""
    if not files:
        with pytest.raises(ReadError) as info:
            read_run(run_dir)
        assert_clear_error(info.value, run_dir)
        return None
    result = read_run(run_dir)
    assert_clear_problems(result.problems, run_dir)
    for relative in files:
        path = run_dir / relative
        read = path in result.maps or path in result.records or path in result.selftests
        assert read or any(problem.startswith(f"{path}:") for problem in result.problems), path
    return result


def check_report(run_dir: Path, files: Dict[str, bytes]) -> None:
    result = read_run_checked(run_dir, files)
    if result is None:
        return
    report = build_report(result)
    json.dumps(report)
    assert format_text(report).startswith("gradnan report for ")


@settings(max_examples=120, deadline=None)
@given(files=run_directories(values=False))
def test_report_on_a_run_directory_with_damaged_files(files):
    with fresh_dir() as run_dir:
        check_report(write_files(run_dir, files), files)


@settings(max_examples=120, deadline=None)
@given(files=run_directories(values=True))
def test_report_on_a_run_directory_with_mutated_values(files):
    with fresh_dir() as run_dir:
        check_report(write_files(run_dir, files), files)


CLI_COMMANDS = (["report"], ["report", "--json"], ["maps"], ["maps", "--json"],
                ["maps", "--rank", "0", "--id", "1"])


def check_cli(run_dir: Path, capsys) -> None:
    """Exit 0 with output, or 2 with exactly one line on stderr; never an exception."""
    for command in CLI_COMMANDS:
        capsys.readouterr()
        code = main([command[0], str(run_dir), *command[1:]])
        out, err = capsys.readouterr()
        assert code in (0, 2), (command, code)
        if code == 2:
            assert err.endswith("\n") and err.count("\n") == 1, (command, err)
        else:
            assert out, command
            if "--json" in command:
                json.loads(out)


CLI_SETTINGS = settings(max_examples=60, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])  # capsys: drained per call


@CLI_SETTINGS
@given(files=run_directories(values=False))
def test_cli_on_a_run_directory_with_damaged_files(files, capsys):
    with fresh_dir() as run_dir:
        check_cli(write_files(run_dir, files), capsys)


@CLI_SETTINGS
@given(files=run_directories(values=True))
def test_cli_on_a_run_directory_with_mutated_values(files, capsys):
    with fresh_dir() as run_dir:
        check_cli(write_files(run_dir, files), capsys)


# --- 5: no reader executes code ---------------------------------------------------------------


class CreatesFileWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: a marker file that appears proves code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def test_the_pickle_payload_is_live(tmp_path):
    """Control: unpickling the payload does create the marker, so its absence below means something."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(CreatesFileWhenUnpickled(marker))).close()
    assert marker.exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("reader", [load_map, load_selftest, load_records])
def test_a_reader_given_a_pickle_rejects_it_without_running_it(tmp_path, reader, protocol):
    marker = tmp_path / "marker"
    path = tmp_path / "input.json"
    path.write_bytes(pickle.dumps(CreatesFileWhenUnpickled(marker), protocol=protocol))
    try:
        result = reader(path)
    except ReadError as error:
        assert_clear_error(error, path)
    else:  # load_records reports unusable lines instead of raising for a readable text file
        assert reader is load_records and result[0] == [] and result[1]
    assert not marker.exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_run_directory_of_pickles_is_reported_without_running_them(tmp_path, capsys, protocol):
    marker = tmp_path / "marker"
    payload = pickle.dumps(CreatesFileWhenUnpickled(marker), protocol=protocol)
    run_dir = write_files(tmp_path / "run", {f"{MAPS_DIR}/rank00000_tp0_pp0_dp0.json": payload,
                                             f"{RECORDS_DIR}/rank00000_tp0_pp0_dp0.jsonl": payload,
                                             f"{SELFTEST_DIR}/selftest.json": payload})
    files = read_run(run_dir)
    assert not files.maps and not files.all_records() and not files.selftests and files.problems
    assert main(["report", str(run_dir)]) == 0
    assert main(["maps", str(run_dir)]) == 2
    assert not marker.exists()
