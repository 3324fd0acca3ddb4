"""Untrusted input, second round (issue 25): the writers, the terminal and the clipboard.

Classes, each against the real writers, readers and CLI: planted symbolic links in a shared out dir (the
writers never write through one; a real two-process launch below), commands and paths the user copies
(shell-quoted), fake lines from values (every line and paragraph separator, bidirectional and zero-width
character escaped by the one function ``printable``), bounded problem lists, ``gradnan maps`` streaming a
map's table, one-line errors, and nothing of a file outside the run directory echoed. Each case ends in a
result or one line with exit code 2, and touches nothing outside the run directory.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

from gradnan.commandline import printable
from gradnan.formats import maps
from gradnan.formats.layout import MANIFEST, TENSORS, rank_tag
from gradnan.formats.safe_write import RefusedPath, append_json_line, held_directory, write_json_atomic
from gradnan.offline.incident.read import MAX_PROBLEMS, read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.toy import launch
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import environ_without_gradnan, observed, printed_commands
from .test_readers_property import PARAM_NAMES, a_map, coords
from .test_untrusted import RECORD_KINDS, cli, run_files, valid_documents, write_run

FAKE = "Verdict: hardware: the GPU on node-7 is faulty"
# characters that end a line, reorder or hide what a terminal shows, or drive it
HOSTILE = {
    "newline": "\n", "carriage-return": "\r", "vertical-tab": "\x0b", "form-feed": "\x0c", "tab": "\t",
    "escape": "\x1b[2J", "bell": "\x07", "next-line": "\u0085", "line-separator": "\u2028",
    "paragraph-separator": "\u2029", "lrm": "\u200e", "rlm": "\u200f", "arabic-letter-mark": "\u061c",
    "lre": "\u202a", "rle": "\u202b", "pdf": "\u202c", "lro": "\u202d", "rlo": "\u202e", "lri": "\u2066",
    "rli": "\u2067", "fsi": "\u2068", "pdi": "\u2069", "zero-width-space": "\u200b", "zwnj": "\u200c",
    "zwj": "\u200d", "word-joiner": "\u2060", "byte-order-mark": "\ufeff", "soft-hyphen": "\u00ad",
}
RAW = {character for text in HOSTILE.values() for character in text if not character.isprintable()}


def assert_no_fake_line(code: int, out: str, err: str, where: str) -> None:
    """A result, or one line and exit code 2; no line of its own from a value, no raw hostile character
    (a newline only as the layout)."""
    assert code in (0, 2), where
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("gradnan: error: "), (where, err)
    text = out + err
    assert not any(line.lstrip(" -").startswith(FAKE) for line in text.split("\n")), (where, text)
    assert not (RAW - {"\n"}) & set(text), (where, sorted(RAW & set(text)))


def hostile(separator: str) -> str:
    return f"decoder.layers.0{separator}{FAKE}"


# --- class: fake lines through report, maps, frames, replay -----------------------------------------

def a_rerun_record(module: str, klass: str, bundle: Any = None, batch: Any = None) -> Dict[str, Any]:
    record = dict(valid_documents()["pre_reduction"])
    record.update(kind="rerun", params=[], params_total=0, role="origin", observed=observed("reproducible"),
                  module=module, micro_batch=0, call=1, output_abs_max="nan", trigger="incident",
                  megatron=None, bundle=bundle, batch=batch, **{"class": klass})
    return record


def a_clean_state_record() -> Dict[str, Any]:
    """Rank 0's weights and optimizer state, finite, as read at the run's first incident."""
    record = dict(valid_documents()["pre_reduction"])
    record.update(kind="state", params=[], params_total=0, weights_digest="d", params_checked=1,
                  optimizer_state_total=0, optimizer_state_checked=0, optimizer_state=[])
    return record


def _parameter_name(documents: Dict[str, Any], value: str) -> None:
    columns = documents["map"]["param_columns"]
    documents["map"]["params"][0][columns.index("name")] = value
    documents["pre_reduction"]["params"][0]["name"] = value


def _frame_module(documents: Dict[str, Any], value: str) -> None:
    documents["frames"]["frames"][0]["module"] = value
    documents["frames"]["frames"][0]["entries"][0]["name"] = value
    documents["frames"]["mode"] = "detect"


def _manifest(documents: Dict[str, Any], value: str) -> None:
    documents["bundle"]["module"] = {"path": value, "class": value}
    documents["bundle"]["rank"] = {**documents["bundle"]["rank"], "host": value, "device": value}


def _host(documents: Dict[str, Any], value: str) -> None:
    documents["pre_reduction"]["rank"] = {**documents["pre_reduction"]["rank"], "host": value}


def _probe(documents: Dict[str, Any], value: str) -> None:
    documents["probe"]["probes"][0].update(label=value, module=value)


PLACES: Dict[str, Callable[[Dict[str, Any], str], None]] = {
    "parameter-name": _parameter_name, "frame-module": _frame_module, "manifest-module-class-host": _manifest,
    "record-host": _host, "probe-label-module": _probe}
TEXT_COMMANDS = (["report"], ["maps"], ["maps", "--id", "0"], ["frames"])


def _run_with(tmp_path: Path, place: str, value: str, extra: Dict[str, bytes] = None) -> Path:
    documents = valid_documents()
    PLACES[place](documents, value)
    files = run_files(documents)
    write_run(tmp_path, {**files, **(extra or {})})
    return tmp_path


@pytest.mark.parametrize("separator", HOSTILE)
@pytest.mark.parametrize("place", PLACES)
def test_a_value_from_a_file_cannot_print_a_line_of_its_own(tmp_path, place, separator):
    run_dir = _run_with(tmp_path, place, hostile(HOSTILE[separator]))
    for command in TEXT_COMMANDS:
        assert_no_fake_line(*cli(command[0], str(run_dir), *command[1:]), f"{place} {command}")


@pytest.mark.parametrize("separator", HOSTILE)
def test_a_rerun_module_and_class_cannot_print_a_line_of_their_own(tmp_path, separator):
    documents = valid_documents()
    rerun = a_rerun_record(hostile(HOSTILE[separator]), hostile(HOSTILE[separator]))
    files = run_files(documents)
    tag = rank_tag(coords(0))
    files[f"records/{tag}.jsonl"] += json.dumps(rerun).encode() + b"\n"
    write_run(tmp_path, files)
    code, out, err = cli("report", str(tmp_path))
    assert code == 0 and "Forward origin" in out, out
    assert_no_fake_line(code, out, err, "rerun module")


@pytest.mark.parametrize("separator", HOSTILE)
def test_a_records_file_name_cannot_print_a_line_of_its_own(tmp_path, separator):
    junk = {f"records/rank{HOSTILE[separator]}{FAKE}.jsonl": b"not json\n"}
    run_dir = _run_with(tmp_path, "record-host", "node-0", junk)
    code, out, err = cli("report", str(run_dir))
    assert code == 0 and "Files that could not be read: 1" in out, out
    assert_no_fake_line(code, out, err, "records file name")


@pytest.mark.parametrize("separator", HOSTILE)
def test_a_replayed_manifest_cannot_print_a_line_of_its_own(tmp_path, crafted_bundle, separator):
    value = hostile(HOSTILE[separator])

    def edit(manifest, tensors):
        manifest["module"] = {"path": value, "class": value}
        manifest["rank"] = {**manifest["rank"], "host": value, "device": value}
        manifest.update(outputs_parameters=[value], outputs_changed=[{"output": 0, "by": "in_place",
                                                                       "nonfinite": False}])

    path = crafted_bundle(tmp_path / f"b{HOSTILE[separator]}x", "healthy", edit=edit)
    code, out, err = cli("replay", str(path), "--device", "cpu")
    assert code == 0 and "Verdict: " in out and "Output 0 is the module's parameter " in out, err
    assert_no_fake_line(code, out, err, "replay")


@pytest.mark.parametrize("text", [*HOSTILE.values(), "\ud800", "\U000e0001", "\u3000", "\ue000"])
def test_printable_is_one_line_of_printable_characters_and_escaping_twice_changes_nothing(text):
    shown = printable(f"a{text}b")
    assert shown.isprintable() and "\n" not in shown and printable(shown) == shown


def test_ordinary_text_is_shown_as_it_is():
    for text in ("decoder.layers.0.mlp.linear_fc1.weight", "nœud-7 GPU 0", "层.权重", "emoji 🔥"):
        assert printable(text) == text


# --- class: commands and paths the user copies ------------------------------------------------------

INJECTED = "/tmp/x; touch /tmp/PWNED #"


def _copied_commands(out: str) -> List[List[str]]:
    """Every command line the report offers, split as a POSIX shell splits it."""
    commands = []
    for line in out.splitlines():
        for marker in ("gradnan replay ", "gradnan frames "):
            if marker in line:  # each at the end of its line
                commands.append(shlex.split(line[line.index(marker):]))
    return commands


def test_a_bundle_and_micro_batch_from_a_record_are_quoted_for_the_shell(tmp_path):
    files = run_files(valid_documents())
    rerun = a_rerun_record("decoder.layers.0.mlp", "MLP", bundle=INJECTED, batch={"path": INJECTED})
    files[f"records/{rank_tag(coords(0))}.jsonl"] += json.dumps(rerun).encode() + b"\n"
    write_run(tmp_path, files)
    code, out, err = cli("report", str(tmp_path))
    assert code == 0
    assert ["gradnan", "replay", INJECTED] in printed_commands(out, "replay")
    assert printed_commands(out, "batch") == [["gradnan", "batch", INJECTED]]


@pytest.mark.parametrize("name", ["run dir", "run;touch PWNED", "run$(id)", "run'quote", "run`id`"])
def test_the_run_dir_in_printed_commands_is_one_shell_word(tmp_path, name):
    documents = valid_documents()
    documents["frames"]["mode"] = "detect"
    documents["bundle"]["module"]["path"] = "decoder; touch PWNED"
    run_dir = write_run(tmp_path / name, run_files(documents))
    code, out, err = cli("report", str(run_dir))
    assert code == 0
    commands = _copied_commands(out)
    assert commands and all(command[2] == str(run_dir) or command[2].startswith(str(run_dir) + "/")
                            for command in commands), commands
    assert out.splitlines()[0].startswith(f"gradnan report for {shlex.quote(str(run_dir))}  (")


def test_the_printed_commands_run_nothing_when_pasted(tmp_path):
    """The quoted line, given to a real shell as the user would paste it: no file appears."""
    files = run_files(valid_documents())
    target = tmp_path / "PWNED"
    rerun = a_rerun_record("m", "C", bundle=f"/nonexistent; touch {target} #", batch=None)
    files[f"records/{rank_tag(coords(0))}.jsonl"] += b"".join(
        json.dumps(record).encode() + b"\n" for record in (rerun, a_clean_state_record()))
    run_dir = write_run(tmp_path / "run", files)
    _, out, _ = cli("report", str(run_dir))
    replays = [line.strip().removeprefix("replay it: ") for line in out.splitlines()
               if line.strip().startswith(("replay it: ", "gradnan replay ")) and str(target) in line]
    assert len(replays) == 2  # the replay, and the same with --against (the bisect step)
    for replay in replays:
        subprocess.run(["sh", "-c", replay.replace("gradnan replay", "true")], check=True)
    assert not target.exists()


def test_the_capture_settings_are_quoted(tmp_path):
    documents = valid_documents()
    _parameter_name(documents, "decoder.layers.0 $(touch PWNED).weight")
    write_run(tmp_path, run_files(documents))
    report = build_report(read_run(tmp_path))
    code, out, _ = cli("report", str(tmp_path))
    settings = report["rerun_capture"]
    if settings:  # a pattern the run gives: each setting one shell word
        [line] = [line for line in out.splitlines() if line.startswith("  GRADNAN_CAPTURE_MODULES=")]
        assert dict(word.split("=", 1) for word in shlex.split(line)) == settings


def test_the_launch_keys_to_pass_to_run_are_quoted(tmp_path):
    documents = valid_documents()
    first, second = (dict(documents["pre_reduction"], run={**documents["pre_reduction"]["run"], "id": name})
                     for name in ("job; touch PWNED", "job two"))
    files = run_files(documents)
    files[f"records/{rank_tag(coords(0))}.jsonl"] = json.dumps(first).encode() + b"\n" + json.dumps(
        second).encode() + b"\n"
    write_run(tmp_path, files)
    code, out, _ = cli("report", str(tmp_path))
    [line] = [line for line in out.splitlines() if line.startswith("Launches here: ")]
    assert "'job; touch PWNED#0' (fails at step 1)" in line and "'job two#0'" in line, line


# --- class: problem lists are bounded --------------------------------------------------------------

def test_a_records_file_of_junk_lines_keeps_the_first_problems_and_counts_all(tmp_path):
    documents = valid_documents()
    files = run_files(documents)
    junk_lines = MAX_PROBLEMS * 3
    files[f"records/{rank_tag(coords(0))}.jsonl"] += b"junk\n" * junk_lines
    write_run(tmp_path, files)
    read = read_run(tmp_path, params=False)
    assert len(read.problems) == MAX_PROBLEMS and read.problems.total == junk_lines
    report = build_report(read)
    assert len(report["problems"]) == MAX_PROBLEMS and report["problems_total"] == junk_lines
    assert report["incident"] is not None  # the good records before the junk still decide the verdict
    code, out, err = cli("report", str(tmp_path))
    assert code == 0 and f"Files that could not be read: {junk_lines}" in out
    assert f"... and {junk_lines - 3} more problem(s)" in out


def test_junk_after_the_records_keeps_every_good_record(tmp_path):
    files = run_files(valid_documents())
    good = files[f"records/{rank_tag(coords(0))}.jsonl"]
    files[f"records/{rank_tag(coords(0))}.jsonl"] = good + b"{\n" * (2 * MAX_PROBLEMS) + good
    write_run(tmp_path, files)
    read = read_run(tmp_path)
    assert sum(map(len, read.records.values())) == 2 * len(RECORD_KINDS)
    assert read.problems.total == 2 * MAX_PROBLEMS


# --- class: gradnan maps streams a map's table -----------------------------------------------------

def _big_map(path: Path, rows: int) -> Dict[str, Any]:
    names = [f"decoder.layers.{i}.mlp.weight" for i in range(rows)]
    document = a_map(0, PARAM_NAMES, [None] * len(PARAM_NAMES), valid_documents()["pre_reduction"]["run"])
    template = document["params"][0]
    document["params"] = [[i, name, *template[2:]] for i, name in enumerate(names)]
    document["params_count"] = rows
    maps.write(path, document)
    return document


def test_maps_id_reads_the_table_as_a_stream_and_finds_the_row(tmp_path):
    rows = 20_000  # many chunks' worth would be slow to build; the chunk size is what is streamed
    document = _big_map(tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json", rows)
    header, params = maps.stream_params(tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json", lambda h: True)
    assert maps.stream_params(tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json", lambda h: False) is None
    assert not isinstance(params, list) and "params" not in header
    streamed = list(params)
    whole = maps.load(tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json")["params"]
    assert streamed == whole and len(streamed) == rows
    code, out, err = cli("maps", str(tmp_path), "--id", str(rows - 1))
    assert code == 0 and out == f"rank 0 id {rows - 1}: {document['params'][-1][1]} [4, 2] torch.bfloat16\n"


def test_a_map_streamed_in_small_chunks_is_read_the_same(tmp_path, monkeypatch):
    path = tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json"
    _big_map(path, 300)
    monkeypatch.setattr(maps, "CHUNK_BYTES", 7)  # every row cut somewhere, characters included
    assert list(maps.stream_params(path, lambda h: True)[1]) == maps.load(path)["params"]


@pytest.mark.parametrize("tail", [b"", b"]", b"]}x", b'],[1,"x"]]}', b"[1,2]]}", b"]]}"])
def test_a_map_with_a_bad_table_is_left_out_in_one_line(tmp_path, tail):
    path = tmp_path / "maps" / "rank00000_tp0_pp0_dp0.json"
    _big_map(path, 50)
    data = path.read_bytes()
    path.write_bytes(data[:data.rindex(b"]]}")] + b"]" + tail if tail else data[:-40])
    code, out, err = cli("maps", str(tmp_path), "--id", "3")
    assert code == 2 and err.count("\n") == 1, (out, err)


# --- class: every error one line ------------------------------------------------------------------

@pytest.mark.parametrize("separator", HOSTILE)
def test_a_run_dir_or_bundle_path_with_a_hostile_character_is_one_line(tmp_path, separator):
    odd = tmp_path / f"run{HOSTILE[separator]}{FAKE}"
    for argv in (["report", str(odd)], ["maps", str(odd)], ["frames", str(odd)],
                 ["replay", str(odd), "--device", "cpu"]):
        code, out, err = cli(*argv)
        assert code == 2 and out == ""
        assert_no_fake_line(code, out, err, str(argv))


def test_a_quantized_tensor_is_one_line_without_torch_warnings(tmp_path, crafted_bundle):
    """In a process of its own: pytest would catch the warnings that a user's terminal shows."""
    def edit(manifest, tensors):
        with warnings.catch_warnings():  # torch warns once per process: whichever test quantizes first
            warnings.simplefilter("ignore", UserWarning)
            tensors["args.0"] = torch.quantize_per_tensor(torch.randn(4, 3), 0.1, 0, torch.qint8)

    path = crafted_bundle(tmp_path / "b", "healthy", edit=edit)
    done = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(path), "--device", "cpu"],
                          capture_output=True, text=True, env=environ_without_gradnan(), timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gradnan: error: ") and "warn" not in done.stderr.lower(), done.stderr


