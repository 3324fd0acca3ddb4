"""Property-based tests (hypothesis) for every reader and for what runs on what the readers accept.

Issue "Hardening": arbitrary bytes and mutated valid files never crash a reader with anything but the
clear error (a one-line ``InputError`` naming the file); the report and the CLI never crash on a run
directory the readers accepted; no reader ever executes code from a file.

Crashes these properties found (now fixed: the readers validate every field the report and the CLI
use) are pinned, one minimal input each ("the pinned crashes"), and are explicit @examples of the
properties they broke, so a regression fails the same way on every run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gradnan.cli import main
from gradnan.errors import InputError
from gradnan.formats import records, runup, selftest
from gradnan.formats.layout import MAPS_DIR, RECORDS_DIR, RUNUP_DIR, SELFTEST_DIR, rank_tag
from gradnan.formats.maps import ParamSlot
from gradnan.formats.maps import load as load_map
from gradnan.formats.maps import to_json as map_document
from gradnan.formats.records import load as load_records
from gradnan.formats.selftest import load as load_selftest
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import RunFiles, read_run
from gradnan.offline.incident.report import format_text

# --- a fresh directory per example ------------------------------------------------------------


@contextlib.contextmanager
def fresh_dir() -> Iterator[Path]:
    """A new directory for each hypothesis example: ``tmp_path`` is made once per test function, so
    all examples of a test would share it and one example's files would leak into the next."""
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
MODULE_NAMES = ("decoder.layers.0.mlp.linear_fc1", "", "embedding")
INCIDENT_KINDS = ("nonfinite_grad_norm", "loss_scale_overflow", "pre_reduction")
OBSERVATION_KINDS = ("frames", "probe")  # frame tracing and gradnan.check
ranks = st.integers(0, WORLD_SIZE - 1)


def coords(rank: int) -> Dict[str, Any]:
    """One rank of a 4-rank TP2 x DP2 job, as ``rank_coordinates()`` describes it."""
    return {"global_rank": rank, "world_size": WORLD_SIZE, "local_rank": rank % 2,
            "host": f"node-{rank // 2}", "device": f"cuda:{rank % 2}", "pid": 1000 + rank,
            "tp": rank % 2, "tp_size": 2, "pp": 0, "pp_size": 1, "dp": rank // 2, "dp_size": 2,
            "cp": 0, "cp_size": 1, "ep": 0, "ep_size": 1}


def run_identity(draw) -> Dict[str, Any]:
    return {"id": draw(st.sampled_from([None, "job-7"])), "attempt": draw(st.integers(0, 1)),
            "started": draw(st.sampled_from([1.7e9, 1.7e9 + 3600]))}


def a_map(rank: int, names: Sequence[str], shards: Sequence[Optional[Tuple[int, int]]],
          run: Dict[str, Any]) -> Dict[str, Any]:
    """Rank ``rank``'s parameter map, as the runtime writes it (the clock left out)."""
    slots = [ParamSlot(id=position, name=name, shape=(4, 2), dtype="torch.bfloat16", numel=8, group=0,
                       wd_mult=1.0, lr_mult=None, is_expert=False, optimizer=0, shard=shard,
                       main_dtype="torch.float32", order=position)
             for position, (name, shard) in enumerate(zip(names, shards))]
    document = map_document(coords=coords(rank), versions={"megatron-core": "0.16.1"}, run=run,
                            optimizer_index=0, optimizer_class="DistributedOptimizer", slots=slots)
    document["written_at"] = 1.7e9  # not the clock: hypothesis needs the same bytes for the same draws
    return document


@st.composite
def map_documents(draw, rank: st.SearchStrategy[int] = ranks) -> Dict[str, Any]:
    names = draw(st.lists(st.sampled_from(PARAM_NAMES), min_size=1, max_size=4, unique=True))
    shards = draw(st.lists(st.sampled_from([None, (0, 4)]), min_size=len(names), max_size=len(names)))
    return a_map(draw(rank), names, shards, run_identity(draw))


