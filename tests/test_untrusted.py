"""Every file the kit reads is untrusted; every fault while writing keeps what is on disk (issue 15).

Classes of attack and bad luck, each against the real readers, CLIs and writers: huge and non-finite
numbers anywhere, wrong types anywhere, non-regular files (FIFO, /dev/zero, a directory), bounded
reads, unreadable directories (capabilities dropped), the replay allowlist with the ``aten.from_file``
exploit, manifests replay cannot use, two launches into one directory, a full disk part-way through a
record, control characters on the terminal. Each ends in a result or one line and exit code 2: no
traceback, no hang (``no_hang``), nothing lost, no file outside the run directory touched.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import multiprocessing
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

from gradnan.cli import main
from gradnan.commandline import printable
from gradnan.config.sources import resolve_config
from gradnan.errors import ConfigError, InputError
from gradnan.formats import bundle
from gradnan.formats.incident import RecordKind
from gradnan.formats.layout import MANIFEST, TENSORS, rank_tag
from gradnan.formats.records import load as load_records
from gradnan.formats.safe_write import append_json_line
from gradnan.formats.schema import read_text
from gradnan.formats.trace_ops import REPLAY_ALLOWLIST, allowed_in_replay
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.toy import launch
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import environ_without_gradnan
from .test_readers_property import (
    PARAM_NAMES,
    a_map,
    a_record,
    a_selftest,
    as_json,
    as_record_line,
    coords,
    value_paths,
)

ROOT = Path(__file__).resolve().parent.parent

# --- a run directory with every kind of document, and its mutations ----------------------------


def valid_documents() -> Dict[str, Any]:
    """One of each document a run directory holds, every optional numeric field filled."""
    run = {"id": None, "attempt": "0", "started": 1.7e9, "rendezvous": "node-0:29500"}
    frames = [{"step": 1, "module": "decoder.layers.0.mlp", "class": "MLP", "call": 0, "recomputed": 0,
               "entries": [{"name": "output", "kind": "output", "dtype": "torch.float16", "abs_min": 0.5,
                            "abs_max": 6.5e4}]}]
    probe = {"label": "x", "module": "decoder", "step": 1, "recompute": False, "nan": 1, "inf": 0,
             "abs_min": 0.5, "abs_max": 2.0, "shape": [2], "dtype": "torch.float16"}
    return {
        "map": a_map(0, PARAM_NAMES, [None] * 3 + [(0, 4)] * 3, run),
        "selftest": a_selftest([{"rank": 0, "host": "node-0", "device": "cuda:0", "reasons": ["matmul"]}]),
        "pre_reduction": a_record(run=run, optimizer_index=0, iteration=1),
        "grad_norm": a_record(kind="nonfinite_grad_norm", grad_norm="nan", rank=coords(1), run=run),
        "overflow": a_record(kind="loss_scale_overflow", loss_scale=1024.0, min_loss_scale=1.0,
                             sub_optimizer=0, consecutive_skips=3, scale_collapsed=False, run=run),
        "frames": a_record(kind="frames", params=[], params_total=0, mode="trace", frames=frames,
                           frames_total=1, first_nonfinite=0, run=run),
        "probe": a_record(kind="probe", params=[], params_total=0, probes=[probe], run=run),
        "bundle": {"schema": "gradnan.bundle", "version": 1, "created": 1.7e9, "step": 1, "iteration": 1,
                   "module": {"path": "decoder", "class": "MLP"}, "rank": coords(0), "run": run,
                   "trigger": "always", "outputs": 1, "trace": {}, "seen": {"outputs_nonfinite": True}},
    }


RECORD_KINDS = ("pre_reduction", "grad_norm", "overflow", "frames", "probe")


def run_files(documents: Dict[str, Any]) -> Dict[str, bytes]:
    tag = rank_tag(coords(0))
    return {f"maps/{tag}.json": as_json(documents["map"]), "selftest/s.json": as_json(documents["selftest"]),
            f"records/{tag}.jsonl": b"".join(as_record_line(documents[kind]) + b"\n"
                                             for kind in RECORD_KINDS),
            f"bundles/{tag}/step0000001_decoder/{MANIFEST}": as_json(documents["bundle"])}


def write_run(run_dir: Path, files: Dict[str, bytes]) -> Path:
    for relative, content in files.items():
        (run_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / relative).write_bytes(content)
    return run_dir


def replaced(documents: Dict[str, Any], name: str, path: Tuple, value: Any) -> Dict[str, Any]:
    documents = copy.deepcopy(documents)
    parent = documents[name]
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return documents


def field_paths(document: Any) -> List[Tuple]:
    """The path to every value of a document, lists taken at their first element only (the others
    have the same fields and the same checks)."""
    return [path for path in value_paths(document) if all(key == 0 for key in path if isinstance(key, int))]


def mutations(predicate, values) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(document name, where, documents) for each value at each field where ``predicate`` holds."""
    documents = valid_documents()
    for name, document in documents.items():
        for path in field_paths(document):
            current = document
            for key in path:
                current = current[key]
            if predicate(current):
                for value in values:
                    yield name, f"{name}{list(path)}={value!r:.20}", replaced(documents, name, path, value)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