# --- class: nothing of a file outside the run directory in a message -------------------------------

SECRET = "the-secret-schema-value"


@pytest.mark.parametrize("member", ["manifest", "map", "records", "selftest"])
def test_a_member_symlinked_elsewhere_is_refused_without_its_content(tmp_path, member):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"schema": SECRET, "version": 1}) + "\n")
    before = outside.read_bytes()
    run_dir = write_run(tmp_path / "run", run_files(valid_documents()))
    tag = rank_tag(coords(0))
    relative = {"manifest": f"bundles/{tag}/step0000001_decoder/{MANIFEST}", "map": f"maps/{tag}.json",
                "records": f"records/{tag}.jsonl", "selftest": "selftest/s.json"}[member]
    (run_dir / relative).unlink()
    (run_dir / relative).symlink_to(outside)
    code, out, err = cli("report", str(run_dir))
    assert code == 0 and SECRET not in out + err
    assert f"{run_dir / relative}: not a regular file (a symbolic link): refused" in out
    assert outside.read_bytes() == before


def test_a_bundle_member_symlinked_elsewhere_is_refused_without_its_content(tmp_path, crafted_bundle):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"schema": SECRET, "version": 1}))
    path = crafted_bundle(tmp_path / "b", "healthy")
    for member in (MANIFEST, TENSORS):
        (path / member).rename(path / f"{member}.real")
        (path / member).symlink_to(outside)
        code, out, err = cli("replay", str(path), "--device", "cpu")
        assert code == 2 and SECRET not in err and "a symbolic link" in err and err.count("\n") == 1
        (path / member).unlink()
        (path / f"{member}.real").rename(path / member)