def param_entry(name: str, bad: str, near_limit: bool) -> Dict[str, Any]:
    """One offending parameter, as ``offenders.offending_params`` describes it."""
    position = PARAM_NAMES.index(name)
    return {"id": position, "name": name, "kind": bad, "nan": int(bad == "nan"), "inf": int(bad == "inf"),
            "pos_inf": int(bad == "inf"), "neg_inf": 0, "first_bad_flat": 3, "first_bad_index": [1, 1],
            "abs_max_finite": 6.0e4 if near_limit else 0.25, "near_limit": near_limit, "numel": 8,
            "shard": None, "is_expert": False, "order": position}


@st.composite
def record_documents(draw, rank: st.SearchStrategy[int] = ranks) -> Dict[str, Any]:
    names = draw(st.lists(st.sampled_from(PARAM_NAMES), max_size=3, unique=True))
    params = [param_entry(name, draw(st.sampled_from(["nan", "inf"])), draw(st.booleans())) for name in names]
    kind = draw(st.sampled_from(INCIDENT_KINDS + OBSERVATION_KINDS))
    step = draw(st.integers(0, 6))
    record = {
        "schema": records.SCHEMA.name, "version": records.SCHEMA.version, "kind": kind, "step": step,
        "time": 1.7e9 + step, "rank": coords(draw(rank)), "run": run_identity(draw),
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
    if kind in OBSERVATION_KINDS:
        record.update(params=[], params_total=0, local_nonfinite=True)
        stat = st.sampled_from([0.5, 6.5e4, "inf", "nan", None])
        if kind == "frames":
            frames = [{"step": step, "module": module, "class": "Linear", "call": call, "recomputed": 0,
                       "entries": [{"name": "output", "kind": "output", "dtype": "torch.float16",
                                    "abs_min": draw(stat), "abs_max": draw(stat)}]}
                      for call, module in enumerate(draw(st.lists(st.sampled_from(MODULE_NAMES),
                                                                  max_size=3)))]
            record.update(mode=draw(st.sampled_from(["detect", "trace"])), frames=frames,
                          frames_total=len(frames), first_nonfinite=draw(st.sampled_from([None, 0, 5])))
        else:
            record["probes"] = [{"label": "x", "module": draw(st.sampled_from([None, *MODULE_NAMES])),
                                 "step": step, "recompute": False, "nan": draw(st.integers(0, 3)), "inf": 1,
                                 "abs_min": draw(stat), "abs_max": draw(stat), "shape": [2],
                                 "dtype": "torch.float16"}]
    return record


def a_selftest(failing_ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A ``gradnan.selftest`` result of the 4-rank job, as ``selftest.build_document`` writes it."""
    return {
        "schema": selftest.SCHEMA.name, "version": 1, "time": "2026-11-22T12:00:00Z",
        "world_size": WORLD_SIZE,
        "layout": {"tp": 2, "pp": 1, "dp": 2}, "backend": "gloo", "size": 1024, "seconds": None,
        "repeats": 1, "timeout": 60.0, "ranks": [{"rank": r, **coords(r)} for r in range(WORLD_SIZE)],
        "checks": [], "skipped": [], "unreachable": None,
        "failing_ranks": failing_ranks, "pass": not failing_ranks,
    }


@st.composite
def selftest_documents(draw) -> Dict[str, Any]:
    return a_selftest([{"rank": r, "host": coords(r)["host"], "device": coords(r)["device"],
                        "reasons": ["matmul: checksum differs"]}
                       for r in draw(st.lists(ranks, max_size=2, unique=True))])


@st.composite
def runup_documents(draw, rank: st.SearchStrategy[int] = ranks) -> Dict[str, Any]:
    """A ``gradnan.runup`` file as the training side writes it: a few groups of a few buckets over the
    steps up to an incident step (the records' steps), magnitudes steady, growing or non-finite."""
    step = draw(st.integers(0, 6))
    magnitude = st.sampled_from([0.0, 0.25, 0.3, 3.0, 1e4, 1e30, "nan", "inf"])
    groups = []
    for index in range(draw(st.integers(0, 2))):
        kept = draw(st.integers(0, step + 1))
        names = st.lists(st.sampled_from(PARAM_NAMES), max_size=3, unique=True)
        buckets = [{"bucket": b, "numel": 64, "params": draw(names)} for b in range(draw(st.integers(1, 2)))]
        groups.append({"bucket_group": index, "steps": list(range(step + 1 - kept, step + 1)),
                       "buckets": buckets,
                       "values": [[draw(magnitude) for _ in buckets] for _ in range(kept)]})
    return runup.to_json(coords(draw(rank)), run_identity(draw), step, None, groups)


def as_json(document: Any) -> bytes:
    """NaN and Infinity go in as the literals Python's json writes and reads (not strict JSON)."""
    return json.dumps(document, allow_nan=True, indent=1).encode("utf-8")


def as_record_line(record: Any) -> bytes:
    return json.dumps(record, allow_nan=True, separators=(",", ":")).encode("utf-8")


# --- arbitrary input and mutations ------------------------------------------------------------

HUGE_INTS = st.sampled_from([2**63, -(2**63) - 1, 2**1024, -(10**400)])  # json.dumps stops at 4300 digits
AWKWARD_TEXT = st.text(st.characters(categories=["Cs", "Cc", "Zl"]), max_size=3)  # lone surrogates, "\n"
json_scalars = (st.none() | st.booleans() | st.integers() | HUGE_INTS
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10) | AWKWARD_TEXT)
json_values = st.recursive(
    json_scalars,
    lambda children: (st.lists(children, max_size=3)
                      | st.dictionaries(st.text(max_size=6), children, max_size=3)),
    max_leaves=8,
)
deeply_nested = st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth)

arbitrary_bytes = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    json_values.map(as_json),
    st.lists(json_values.map(as_record_line), max_size=4).map(b"\n".join),
    deeply_nested,
)


