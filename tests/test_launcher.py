"""Zero-edit launch: torchrun starts an unmodified Megatron-Core training script through gradnan.run;
the maps and records appear, configured by GRADNAN_* variables or flags alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.gloo import free_port

from .helpers import environ_without_gradnan

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt_megatron_core.py"


def _torchrun(*args, env=None):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "-m", "gradnan.run", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**environ_without_gradnan(), "PYTHONWARNINGS": "ignore", **(env or {})})


def test_torchrun_launches_an_unmodified_script_with_the_kit_from_the_environment(tmp_path):
    assert "gradnan" not in SCRIPT.read_text().split('"""', 2)[2].replace("gradnan.testing.cpu_shim", "")
    result = _torchrun(SCRIPT, "--tp", "2", "--inject-nan", "1:2", env={"GRADNAN_OUT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3:" in result.stdout
    files = read_run(tmp_path)
    assert len(files.maps) == 2 and not files.problems
    report = build_report(files)
    assert [e["global_rank"] for e in report["incident"]["origin"]] == [1]
    assert (report["incident"]["parameters"][0]["params"][0]["name"]
            == "decoder.layers.0.mlp.linear_fc1.weight")


def test_flags_before_the_script_configure_the_kit(tmp_path):
    result = _torchrun("--out-dir", tmp_path / "flags", "--pre-reduction", "off", SCRIPT, "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_run(tmp_path / "flags").maps) == 2


def test_a_bad_option_stops_before_training_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gradnan.run", "--pre-reduction", "sometimes",
                             str(SCRIPT)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "pre_reduction" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag", "1", "train.py"], "unrecognized arguments"),
    ([], "give the training script"),
    (["/nonexistent/train.py"], "no such script"),
    (["-m", "nonexistent_module"], "-m nonexistent_module: no such module"),
    (["-m", "nonexistent_package.train"], "-m nonexistent_package.train: no such module"),
])
def test_launcher_usage_errors_are_one_line_before_anything_is_installed(args, message):
    result = subprocess.run([sys.executable, "-m", "gradnan.run", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "gradnan installed" not in result.stderr


def _launch_script(tmp_path, source, *flags):
    """``python -m gradnan.run`` on a script holding ``source``; the script's path and the result."""
    script = tmp_path / "train.py"
    script.write_text(source)
    command = [sys.executable, "-m", "gradnan.run", "--out-dir", str(tmp_path / "out"), *flags, str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=environ_without_gradnan())
    return script, result


def test_a_failing_script_is_reported_as_the_scripts_error_without_the_launchers_frames(tmp_path):
    script, result = _launch_script(tmp_path, "def load_batch():\n"
                                              "    raise ValueError('shard 7 is truncated')\n\n"
                                              "load_batch()\n")
    assert result.returncode == 1
    *trace, last = result.stderr.strip().splitlines()
    assert last == (f"gradnan.run: the training script {script} failed (ValueError: shard 7 is truncated);"
                    " the error is the script's own, gradnan only ran it."
                    f" gradnan's files: {tmp_path / 'out'}")
    assert "in load_batch" in result.stderr and "ValueError: shard 7 is truncated" in trace
    assert "gradnan/run.py" not in result.stderr and "runpy" not in result.stderr


def test_a_stop_the_kit_was_asked_for_is_named_as_such(tmp_path):
    script, result = _launch_script(tmp_path, "import gradnan\n"
                                              "raise gradnan.AbortRequested('abort_after_step=3 reached')\n")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"gradnan.run: gradnan stopped {script} as configured: abort_after_step=3 reached")


def test_patches_are_disabled_by_name_from_the_command_line(tmp_path):
    show = "import gradnan\nprint(gradnan.current().disabled)\n"
    _, result = _launch_script(tmp_path, show, "--disabled-patches", "schedules,module_hooks")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['schedules', 'module_hooks']"
    _, result = _launch_script(tmp_path, show, "--disabled-patches", "schedule")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "names no patch: schedule (valid: param_groups, " in result.stderr


RESTARTED = """import json, sys
from gradnan.training.install import current
installed = current()
print(json.dumps({"argv": sys.argv[1:], "out_dir": installed and installed.out_dir,
                  "pre_reduction": installed and installed.config.pre_reduction.value}))
"""


def test_a_script_that_restarts_python_on_a_script_keeps_gradnan_and_its_options(tmp_path):
    """Issue 58: Megatron-Bridge's benchmark recipes re-exec the interpreter on the script
    (``os.execvpe(sys.executable, [sys.executable, script, *argv], env)``): the new process ran without
    gradnan and nothing said so. It now runs under ``-m gradnan.run`` with the launcher's own options."""
    (tmp_path / "restarted.py").write_text(RESTARTED)
    (tmp_path / "recipe.py").write_text(
        "import os, sys\n"
        "os.execvpe(sys.executable, [sys.executable, os.path.join(os.path.dirname(__file__), 'restarted.py'),"
        " 'a', '--b'], dict(os.environ))\n")
    result = subprocess.run([sys.executable, "-m", "gradnan.run", "--out-dir", str(tmp_path / "out"),
                             "--pre-reduction", "sync", str(tmp_path / "recipe.py")],
                            capture_output=True, text=True, timeout=120, env=environ_without_gradnan())
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "argv": ["a", "--b"], "out_dir": str(tmp_path / "out"), "pre_reduction": "sync"}
    assert "the script restarts Python on " in result.stderr and "gradnan goes with it" in result.stderr


def test_a_script_that_replaces_itself_with_another_program_is_told_gradnan_does_not_follow(tmp_path):
    (tmp_path / "script.py").write_text("import os\nos.execvp('echo', ['echo', 'replaced'])\n")
    result = subprocess.run([sys.executable, "-m", "gradnan.run", "--out-dir", str(tmp_path / "out"),
                             str(tmp_path / "script.py")],
                            capture_output=True, text=True, timeout=120, env=environ_without_gradnan())
    assert result.returncode == 0 and result.stdout == "replaced\n", result.stderr[-3000:]
    assert "replaces this process with echo replaced: gradnan does not run in it" in result.stderr
