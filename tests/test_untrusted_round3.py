"""Untrusted input, third round (issue 38): the offline writers never write through a link and never lose
what was written, readers never follow a linked directory, a second launch keeps the first one's run-up, the
skip flag is the origin's and checked, ``gradnan batch`` and every option are bounded and validated, lists
are bounded in the text. Each case ends in a result or one line with exit code 2, touching nothing outside
the run directory. (The fake lines: ``test_forged_lines.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradnan.formats.health import health_line
from gradnan.formats.layout import RUNUP_DIR, rank_tag
from gradnan.formats.wording import samples_wording
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.batch_view import _decoded
from gradnan.offline.incident.read import read_run
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import environ_without_gradnan, observed
from .test_next_steps import CORE, _next, _rerun
from .test_readers_property import coords
from .test_untrusted import cli, run_files, valid_documents, write_run

SECRET = "the-secret-schema-value"


def assert_one_line(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert err.startswith("gradnan") and ": error: " in err, err
    assert all(word in err for word in words), err


# --- the picture: a new file renamed into place; never through a link, onto a device or elsewhere ---------

@pytest.fixture(scope="module")
def failing_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("run"), run_files(valid_documents()))


@pytest.mark.parametrize("name, words", [("x.pgf", ["x.pgf'", ".png, .svg, .pdf"]), ("x.", [".png"]),
                                         ("x", [".png"]), ("x.PNGX", [".png"])])
def test_a_picture_format_that_would_run_latex_or_write_elsewhere_is_refused(failing_run, tmp_path, name,
                                                                              words):
    before = set(tmp_path.iterdir())
    assert_one_line(*cli("report", str(failing_run), "--plot", str(tmp_path / name)), *words)
    assert set(tmp_path.iterdir()) == before


def test_a_picture_into_a_directory_a_link_or_a_device_is_refused(failing_run, tmp_path):
    directory = tmp_path / "d.png"
    directory.mkdir()
    assert_one_line(*cli("report", str(failing_run), "--plot", str(directory)), "a directory")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "incident.png"
    link.symlink_to(victim)
    assert_one_line(*cli("report", str(failing_run), "--plot", str(link)), "symbolic link")
    assert victim.read_text() == "precious" and link.is_symlink()
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    assert_one_line(*cli("report", str(failing_run), "--plot", str(fifo)), "not a plain file")
    assert_one_line(*cli("report", str(failing_run), "--plot", "/dev/full"), ".png")


def test_a_picture_replaces_an_old_one_whole_and_a_failed_write_keeps_the_old_one(failing_run, tmp_path):
    picture = tmp_path / "incident.png"
    picture.write_bytes(b"the old picture")
    assert cli("report", str(failing_run), "--plot", str(picture))[0] == 0
    drawn = picture.read_bytes()
    assert drawn.startswith(b"\x89PNG") and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    picture.write_bytes(b"the old picture")
    # a full disk, as the file size limit gives it: the write fails part-way (EFBIG)
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
              " resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000));"
              " from gradnan.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "report", str(failing_run), "--plot", str(picture)],
                          capture_output=True, text=True, env=environ_without_gradnan(), timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert picture.read_bytes() == b"the old picture"
    assert [p.name for p in tmp_path.iterdir()] == ["incident.png"]  # no temporary file left


# --- readers: a linked directory is a listed problem, and nothing of its content is echoed ------------

@pytest.mark.parametrize("directory", ["records", "maps", "selftest", "bundles", RUNUP_DIR])
def test_a_linked_directory_of_a_run_is_not_followed(tmp_path, directory):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name in ("a.json", "a.jsonl"):
        (outside / name).write_text(json.dumps({"schema": SECRET, "version": 1}) + "\n")
    run_dir = write_run(tmp_path / "run", run_files(valid_documents()))
    if (run_dir / directory).exists():
        for member in sorted((run_dir / directory).rglob("*"), reverse=True):
            member.rmdir() if member.is_dir() else member.unlink()
        (run_dir / directory).rmdir()
    (run_dir / directory).symlink_to(outside, target_is_directory=True)
    for command in (["report"], ["maps"], ["frames"]):
        code, out, err = cli(command[0], str(run_dir))
        assert code in (0, 2) and SECRET not in out + err, (command, out, err)
    code, out, err = cli("report", str(run_dir))
    assert f"{run_dir / directory}: a symbolic link, not followed" in out + err, (out, err)


# --- run-ups: a second launch into the same out dir keeps the first one's --------------------------------

WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"


@pytest.mark.slow
def test_a_second_launch_into_the_same_out_dir_keeps_the_first_launchs_run_up(tmp_path):
    job = TinyGPTJob(world_size=2, steps=3, quiet=True,
                     injections=(Injection(1, 3, WEIGHT, "nan", where="backward", index=5),))
    launch_many([job.with_(gradnan={"out_dir": str(tmp_path), "run_id": run_id}) for run_id in ("a", "b")])
    names = sorted(path.name for path in (tmp_path / RUNUP_DIR).iterdir())
    assert len(names) == 4 and len([name for name in names if ".launch" in name]) == 2, names
    runs = analyze(read_run(tmp_path)).to_json()["runs"]
    assert len(runs) == 2, runs
    for run in runs:
        report = analyze(read_run(tmp_path), run=run["run"]).to_json()
        assert report["incident"]["runup"] is not None and len(report["incident"]["runup"]["ranks"]) == 2, run


# --- the skip flag: the origin's own iteration, checked against every record of the step -----------------

def test_the_skip_flag_is_refused_when_the_ranks_disagree_on_the_iteration():
    steps, document, text = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=1207),
                                   _rerun(0, "after_collective", "node3", iteration=1300)])
    assert [(step.action.value, step.command) for step in steps] == [("skip_iteration", None)]
    assert "disagree on the failing iteration (1207, 1300)" in steps[0].text
    assert "--iterations-to-skip 1" not in text and document[0]["command"] is None


@pytest.mark.parametrize("iteration", [0, -5])
def test_the_skip_flag_is_refused_for_an_iteration_megatron_lm_never_counts(iteration):
    steps, _, text = _next([_rerun(1, "reproducible", "node3", module=CORE, iteration=iteration)])
    assert [(step.action.value, step.command) for step in steps] == [("skip_iteration", None)], text
    assert f"name iteration {iteration}, and Megatron-LM counts its iterations from 1" in steps[0].text
    assert "--iterations-to-skip" not in text


# --- gradnan batch: any tensor, any record, bounded work -------------------------------------------------

def _batch(tmp_path: Path, tensors) -> str:
    path = tmp_path / "mb0.pt"
    torch.save(tensors, path)
    code, out, err = cli("batch", str(path))
    assert code in (0, 2) and (code == 0 or err.count("\n") == 1), err
    return out if code == 0 else err


@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "quantized", "bool"])
def test_token_ids_in_a_layout_a_loader_never_yields_are_listed_not_read(tmp_path, kind):
    dense = torch.arange(12).view(3, 4)
    tokens = {"sparse": lambda: dense.to_sparse(), "sparse_csr": lambda: dense.to_sparse_csr(),
              "quantized": lambda: torch.quantize_per_tensor(dense.float(), 1.0, 0, torch.qint32),
              "bool": lambda: dense > 3}[kind]()
    out = _batch(tmp_path, {"tokens": tokens})
    assert "No 2-d integer tensor of token ids in it." in out or "refused" in out, out


def test_a_meta_tensor_in_a_batch_is_one_line_or_listed(tmp_path):
    out = _batch(tmp_path, {"tokens": torch.empty(2, 3, dtype=torch.long, device="meta")})
    assert "Token ids" not in out, out


def test_a_huge_row_shows_its_first_ids_only(tmp_path):
    out = _batch(tmp_path, {"tokens": torch.zeros(1, 20_000_000, dtype=torch.int8)})
    assert "sample 0: 0 0 0" in out and "... (19999936 more)" in out, out


def _kept_batch(tmp_path: Path, **rerun_changes) -> Path:
    """A run directory whose rerun record kept ``batches/<rank>/step0000001_mb0.pt``, with changes."""
    documents = valid_documents()
    run_dir = write_run(tmp_path / "run", run_files(documents))
    tag = rank_tag(coords(0))
    batch = run_dir / "batches" / tag / "step0000001_mb0.pt"
    batch.parent.mkdir(parents=True)
    torch.save({"tokens": torch.arange(8).view(2, 4)}, batch)
    record = dict(documents["pre_reduction"])
    record.update(kind="rerun", params=[], params_total=0, role="origin", observed=observed("reproducible"),
                  module="decoder", micro_batch=0, call=1, output_abs_max="nan", trigger="incident",
                  megatron=None, bundle=None, **{"class": "MLP"},
                  batch={"path": str(batch), "bytes": 64, "tensors": 1},
                  nonfinite_at={"output": 0, "index": [1, 0, 0], "shape": [4, 2, 8]})
    record.update(rerun_changes)
    with open(run_dir / "records" / f"{tag}.jsonl", "a") as stream:
        stream.write(json.dumps(record) + "\n")
    return batch


def test_the_kept_batch_marks_the_token_its_record_names(tmp_path):
    out = _batch_of(_kept_batch(tmp_path))
    assert "sample 0: 0 [1] 2 3" in out and "token position 1" in out, out


@pytest.mark.parametrize("changes", [
    {"nonfinite_at": {"output": 0, "index": [-3, 0, 0], "shape": [4, 2, 8]}},
    {"nonfinite_at": {"output": 0, "index": [9, 0, 0], "shape": [4, 2, 8]}},
    {"batch": {"path": "bat\x00ches/x.pt", "bytes": 1, "tensors": 1}},
    {"batch": {"path": "LOOP", "bytes": 1, "tensors": 1}},
])
def test_a_hostile_rerun_record_gives_the_batch_without_a_traceback(tmp_path, changes):
    if changes.get("batch", {}).get("path") == "LOOP":
        loop = tmp_path / "loop"
        loop.symlink_to(loop)
        changes = {"batch": {**changes["batch"], "path": str(loop / "x.pt")}}
    out = _batch_of(_kept_batch(tmp_path, **changes))
    assert "Token ids (tokens)" in out and "[" not in out.split("sample 0: ")[1].split("\n")[0], out


def _batch_of(path: Path) -> str:
    code, out, err = cli("batch", str(path))
    assert code == 0 and not err, err
    return out


def test_ids_a_tokenizer_cannot_decode_are_a_note_not_a_crash():
    def decode(ids):
        raise OverflowError("out of range integral type conversion attempted")

    assert _decoded(decode, [2**40]).startswith("not decoded (OverflowError")


# --- options: bounded, ASCII digits, one line ------------------------------------------------------------

@pytest.mark.parametrize("option, text", [
    ("--max-cpu-seconds", "1073712"), ("--max-cpu-seconds", "86401"), ("--max-cpu-seconds", "\u0663"),
    ("--max-cpu-seconds", "\u00b2"), ("--max-ops", "\u00b2"), ("--max-memory", "\u0663G"),
    ("--max-memory", "999999999999999T")])
def test_a_replay_limit_out_of_range_or_in_other_digits_is_one_line(tmp_path, option, text):
    assert_one_line(*cli("replay", str(tmp_path), option, text), option)


def test_the_replay_defaults_are_minutes_and_a_share_of_memory():
    from gradnan.offline.replay.limits import DEFAULT_MAX_CPU_SECONDS, default_max_memory

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert DEFAULT_MAX_CPU_SECONDS <= 600 and default_max_memory() <= memory // 4


# --- lists from a file: the first few and a count --------------------------------------------------------

def test_long_lists_from_a_file_are_bounded_in_the_text():
    source = {"index": 3, "dataset": "d", "documents": list(range(52_651)), "documents_total": 52_651,
              "offset": 0}
    samples = {"data_parallel_rank": 0, "data_parallel_size": 1, "consumed": 0, "indices": [3],
               "sources": [source]}
    assert len(samples_wording(samples, 0)) < 300
    values = {"xid_errors": list(range(13_600)), "throttle_reasons": ["x"] * 30_000,
              **{f"ecc_{n}": n for n in range(20_000)}}
    assert len(health_line(values, {f"k{n}": "no" for n in range(20_000)})) < 1000


def test_many_launches_in_one_directory_are_listed_first_few_and_counted(tmp_path):
    documents = valid_documents()
    files = run_files(documents)
    tag = rank_tag(coords(0))
    lines = [json.dumps({**documents["grad_norm"], "run": {**documents["grad_norm"]["run"], "id": f"job{n}"}})
             for n in range(200)]
    files[f"records/{tag}.jsonl"] += ("\n".join(lines) + "\n").encode()
    code, out, err = cli("report", str(write_run(tmp_path, files)))
    launches = next(line for line in out.split("\n") if line.startswith("Launches here:"))
    assert code == 0 and len(launches) < 1000 and "more (see --json)" in launches, launches


@pytest.mark.parametrize("argv", [["maps", "RUN", "--id", "\u0663"], ["frames", "RUN", "--step", "\u00b2"],
                                  ["frames", "RUN", "--iteration", "-1"], ["maps", "RUN", "--id", "1_0"]])
def test_a_number_option_takes_ascii_digits_only(tmp_path, argv):
    assert_one_line(*cli(*[str(tmp_path) if word == "RUN" else word for word in argv]), argv[2])


@pytest.mark.parametrize("value", ["\u0663", "1_000", "9" * 30])
def test_a_numeric_setting_from_the_environment_takes_ascii_digits_only(value):
    from gradnan.config import ConfigError
    from gradnan.config.sources import options_from_env

    with pytest.raises(ConfigError, match="not an integer"):
        options_from_env({"GRADNAN_RUNUP_STEPS": value})