BAD_NUMBERS = (10**400, -(10**400), 2**64, float("nan"), float("inf"), float("-inf"), 1e308, -1e308)
WRONG_TYPES = (None, True, "3", [], {}, [1, "x"], -1.5)
ALL_COMMANDS = (["report"], ["report", "--json"], ["maps"], ["frames"], ["frames", "--json"])


def commands_reading(name: str, text_only: bool = False) -> List[List[str]]:
    """The commands that use a document: the report uses all, ``maps`` the map, ``frames`` the frames."""
    commands = [["report"], ["report", "--json"]] + {"map": [["maps"]],
                                                     "frames": [["frames"], ["frames", "--json"]]
                                                     }.get(name, [])
    return [command for command in commands if not (text_only and "--json" in command)]


def cli(*argv: str) -> Tuple[int, str, str]:
    """``gradnan ARGV`` in this process: its exit code, stdout and stderr; any exception propagates."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_clean_outcome(code: int, out: str, err: str, where: str) -> None:
    """A result (exit 0), or exactly one line on stderr with exit code 2."""
    assert code in (0, 2), (where, code, err)
    if code == 2:
        assert (err.endswith("\n") and err.count("\n") == 1
                and err.startswith("gradnan: error: ")), (where, err)
    else:
        assert out and not err, (where, err)


def failures_over(cases, commands_for, tmp_path: Path) -> Tuple[int, List[str]]:
    """Run the commands that read each mutated document: (commands run, what went wrong)."""
    count, failures = 0, []
    for number, (name, where, documents) in enumerate(cases):
        run_dir = write_run(tmp_path / f"run{number}", run_files(documents))
        for command in commands_for(name):
            count += 1
            try:
                assert_clean_outcome(*cli(command[0], str(run_dir), *command[1:]), where=f"{where} {command}")
            except Exception as exc:  # collected, so one run names every failing case
                failures.append(f"{where} {command}: {type(exc).__name__}: {str(exc)[:200]}")
        shutil.rmtree(run_dir)
    return count, failures


def test_the_unmutated_run_directory_is_read_whole_and_reported(tmp_path):
    files = read_run(write_run(tmp_path, run_files(valid_documents())))
    assert not files.problems and len(files.all_records()) == len(RECORD_KINDS) and len(files.bundles) == 1
    for command in ALL_COMMANDS:
        code, out, err = cli(command[0], str(tmp_path), *command[1:])
        assert code == 0 and out and not err, (command, err)


@pytest.mark.slow
def test_huge_and_nonfinite_numbers_anywhere_give_a_result_or_one_line(tmp_path):
    count, failures = failures_over(mutations(is_number, BAD_NUMBERS), commands_reading, tmp_path)
    assert count > 3000 and not failures, failures[:10]


@pytest.mark.slow
def test_wrong_types_anywhere_give_a_result_or_one_line(tmp_path):
    count, failures = failures_over(mutations(lambda value: True, WRONG_TYPES),
                                    lambda name: commands_reading(name, text_only=True), tmp_path)
    assert count > 2500 and not failures, failures[:10]


@pytest.mark.slow
def test_huge_magnitudes_in_the_plotted_parameters_are_refused_or_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    cases = [("pre_reduction", f"abs_max_finite={value!r}",
              replaced(valid_documents(), "pre_reduction", ("params", 0, "abs_max_finite"), value))
             for value in BAD_NUMBERS]
    count, failures = failures_over(iter(cases), lambda name: [["report", "--plot", str(tmp_path / "p.png")]],
                                    tmp_path)
    assert count == len(BAD_NUMBERS) and not failures, failures


# --- non-regular files and bounded reads ------------------------------------------------------


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def dev_zero(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/zero")
    return path


def directory(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


NOT_REGULAR = {"fifo": (fifo, "a FIFO"), "dev-zero": (dev_zero, "a symbolic link"),
               "directory": (directory, "a directory")}
RUN_FILES = {"map": "maps/rank00001.json", "records": "records/rank00001.jsonl",
             "selftest": "selftest/x.json", "manifest": f"bundles/rank00001/step0000001_m/{MANIFEST}"}


@pytest.mark.parametrize("kind", NOT_REGULAR)
@pytest.mark.parametrize("place", RUN_FILES)
def test_a_non_regular_file_in_a_run_directory_is_a_listed_problem(tmp_path, no_hang, kind, place):
    write_run(tmp_path, run_files(valid_documents()))
    make, said = NOT_REGULAR[kind]
    odd = make(tmp_path / RUN_FILES[place])
    files = read_run(tmp_path)
    assert f"{odd}: not a regular file ({said}): refused" in files.problems
    assert len(files.all_records()) == len(RECORD_KINDS)  # the good files are still read
    for command in ALL_COMMANDS:
        assert_clean_outcome(*cli(command[0], str(tmp_path), *command[1:]), where=command)


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_a_non_regular_config_file_is_one_line(tmp_path, no_hang, kind):
    make, said = NOT_REGULAR[kind]
    said = "a character device" if kind == "dev-zero" else said  # the user's own config: a link is followed
    odd = make(tmp_path / "gradnan.json")
    with pytest.raises(ConfigError, match=re.escape(f"{odd}: not a regular file ({said}): refused")):
        resolve_config(environ={"GRADNAN_CONFIG": str(odd)})


@pytest.mark.parametrize("kind", NOT_REGULAR)
@pytest.mark.parametrize("part", [MANIFEST, TENSORS])
def test_a_non_regular_file_in_a_bundle_is_one_line(tmp_path, no_hang, crafted_bundle, kind, part):
    path = crafted_bundle(tmp_path / "b", "healthy")
    (path / part).unlink()
    make, said = NOT_REGULAR[kind]
    make(path / part)
    code, out, err = cli("replay", str(path), "--device", "cpu")
    assert code == 2 and f"not a regular file ({said}): refused" in err and err.count("\n") == 1, err


def test_a_read_stops_at_its_bound(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"x" * 11)
    with pytest.raises(InputError, match="11 bytes, more than the 10 gradnan reads: refused"):
        read_text(path, max_bytes=10)
    assert read_text(path, max_bytes=11) == "x" * 11


def test_a_records_file_larger_than_any_gradnan_writes_is_refused_without_reading_it(tmp_path, no_hang):
    write_run(tmp_path, run_files(valid_documents()))
    huge = tmp_path / "records" / "rank00002.jsonl"
    with open(huge, "wb") as stream:
        stream.truncate(4 << 30)  # sparse: 4 GiB that take no disk and would take memory if read
    files = read_run(tmp_path)
    assert any(problem.startswith(f"{huge}: {4 << 30} bytes, more than") for problem in files.problems)
    assert len(files.all_records()) == len(RECORD_KINDS)


# --- unreadable directories, capabilities dropped -------------------------------------------


def as_unprivileged(command: List[str]) -> List[str]:
    """``command`` without the capabilities that let root read any file (file modes then apply)."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: root ignores file modes")
    dropped = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}", *command]


