"""The ``gradnan`` command as a user runs it: the demo, report, maps, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from gradnan.testing.demo import DEMO_MODULE, DEMO_PARAM, DEMO_RANK, DEMO_STEP
from gradnan.testing.gloo import free_port

from .helpers import environ_without_gradnan, printed_commands, rerun_block
from .test_replay_against import (
    assert_each_operator_changed_alone_is_the_first_difference,
    compared,
    overflowed_operators,
)

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them


def gradnan(*args, cwd=None):
    command = [sys.executable, "-m", "gradnan", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    result = gradnan("demo", "--out", out)
    assert result.returncode == 0, result.stderr
    return out, result


def test_demo_names_the_module_rank_and_micro_batch_of_the_failing_step(demo):
    out, result = demo
    lines = result.stdout.split("gradnan report for ")[1].splitlines()
    assert lines[1].startswith(f"First failing step: {DEMO_STEP}")
    assert lines[2].startswith("Verdict: forward_op: ") and DEMO_MODULE in result.stdout.split("Origin (")[0]
    lines = rerun_block(result.stdout)
    assert lines[0] == (f"Forward origin (step {DEMO_STEP} run again in place): {DEMO_MODULE}"
                        " (DotProductAttention)")
    assert lines[1].startswith(f"  on rank {DEMO_RANK} (tp1 pp0 dp0)")
    assert lines[1].endswith("micro-batch 0: REPRODUCIBLE (same micro-batches, same RNG state)")
    assert lines[2] == "  received it from there (not origins): rank(s) 0"
    holders = result.stdout.split("Origin (")[1].split("Next:")[0]
    assert f"rank {DEMO_RANK} (tp1 pp0 dp0)" in holders and "rank 0 " not in holders
    assert str(out / "maps") in result.stdout and str(out / "records") in result.stdout


@pytest.mark.parametrize("malloc_perturb", [None, "165", "255"])
def test_the_demos_bundle_is_the_failing_step_and_replays_the_overflow(demo, malloc_perturb):
    """The same verdict whatever glibc's allocator hands out (``MALLOC_PERTURB_`` fills new and freed
    memory with a byte pattern): the replay's answer depends on no uninitialized memory."""
    out, result = demo
    command, bisect = printed_commands(result.stdout, "replay")  # the replay, then the same under two stacks
    assert bisect == [*command, "--against", "OLD_STACK/bin/python", "--against", "NEW_STACK/bin/python"]
    assert command[:2] == ["gradnan", "replay"] and f"step{DEMO_STEP:07d}_{DEMO_MODULE}" in command[2]
    environment = environ_without_gradnan()
    if malloc_perturb:
        environment["MALLOC_PERTURB_"] = malloc_perturb
    replayed = subprocess.run([sys.executable, "-m", "gradnan", "replay", command[2]], capture_output=True,
                              text=True, timeout=300, env=environment)
    assert replayed.returncode == 0, replayed.stderr
    assert "Verdict: precision" in replayed.stdout and "aten.baddbmm" in replayed.stdout


def test_report_json_names_the_module_and_the_receiver(demo):
    out, _ = demo
    result = gradnan("report", out, "--json")
    incident = json.loads(result.stdout)["incident"]
    assert [origin["global_rank"] for origin in incident["origin"]] == [DEMO_RANK]
    assert [r["global_rank"] for r in incident["receivers"]] == [0]
    assert incident["origin_basis"] == "rerun"
    rerun = incident["rerun"]
    assert (rerun["module"], rerun["global_rank"], rerun["micro_batch"], rerun["conclusion"]) == (
        DEMO_MODULE, DEMO_RANK, 0, "reproducible")


def test_maps_resolves_the_reported_id(demo):
    out, _ = demo
    report = json.loads(gradnan("report", out, "--json").stdout)
    reported = next(p for p in report["incident"]["origin"][0]["params"] if p["name"] == DEMO_PARAM)
    for rank in (str(DEMO_RANK), "tp1,pp0,dp0"):
        result = gradnan("maps", out, "--rank", rank, "--id", reported["id"])
        assert result.returncode == 0
        assert result.stdout.strip().endswith(f"{DEMO_PARAM} [48, 32] torch.bfloat16")