def value_paths(value: Any, prefix: Tuple = ()) -> List[Tuple]:
    """The key/index path to every value inside a JSON document (the root excluded)."""
    children = (value.items() if isinstance(value, dict)
                else enumerate(value) if isinstance(value, list) else ())
    paths = []
    for key, child in children:
        paths.append(prefix + (key,))
        paths += value_paths(child, prefix + (key,))
    return paths


@st.composite
def mutated_values(draw, document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with one to three values anywhere in it deleted or replaced by arbitrary JSON:
    a file from another gradnan version, edited by hand, or written by another tool."""
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


Encode = Callable[[Any], bytes]


def with_values_mutated(documents: st.SearchStrategy, encode: Encode) -> st.SearchStrategy[bytes]:
    return documents.flatmap(mutated_values).map(encode)


def with_bytes_damaged(documents: st.SearchStrategy, encode: Encode) -> st.SearchStrategy[bytes]:
    return documents.map(encode).flatmap(damaged)


def mutated_files(documents: st.SearchStrategy, encode: Encode) -> st.SearchStrategy[bytes]:
    """A valid document with its values mutated, its bytes damaged, or both."""
    return st.one_of(with_values_mutated(documents, encode), with_bytes_damaged(documents, encode),
                     with_values_mutated(documents, encode).flatmap(damaged))


@st.composite
def cut_short(draw, data: bytes) -> bytes:
    return data[: draw(st.integers(0, len(data)))]


@st.composite
def not_utf8(draw, data: bytes) -> bytes:
    at = draw(st.integers(0, len(data)))
    return data[:at] + b"\xff" + draw(st.binary(max_size=3)) + data[at:]  # 0xff never occurs in UTF-8


def rejected_whole(documents: st.SearchStrategy, encode: Encode) -> st.SearchStrategy[bytes]:
    """What a crash mid-write or a bad disk leaves and a reader must refuse: a file cut short, bytes
    that are not UTF-8, or bytes that are not ours at all. (Damage that still parses, such as one
    letter more in a key, is a well-formed file with wrong values: the ``with_values_mutated`` case.)"""
    encoded = documents.map(encode)
    return encoded.flatmap(cut_short) | encoded.flatmap(not_utf8) | st.binary(max_size=40)


Breakage = Callable[[st.SearchStrategy, Encode], st.SearchStrategy[bytes]]


@st.composite
def records_files(draw, rank: st.SearchStrategy[int], breakage: Breakage) -> bytes:
    """A rank's records file: each line valid or broken, the last one maybe without its newline."""
    line = record_documents(rank).map(as_record_line) | breakage(record_documents(rank), as_record_line)
    text = b"\n".join(draw(st.lists(line, max_size=4)))
    return text + b"\n" if draw(st.booleans()) else text


@st.composite
def run_directories(draw, breakage: Breakage) -> Dict[str, bytes]:
    """Relative path -> content of a run directory: maps, records and self-test results of a few
    ranks, each file valid or broken by ``breakage``; sometimes no file at all."""
    def some(documents: st.SearchStrategy) -> bytes:
        return draw(documents.map(as_json) | breakage(documents, as_json))

    files = {}
    for rank in draw(st.lists(ranks, max_size=3, unique=True)):
        tag = rank_tag(coords(rank))
        if draw(st.booleans()):
            files[f"{MAPS_DIR}/{tag}.json"] = some(map_documents(st.just(rank)))
        if draw(st.booleans()):
            files[f"{RECORDS_DIR}/{tag}.jsonl"] = draw(records_files(st.just(rank), breakage))
        if draw(st.booleans()):
            files[f"{RUNUP_DIR}/{tag}_step0000001.json"] = some(runup_documents(st.just(rank)))
    if draw(st.booleans()):
        files[f"{SELFTEST_DIR}/selftest.json"] = some(selftest_documents())
    return files


# --- 1, 2: a reader returns what it promises or raises the one clear error ----------------------


def assert_one_line_naming(message: str, path: Path) -> None:
    assert "\n" not in message and "\r" not in message, message
    assert str(path) in message, message


def check_map(path: Path) -> None:
    document = load_map(path)
    assert isinstance(document["params"], list) and isinstance(document["rank"]["global_rank"], int)


def check_records(path: Path) -> None:
    found, problems = load_records(path)
    assert all(record["schema"] == records.SCHEMA.name and isinstance(record["step"], int)
               for record in found)
    for problem in problems:
        assert problem.startswith(f"{path}:")
        assert_one_line_naming(problem, path)


def check_selftest(path: Path) -> None:
    document = load_selftest(path)
    assert isinstance(document["pass"], bool) and isinstance(document["failing_ranks"], list)


def check_runup(path: Path) -> None:
    document = runup.load(path)
    assert all(len(row) == len(group["buckets"]) for group in document["groups"] for row in group["values"])


READERS: Dict[str, Tuple[Callable[[Path], None], st.SearchStrategy, Encode]] = {
    "load_map": (check_map, map_documents(), as_json),
    "load_records": (check_records, record_documents(), as_record_line),
    "load_selftest": (check_selftest, selftest_documents(), as_json),
    "load_runup": (check_runup, runup_documents(), as_json),
}


def read_or_clear_error(reader: str, data: bytes) -> None:
    check = READERS[reader][0]
    with fresh_dir() as directory:
        path = directory / "input.json"
        path.write_bytes(data)
        try:
            check(path)
        except InputError as error:
            assert_one_line_naming(str(error), path)


@pytest.mark.slow
@pytest.mark.parametrize("reader", READERS)
@settings(max_examples=400, deadline=None)
@given(data=arbitrary_bytes)
def test_a_reader_given_arbitrary_bytes_returns_or_raises_the_clear_error(reader, data):
    read_or_clear_error(reader, data)


@pytest.mark.slow
@pytest.mark.parametrize("reader", READERS)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_reader_given_a_mutated_valid_file_returns_or_raises_the_clear_error(reader, data):
    _, documents, encode = READERS[reader]
    read_or_clear_error(reader, data.draw(mutated_files(documents, encode), label="file"))


# --- 3, 4: run directories, the report and the CLI ----------------------------------------------


def read_run_checked(run_dir: Path, files: Dict[str, bytes]) -> Optional[RunFiles]:
    """``read_run`` raises only for a directory without a single candidate file (a map, a records file, a
    self-test result: run-ups alone are no run); otherwise every file is either read or named in
    ``problems``. None where it raised."""
    if not any(relative.startswith((MAPS_DIR, RECORDS_DIR, SELFTEST_DIR)) for relative in files):
        with pytest.raises(InputError) as info:
            read_run(run_dir)
        assert_one_line_naming(str(info.value), run_dir)
        return None
    result = read_run(run_dir)
    for problem in result.problems:
        assert_one_line_naming(problem, run_dir)
    for relative in files:
        path = run_dir / relative
        read = any(path in found for found in (result.maps, result.records, result.selftests, result.runups))
        assert read or any(problem.startswith(f"{path}:") for problem in result.problems), path
    return result


def check_report(files: Dict[str, bytes]) -> None:
    with fresh_dir() as run_dir:
        result = read_run_checked(write_files(run_dir, files), files)
        if result is not None:
            analysis = analyze(result)
            report = analysis.to_json()
            json.dumps(report)
            assert format_text(analysis).startswith("gradnan report for ")


CLI_COMMANDS = (["report"], ["report", "--json"], ["maps"], ["maps", "--json"],
                ["maps", "--rank", "0", "--id", "1"], ["frames"], ["frames", "--json"],
                ["frames", "--rank", "1", "--step", "2", "--last", "1"])


def check_cli(files: Dict[str, bytes], capsys) -> None:
    """Exit 0 with output, or 2 with exactly one line on stderr; never an exception."""
    with fresh_dir() as run_dir:
        write_files(run_dir, files)
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


CLI_SETTINGS = settings(max_examples=150, deadline=None,
                        # capsys: drained per call
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- inputs the readers accept that crash a consumer: found by the properties, pinned one each ---


def a_record(**changes: Any) -> Dict[str, Any]:
    """A pre-reduction record of rank 0 at step 1 naming one NaN gradient, with ``changes``."""
    return {"schema": records.SCHEMA.name, "version": records.SCHEMA.version, "kind": "pre_reduction",
            "step": 1, "time": 1.7e9, "rank": coords(0),
            "params": [param_entry(PARAM_NAMES[2], "nan", False)], "params_total": 1, **changes}


def rank_0(**changes: Any) -> Dict[str, Any]:
    return {**coords(0), **changes}


def without(mapping: Dict[str, Any], key: str) -> Dict[str, Any]:
    return {name: value for name, value in mapping.items() if name != key}


def a_run(*records: Dict[str, Any], parameter_map: Optional[Dict[str, Any]] = None,
          selftest: Optional[Dict[str, Any]] = None) -> Dict[str, bytes]:
    """A run directory's files: the records in rank 0's records file, and a map and a self-test."""
    tag = rank_tag(coords(0))
    files = {}
    if records:
        files[f"{RECORDS_DIR}/{tag}.jsonl"] = b"".join(as_record_line(record) + b"\n" for record in records)
    if parameter_map is not None:
        files[f"{MAPS_DIR}/{tag}.json"] = as_json(parameter_map)
    if selftest is not None:
        files[f"{SELFTEST_DIR}/selftest.json"] = as_json(selftest)
    return files


def bug(case_id: str, files: Dict[str, bytes], raises: type, where: str, what: str):
    """A case that once crashed with ``raises`` in ``where`` (kept as a regression case)."""
    return pytest.param(files, id=case_id)


REPORT_CRASHES = [
    bug("rank-without-global_rank", a_run(a_record(), a_record(rank=without(coords(1), "global_rank"))),
        TypeError, "report.build_report", "sorted(ranks) for 'ranks_seen' compares None with int"
        " (load_records does not check rank.global_rank)"),
    bug("global_rank-a-list", a_run(a_record(rank=rank_0(global_rank=[0]))),
        TypeError, "report._known_ranks", "rank.global_rank used as a dict key (unhashable list)"),
    bug("param-without-name", a_run(a_record(params=[{"id": 2}])),
        TypeError, "analysis.module_of via _parameters_by_module", "a params entry without 'name'"
        " (load_records only checks that 'params' is a list)"),
    bug("param-without-counts", a_run(a_record(params=[{"id": 2, "name": PARAM_NAMES[2]}])),
        TypeError, "report._parameters_by_module", "entry['nan'] += param['nan'] without 'nan'/'inf'"),
    bug("param-not-an-object", a_run(a_record(params=[2])),
        AttributeError, "report._backward_key", "param.get() on a params entry that is not an object"),
    bug("receiver-param-without-name",
        a_run(a_record(), a_record(kind="nonfinite_grad_norm", rank=coords(1), params=[{"id": 2}])),
        KeyError, "report.build_report (receivers)", "p['name'] of a receiving rank's params entry"),
    bug("pp-a-string", a_run(a_record(rank=rank_0(pp="0"))),
        TypeError, "report._backward_key", "-(rank.get('pp') or 0) on a string"),
    bug("cp_size-a-string", a_run(a_record(rank=rank_0(cp_size="2"))),
        TypeError, "records.shown_axes via report._rank_view",
        "(coords.get('cp_size') or 1) > 1 on a string"),
    bug("dp_size-a-string", a_run(a_record(rank=rank_0(dp_size="2"))),
        TypeError, "report._verdict", "dp_size > 1 on a string"),
    bug("dp-a-list", a_run(a_record(rank=rank_0(dp=[0]))),
        TypeError, "report._verdict", "a set of the origin's dp replicas with an unhashable dp"),
    bug("params_total-a-string",
        a_run(a_record(params_total="1"), parameter_map=a_map(0, PARAM_NAMES, [None] * len(PARAM_NAMES), {})),
        TypeError, "report._pattern", "params_total / the map's parameter count on a string"),
    bug("started-out-of-range", a_run(a_record(run={"id": None, "started": 1e20})),
        OverflowError, "runs.split_runs", "time.gmtime() of a start time beyond time_t"),
    bug("time-nan", a_run(a_record(time=float("nan"))),
        ValueError, "runs.split_runs", "time.gmtime(nan) (a record without 'run' is placed by 'time')"),
    bug("time-huge-integer", a_run(a_record(time=10**400)),
        OverflowError, "report._started", "float() of an integer beyond the float range"),
    bug("consecutive_skips-a-string", a_run(a_record(kind="loss_scale_overflow", consecutive_skips="3")),
        TypeError, "runs.failing_step", "(consecutive_skips or 1) >= serious_skips on a string"),
    bug("host-a-list", a_run(a_record(rank=rank_0(host=["node-0"]))),
        TypeError, "report._weigh_selftests", "a set of (host, device) pairs with an unhashable host"),
    bug("selftest-host-a-list",
        a_run(a_record(), selftest=a_selftest([{"rank": 0, "host": ["node-0"], "device": "cuda:0"}])),
        TypeError, "report._weigh_selftests", "(entry['host'], entry['device']) in a set with a list host"
        " (load_selftest only checks failing_ranks[].rank)"),
    bug("origin-without-global_rank", a_run(a_record(rank=without(coords(0), "global_rank"))),
        TypeError, "report._module_table via format_text", "f'r{rank:<2}' with rank None"),
]

LONE_SURROGATE = "\ud800"  # valid JSON ("\ud800" escaped); json.loads gives a str UTF-8 cannot encode
CLI_CRASHES = [
    bug("lone-surrogate-in-a-parameter-name",
        a_run(parameter_map={"schema": "gradnan.map", "version": 1, "rank": coords(0),
                             "params": [{"id": 1, "name": LONE_SURROGATE}]}),
        UnicodeEncodeError, "cli._print_maps", "print() of a name the reader accepted to a UTF-8 stdout"),
    bug("lone-surrogate-in-a-host", a_run(a_record(rank=rank_0(host=LONE_SURROGATE))),
        UnicodeEncodeError, "cli.main (report)", "print(format_text(report)) to a UTF-8 stdout"),
    bug("frames-first_nonfinite-out-of-range",
        a_run(a_record(kind="frames", mode="detect", params=[], frames=[], frames_total=0,
                       first_nonfinite=0)),
        IndexError, "frames_report.format_frames via cli (frames)",
        "record['frames'][first_nonfinite] of an empty list"),
    bug("frames-entry-without-abs_min",
        a_run(a_record(kind="frames", mode="detect", params=[], params_total=0, frames_total=1,
                       first_nonfinite=None,
                       frames=[{"step": 0, "module": "m", "class": "Linear", "call": 0, "recomputed": 0,
                                "entries": [{"name": "output", "kind": "output", "dtype": "torch.float16",
                                             "abs_max": 0.5}]}])),
        KeyError, "frames_view.format_frames via cli (frames)", "entry['abs_min'] where the reader took a"
        " missing key for null"),
]

def with_examples(cases: List[Any]):
    """Every pinned case as an explicit example of the property it once broke."""
    def decorate(test):
        for case in cases:
            test = example(files=case.values[0])(test)
        return test
    return decorate


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(files=run_directories(rejected_whole))
def test_report_on_a_run_directory_with_files_rejected_whole(files):
    check_report(files)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@with_examples(REPORT_CRASHES)
@given(files=run_directories(with_values_mutated))
def test_report_on_a_run_directory_with_mutated_values(files):
    check_report(files)


@pytest.mark.slow
@CLI_SETTINGS
@given(files=run_directories(rejected_whole))
def test_cli_on_a_run_directory_with_files_rejected_whole(files, capsys):
    check_cli(files, capsys)


@pytest.mark.slow
@CLI_SETTINGS
@with_examples(REPORT_CRASHES + CLI_CRASHES)
@given(files=run_directories(with_values_mutated))
def test_cli_on_a_run_directory_with_mutated_values(files, capsys):
    check_cli(files, capsys)


# --- the pinned crashes, one minimal input each ---------------------------------------------


@pytest.mark.parametrize("files", REPORT_CRASHES)
def test_the_report_survives_a_file_the_readers_accept(files):
    check_report(files)


@pytest.mark.parametrize("files", CLI_CRASHES)
def test_the_cli_survives_a_file_the_readers_accept(files, capsys):
    check_cli(files, capsys)


def test_maps_of_a_rank_without_parameters_say_so(capsys):
    """Found by the CLI property: a valid map with an empty 'params' list printed nothing."""
    document = a_map(0, [], [], {"id": None, "attempt": 0, "started": 1.7e9})
    check_cli({f"{MAPS_DIR}/{rank_tag(coords(0))}.json": as_json(document)}, capsys)


# json.loads raises a bare ValueError (not JSONDecodeError) for an integer of more than 4300 digits.
A_HUGE_INTEGER_LITERAL = b'{"schema": "gradnan.record", "version": 1, "step": ' + b"1" * 5000 + b"}\n"


@pytest.mark.parametrize("reader", READERS)
def test_a_reader_given_a_huge_integer_literal_raises_the_clear_error(reader):
    read_or_clear_error(reader, A_HUGE_INTEGER_LITERAL)


def test_the_cli_given_a_huge_integer_literal_exits_2(capsys):
    check_cli({f"{RECORDS_DIR}/{rank_tag(coords(0))}.jsonl": A_HUGE_INTEGER_LITERAL}, capsys)


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
    except InputError as error:
        assert_one_line_naming(str(error), path)
    else:  # a readable text file: load_records names each unusable line instead of raising
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
    assert not files.maps and not files.all_records() and not files.selftests and len(files.problems) >= 3
    assert main(["report", str(run_dir)]) == 0
    assert main(["maps", str(run_dir)]) == 2
    assert not marker.exists()