@pytest.mark.parametrize("unreadable", ["maps", "records", "."])
def test_an_unreadable_directory_is_named_not_taken_for_an_empty_one(tmp_path, unreadable):
    run_dir = write_run(tmp_path / "run", run_files(valid_documents()))
    target = run_dir / unreadable
    target.chmod(0o000)
    try:
        result = subprocess.run(as_unprivileged([sys.executable, "-m", "gradnan", "report", str(run_dir)]),
                                capture_output=True, text=True, timeout=120, env=environ_without_gradnan())
    finally:
        target.chmod(0o755)
    said = result.stdout + result.stderr
    assert result.returncode in (0, 2) and "Traceback" not in said, said
    assert "Permission denied" in said and "no gradnan maps or records here" not in said, said
    if result.returncode == 2:
        assert result.stderr.count("\n") == 1


# --- replay: the allowlist, the from_file exploit, manifests ---------------------------------


def test_the_from_file_payload_is_live(tmp_path):
    """What the crafted trace asks for really overwrites a file when executed: the refusal below matters."""
    victim = tmp_path / "victim.py"
    victim.write_bytes(b"print('victim')\n")
    payload = torch.frombuffer(bytearray(b"import os  # !!"), dtype=torch.uint8)
    mapped = torch.ops.aten.from_file.default(str(victim), True, payload.numel(), dtype=torch.uint8)
    torch.ops.aten.copy_.default(mapped, payload)
    del mapped
    assert victim.read_bytes().startswith(b"import os  # !!")