def test_demo_refuses_to_write_into_an_existing_run(demo):
    out, _ = demo
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    result = gradnan("demo", "--out", out)
    assert result.returncode == 2
    assert "already holds a gradnan run" in result.stderr
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("args, message", [
    (("report", "/nonexistent/run"), "no such directory"),
    (("report",), "required: run_dir"),
    (("maps", "{empty}"), "no gradnan maps or records"),
    (("maps", "{demo}", "--rank", "7"), "no map for rank '7'"),
    (("maps", "{demo}", "--id", "99999"), "no parameter with id 99999"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_input_gets_one_line_and_exit_2(demo, tmp_path, args, message):
    out, _ = demo
    args = [str(a).format(demo=out, empty=tmp_path) for a in args]
    result = gradnan(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr
    assert "error: gradnan" not in result.stderr  # one prefix, not two


def test_a_bad_environment_variable_stops_the_demo_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_PRE_REDUCTION", "sometimes")
    result = gradnan("demo", "--out", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "pre_reduction" in result.stderr
    assert not (tmp_path / "run").exists()


def test_report_lists_a_corrupt_rank_file_and_still_reports_the_others(demo, tmp_path):
    out, _ = demo
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    damaged = copy / "records" / "rank00000_tp0_pp0_dp0.jsonl"
    damaged.write_text(damaged.read_text()[:-40])
    result = gradnan("report", copy)
    assert result.returncode == 0
    assert f"rank {DEMO_RANK} (tp1 pp0 dp0)" in result.stdout
    assert "truncated last line" in result.stdout


def test_selftest_result_written_into_a_run_shows_in_its_report(demo, tmp_path):
    """The documented workflow: a suspect device -> `gradnan selftest --out RUN_DIR` -> `gradnan report`."""

    out, _ = demo
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    port, env = free_port(), environ_without_gradnan()
    ranks = [subprocess.Popen([sys.executable, "-m", "gradnan", "selftest", "--size", "32", "--repeats", "1",
                               "--timeout", "60", "--out", str(copy)],
                              env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    assert [process.wait(timeout=240) for process in ranks] == [0, 0]
    result = gradnan("report", copy)
    assert "Self-test " in result.stdout and ": PASS" in result.stdout
    assert "passed on all 2 ranks" in result.stdout


def test_report_plot_draws_the_origin_rank(demo, tmp_path):
    from gradnan.offline.incident.analysis import analyze
    from gradnan.offline.incident.plot import plot_incident
    from gradnan.offline.incident.plot_grid import ORIGIN, RECEIVED
    from gradnan.offline.incident.read import read_run

    out, _ = demo
    picture = tmp_path / "incident.png"
    result = gradnan("report", out, "--plot", picture)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plot_incident(analyze(read_run(out)), tmp_path / "again.svg")
    assert (tmp_path / "again.svg").read_text().lstrip().startswith("<?xml")
    assert drawn["states"] == {DEMO_RANK: ORIGIN, 0: RECEIVED}
    assert drawn["layout"].places[DEMO_RANK] == (0, 0, 0, 1), "tp1 of the one pp/dp cell"


def test_plot_without_matplotlib_is_one_clear_line(demo, tmp_path, monkeypatch, capsys):
    from gradnan.cli import main

    out, _ = demo
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["report", str(out), "--plot", str(tmp_path / "x.png")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install 'gradnan[plot]'" in error
    assert not (tmp_path / "x.png").exists()


def test_a_wrong_call_is_a_usage_error_and_a_bad_file_an_input_error(tmp_path, monkeypatch):
    """Whose fault it is shows in the error class (same exit code 2): an option or call is the user's to
    fix (UsageError), a file or directory is unusable input (InputError)."""
    import sys

    from gradnan.errors import InputError, UsageError
    from gradnan.offline.incident.analysis import analyze
    from gradnan.offline.incident.plot import plot_incident
    from gradnan.offline.incident.read import RunFiles
    from gradnan.testing.demo import run_demo

    (tmp_path / "maps").mkdir()
    with pytest.raises(UsageError, match="already holds a gradnan run"):
        run_demo(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match="--plot needs matplotlib"):
        plot_incident(analyze(RunFiles(tmp_path)), tmp_path / "x.png")
    with pytest.raises(InputError, match="not a bundle directory"):
        from gradnan.offline.replay.command import replay_bundle

        replay_bundle(tmp_path / "no-bundle")


def test_the_demos_bundle_against_each_of_its_operators_changed_alone(demo, changed):
    """The demo's attention bundle (the failing step run again in place: the memory buffer is a leaf, its
    scores overflow): against the interpreter that captured it nothing differs, and each distinct operator
    it calls, changed alone, is the first difference (tests/test_replay_against.py)."""
    out, _ = demo
    (bundle,) = (out / "bundles").glob(f"*/step{DEMO_STEP:07d}_{DEMO_MODULE}")
    same = compared(bundle, "--against", sys.executable)
    assert same["first_difference"] is None and not any(op["uninitialized"] for op in same["operators"])
    assert same["environments"][1]["first_nonfinite"] is not None  # the overflow, replayed
    # its attention scores are Inf everywhere (the planted overflow): scaled, they are still Inf; what
    # comes after them may be NaN everywhere too, as this machine's bf16 kernels have it (issue 64)
    overflowed = overflowed_operators(bundle)
    assert "aten.baddbmm.default" in overflowed and len(overflowed) < len(same["operators"])
    assert_each_operator_changed_alone_is_the_first_difference(bundle, changed, unseen=overflowed)