# --- class: the writers never write through a link -------------------------------------------------

@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim" / ".bashrc"
    path.parent.mkdir()
    path.write_text("alias ls='ls --color'\n")
    return path


def _untouched(victim: Path) -> None:
    assert victim.read_text() == "alias ls='ls --color'\n" and sorted(victim.parent.iterdir()) == [victim]


@pytest.mark.parametrize("link, reason", [("symlink_to", "a symbolic link"), ("hardlink_to", "a hard link")])
def test_a_records_file_that_is_a_link_is_refused(tmp_path, victim, link, reason):
    out_dir = tmp_path / "out"
    (out_dir / "records").mkdir(parents=True)
    getattr(out_dir / "records" / "rank00000.jsonl", link)(victim)
    with pytest.raises(RefusedPath, match=reason):
        append_json_line(out_dir / "records" / "rank00000.jsonl", {"a": 1}, out_dir)
    _untouched(victim)


@pytest.mark.parametrize("directory", ["records", "maps", "bundles/rank00000"])
def test_a_directory_below_the_out_dir_that_is_a_link_is_refused(tmp_path, victim, directory):
    out_dir = tmp_path / "out"
    (out_dir / directory).parent.mkdir(parents=True, exist_ok=True)
    (out_dir / directory).symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(RefusedPath, match="a symbolic link"):
        append_json_line(out_dir / directory / "x.jsonl", {"a": 1}, out_dir)
    with pytest.raises(RefusedPath, match="a symbolic link"):
        write_json_atomic(out_dir / directory / "x.json", {"a": 1}, root=out_dir)
    bundle = out_dir / directory / "b"  # where a bundle or a micro-batch is written
    with pytest.raises(RefusedPath, match="a symbolic link"), held_directory(bundle, out_dir):
        pass
    _untouched(victim)