@pytest.mark.slow
def test_replay_refuses_the_from_file_exploit_and_leaves_the_victim_untouched(tmp_path, crafted_bundle):
    victim = tmp_path / "victim.py"
    victim.write_bytes(b"print('victim')\n")
    path = crafted_bundle(tmp_path / "evil", "from_file", victim=victim)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(path), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "aten.from_file.default" in result.stderr and "not on the replay allowlist" in result.stderr
    assert (victim.read_bytes() == b"print('victim')\n"
            and sorted(p.name for p in tmp_path.iterdir()) == before)


def test_the_crafted_bundle_replays_when_its_ops_are_allowed(tmp_path, crafted_bundle):
    code, out, err = cli("replay", str(crafted_bundle(tmp_path / "b", "healthy")), "--device", "cpu")
    assert code == 0 and "Verdict: healthy" in out, err


FORBIDDEN_OPS = ("from_file", "_from_file", "set_", "_copy_from", "_copy_from_and_resize", "record_stream",
                 "_amp_foreach_non_finite_check_and_unscale_", "_fused_adam_", "save",
                 "_nested_tensor_from_mask")


def test_the_allowlist_holds_only_pure_computation():
    """No allowed op takes a file name, a storage, a custom class (a process group) or a stream."""
    for packet in sorted(REPLAY_ALLOWLIST):
        for overload in getattr(torch.ops.aten, packet).overloads():
            for argument in getattr(getattr(torch.ops.aten, packet), overload)._schema.arguments:
                kind = str(argument.type)
                assert argument.name not in ("filename", "path") and not any(
                    word in kind for word in ("Storage", "__torch__", "Stream")), (packet, overload, kind)
    assert not any(allowed_in_replay(name) for name in FORBIDDEN_OPS)


def test_the_guarantees_page_lists_exactly_the_allowlist():
    page = (ROOT / "docs" / "guarantees.md").read_text()
    listed = re.search(r"<!-- replay allowlist -->\n(.*?)\n<!-- end -->", page, re.S)
    assert listed is not None, "docs/guarantees.md lacks the replay allowlist block"
    assert set(re.findall(r"`([\w]+)`", listed.group(1))) == set(REPLAY_ALLOWLIST)


def manifest_edit(key: str, value: Any):
    def edit(manifest: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
        target = manifest
        *parents, last = key.split(".")
        for name in parents:
            target = target[name]
        target[last] = value
    return edit


def tensor_edit(name: str, value: Any):
    def edit(manifest: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
        tensors[name] = value
    return edit


def delete(key: str):
    def edit(manifest: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
        del manifest["module"][key]
    return edit


UNUSABLE_MANIFESTS = {
    "module.class missing": (delete("class"), "'module.class' must be text"),
    "module.class a list": (manifest_edit("module.class", ["MLP"]), "'module.class' must be text"),
    "outputs 10**12": (manifest_edit("outputs", 10**12), "'outputs' must be a count of saved tensors"),
    "outputs a string": (manifest_edit("outputs", "1"), "'outputs' must be a count"),
    "outputs negative": (manifest_edit("outputs", -1), "'outputs' must be a count"),
    "seen a list": (manifest_edit("seen", []), "'seen' must be an object"),
    "recompute a string": (manifest_edit("recompute", "yes"), "'recompute' a boolean"),
    "trace leaves a list": (manifest_edit("trace.leaves", ["args.0"]), "needs a 'leaves' object"),
    "grad_out key not a number": (tensor_edit("grad_out.x", torch.ones(2)), "grad_out.<output number>"),
    "rng a float tensor": (tensor_edit("rng.cpu", torch.ones(5)), "is not a generator state"),
    "step huge": (manifest_edit("step", 10**400), "an integer 'step'"),
    "created 1e300": (manifest_edit("created", 1e300), "'created' must be numbers"),
    "first_nonfinite deep": (manifest_edit("trace.outputs", json.loads("[" * 900 + "]" * 900)), "nested"),
}


@pytest.mark.parametrize("case", UNUSABLE_MANIFESTS)
def test_a_manifest_replay_cannot_use_is_refused_before_anything_runs(tmp_path, crafted_bundle, case):
    edit, message = UNUSABLE_MANIFESTS[case]
    path = crafted_bundle(tmp_path / "b", "healthy", edit=edit)
    code, out, err = cli("replay", str(path), "--device", "cpu")
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_huge_and_nonfinite_numbers_anywhere_in_a_manifest_give_a_result_or_one_line(tmp_path,
                                                                                     crafted_bundle):
    path = crafted_bundle(tmp_path / "b", "healthy")
    manifest = json.loads((path / MANIFEST).read_text())
    count, failures = 0, []
    for where in value_paths(manifest):
        value = manifest
        for key in where:
            value = value[key]
        if not is_number(value):
            continue
        for bad in BAD_NUMBERS:
            changed = copy.deepcopy(manifest)
            target = changed
            for key in where[:-1]:
                target = target[key]
            target[where[-1]] = bad
            (path / MANIFEST).write_text(json.dumps(changed))
            count += 1
            try:
                assert_clean_outcome(*cli("replay", str(path), "--device", "cpu"), where=where)
            except Exception as exc:
                failures.append(f"{list(where)}={bad!r}: {type(exc).__name__}: {str(exc)[:200]}")
    assert count >= 40 and not failures, failures[:10]


# --- writers: two launches, a full disk, one log line per reason ------------------------------


NAN_AT_2 = (Injection(1, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan", where="backward", index=3),)


@pytest.mark.slow
def test_two_launches_into_one_directory_keep_their_maps_and_stay_two_launches(tmp_path):
    """No run id on either, a few seconds apart: only the rendezvous tells them apart."""
    job = TinyGPTJob(tp=2, dtype="bf16", steps=3, injections=NAN_AT_2, gradnan={"out_dir": str(tmp_path)})
    launch(job)
    first_maps = {path.name: path.read_bytes() for path in (tmp_path / "maps").iterdir()}
    launch(job)
    maps_now = {path.name: path.read_bytes() for path in (tmp_path / "maps").iterdir()}
    assert all(maps_now[name] == content for name, content in first_maps.items())  # nothing overwritten
    assert len(maps_now) == 2 * len(first_maps)
    report = build_report(read_run(tmp_path))
    assert len(report["runs"]) == 2 and all(run["first_step"] == 2 for run in report["runs"])
    origin = report["incident"]["origin"]
    assert [entry["global_rank"] for entry in origin] == [1]  # once, not once per launch
    assert [p["nan"] for p in origin[0]["params"]] == [p["nan"] for p in build_report(
        read_run(tmp_path), run=report["runs"][0]["run"])["incident"]["origin"][0]["params"]]


def test_a_torn_last_line_is_closed_before_the_next_record(tmp_path):
    path = tmp_path / "records" / "rank00000.jsonl"
    whole = as_record_line(a_record(step=1))
    path.parent.mkdir()
    path.write_bytes(whole + b"\n" + whole[:40])  # a write cut short by a full disk
    append_json_line(path, a_record(step=2))
    found, problems = load_records(path)
    assert [record["step"] for record in found] == [1, 2]
    assert len(problems) == 1 and problems[0].startswith(f"{path}:2: invalid JSON")


def _write_under_a_file_size_limit(out_dir: str, room: int, results: "multiprocessing.Queue") -> None:
    """In a child: records and a bundle written while files may grow only ``room`` bytes past the first
    record (the kernel cuts the write short, then refuses with EFBIG: what a full disk does with
    ENOSPC), then with the limit lifted (the disk freed)."""
    from gradnan.config import GradnanConfig
    from gradnan.events import ModelFacts
    from gradnan.training.writer import Writer

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    messages: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("gradnan").addHandler(handler)
    # this child's level, whatever an earlier in-process install() left (log_level="CRITICAL" in one test)
    logging.getLogger("gradnan").setLevel(logging.INFO)
    facts = ModelFacts(coords=lambda: {**coords(0), "pid": os.getpid()}, versions=lambda: {},
                       named_modules=lambda chunks: [])
    writer = Writer(GradnanConfig(out_dir=out_dir), facts)
    param = [{"id": 0, "name": "w" * 300, "nan": 1, "inf": 0}]
    written = Path(writer.record(RecordKind.PRE_REDUCTION, 1, param, {}).path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (written.stat().st_size + room, hard))
    for step in (2, 3):
        writer.record(RecordKind.PRE_REDUCTION, step, param, {})
    bundle_written = writer.bundle(3, "decoder", {"module": {"path": "decoder", "class": "M"}, "trace": {}},
                                   {"x": torch.ones(4096)})
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    writer.record(RecordKind.PRE_REDUCTION, 4, param, {})
    results.put({"messages": messages, "bundle_written": bundle_written is not None})


def test_a_full_disk_part_way_through_a_record_loses_only_that_record(tmp_path):
    records_file = tmp_path / "records" / f"{rank_tag(coords(0))}.jsonl"
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_write_under_a_file_size_limit, args=(str(tmp_path), 300, results))
    child.start()
    outcome = results.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    found, problems = load_records(records_file)
    assert [record["step"] for record in found] == [1, 4]  # 2 torn, 3 refused; 4 readable after the tear
    assert len(problems) == 1 and problems[0].startswith(f"{records_file}:2:")
    refused = [message for message in outcome["messages"] if message.startswith("cannot write")]
    # once for the records (two failed), once for the bundle
    assert len(refused) == 2, "\n".join(outcome["messages"])
    assert refused[0].startswith(f"cannot write the record {records_file}: File too large")
    assert refused[1].startswith("cannot write the bundle ") and "torch.save could not write it" in refused[1]
    assert not outcome["bundle_written"]
    assert not any(path.name.startswith(".") for path in tmp_path.rglob("*"))  # no temporary left behind


def test_a_failing_torch_save_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed"
                           " writing file")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        bundle.write(tmp_path / "b", {}, {"x": torch.ones(2)})
    assert info.value.filename.endswith(TENSORS) and "PytorchStreamWriter failed" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone


# --- configuration and launcher ---------------------------------------------------------------


@pytest.mark.slow
def test_an_empty_out_dir_is_refused_not_the_current_directory(tmp_path):
    with pytest.raises(ConfigError, match="'out_dir' is empty"):
        resolve_config(environ={"GRADNAN_OUT_DIR": ""})
    result = subprocess.run([sys.executable, "-m", "gradnan.run", "-m", "json.tool"], cwd=tmp_path,
                            input="{}", capture_output=True, text=True, timeout=120,
                            env={**environ_without_gradnan(), "GRADNAN_OUT_DIR": ""})
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "out_dir" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_range_as_wide_as_int64_costs_nothing():
    config = resolve_config(environ={"GRADNAN_STEPS": "0-100000000000",
                                     "GRADNAN_RANKS": "3,7-9223372036854775807"})
    assert 99_999_999_999 in config.ranges("steps") and 100_000_000_001 not in config.ranges("steps")
    assert 2**62 in config.ranges("ranks") and 4 not in config.ranges("ranks")


@pytest.mark.slow
def test_the_demo_with_its_port_taken_is_one_line_naming_the_cause(tmp_path, monkeypatch, capsys):
    import socket

    import gradnan.testing.toy as toy

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(toy, "free_port", lambda: taken.getsockname()[1])
        code = main(["demo", "--out", str(tmp_path / "demo")])
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("gradnan: error:")]
    assert code == 2 and len(ours) == 1 and "EADDRINUSE" in ours[0] and "Traceback" not in err, err


# --- the terminal -------------------------------------------------------------------------------

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202e"  # set the title, clear the screen, red, right-to-left
CONTROLS = ("\x1b", "\x07", "\x9b", "\u202e")


def test_control_characters_from_a_file_never_reach_the_terminal(tmp_path):
    documents = valid_documents()
    evil = f"decoder.layers.0.mlp{ESCAPES}.weight"
    columns = documents["map"]["param_columns"]
    documents["map"]["params"][0][columns.index("name")] = evil
    documents["pre_reduction"]["params"][0]["name"] = evil
    documents["frames"]["frames"][0]["module"] = evil
    documents["pre_reduction"]["rank"]["host"] = ESCAPES
    write_run(tmp_path, run_files(documents))
    for command in ALL_COMMANDS:
        code, out, err = cli(command[0], str(tmp_path), *command[1:])
        assert code == 0 and not any(character in out + err for character in CONTROLS), command
    code, out, err = cli("maps", str(tmp_path))
    assert printable(evil) in out and "\\x1b]0;owned\\x07" in out