def test_a_map_named_by_a_link_replaces_the_link_not_its_target(tmp_path, victim):
    out_dir = tmp_path / "out"
    (out_dir / "maps").mkdir(parents=True)
    (out_dir / "maps" / "rank00000.json").symlink_to(victim)
    write_json_atomic(out_dir / "maps" / "rank00000.json", {"a": 1}, root=out_dir)
    assert not (out_dir / "maps" / "rank00000.json").is_symlink()
    with pytest.raises(FileExistsError):
        (out_dir / "maps" / "rank00001.json").symlink_to(victim)
        write_json_atomic(out_dir / "maps" / "rank00001.json", {"a": 1}, replace=False, root=out_dir)
    _untouched(victim)


def test_the_out_dir_itself_may_be_a_link_the_user_chose(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real", target_is_directory=True)
    assert append_json_line(tmp_path / "out" / "records" / "r.jsonl", {"a": 1}, tmp_path / "out")
    assert (tmp_path / "real" / "records" / "r.jsonl").read_text() == '{"a":1}\n'


def test_the_runtime_warns_once_per_refused_path_and_goes_on(tmp_path, victim, make_runtime, caplog):
    from .test_runtime_logging import FakeOptimizer, _slot

    (tmp_path / "records").mkdir()
    (tmp_path / "records" / f"{rank_tag(coords(0))}.jsonl").symlink_to(victim)
    (tmp_path / "maps").symlink_to(victim.parent, target_is_directory=True)
    runtime, optimizer = make_runtime(strict=True), FakeOptimizer()
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        for _ in range(3):
            runtime.guarded("optimizer step", runtime.begin_step, optimizer, lambda: [_slot()])
            assert runtime.guarded("grad-norm check", runtime.nonfinite_grad_norm, optimizer,
                                   float("nan"), [_slot()], [grad]) is None
    refused = [r.getMessage() for r in caplog.records if "a symbolic link" in r.getMessage()]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "a symbolic link" in r.getMessage())
    assert len(refused) == 2 and sum("not writing the record" in m for m in refused) == 1, refused
    assert sum("not writing the map" in m for m in refused) == 1, refused
    _untouched(victim)


# --- the same with a real two-process launch --------------------------------------------------------

def _records_job(out_dir: Path) -> TinyGPTJob:
    return TinyGPTJob(world_size=2, steps=3,
                      injections=(Injection(1, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan", index=3),),
                      gradnan={"out_dir": str(out_dir)})


def _bits(results) -> Dict[int, List[str]]:
    """Each rank's losses and grad norms, exactly (``repr`` round-trips a float, NaN included)."""
    return {rank: [repr((step.loss, step.grad_norm)) for step in result.steps]
            for rank, result in results.items()}


@pytest.mark.slow
def test_planted_links_in_a_shared_out_dir_in_a_two_process_launch(tmp_path, victim, capfd):
    """``records/rank00000....jsonl -> victim`` and ``maps -> elsewhere``: the victim is unchanged, nothing
    lands elsewhere, training is bitwise the clean run's, and one warning per planted path on each rank."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted, clean = tmp_path / "planted", tmp_path / "clean"
    (planted / "records").mkdir(parents=True)
    (planted / "records" / "rank00000_tp0_pp0_dp0.jsonl").symlink_to(victim)
    (planted / "maps").symlink_to(elsewhere, target_is_directory=True)
    dirty = launch(_records_job(planted))
    warned = capfd.readouterr().err
    reference = launch(_records_job(clean))
    assert _bits(dirty) == _bits(reference)
    _untouched(victim)
    assert list(elsewhere.iterdir()) == []
    lines = [line for line in warned.splitlines() if "a symbolic link" in line]
    assert sum("not writing the record" in line and "rank 0]" in line for line in lines) == 1, lines
    for rank in (0, 1):
        assert sum("not writing the map" in line and f"rank {rank}]" in line for line in lines) == 1, lines
    assert (planted / "records" / "rank00001_tp0_pp0_dp1.jsonl").exists()  # the other rank's own file
