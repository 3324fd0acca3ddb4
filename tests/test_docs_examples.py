"""The examples in docs/parity.md run and say what the page says they say."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradnan.config.sources import options_from_env, options_from_file, resolve_config

PAGE = Path(__file__).resolve().parent.parent / "docs" / "parity.md"


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _blocks(section: str, language: str):
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_worked_example_is_one_configuration_four_ways(tmp_path):
    section = _section("## Worked example")
    [as_json], [as_toml], [as_kwargs] = (_blocks(section, "json"), _blocks(section, "toml"),
                                         _blocks(section, "python"))
    as_env = _blocks(section, "bash")[1]
    (tmp_path / "gradnan.json").write_text(as_json)
    (tmp_path / "gradnan.toml").write_text(as_toml)
    environ = dict(re.findall(r"(GRADNAN_\w+)=('[^']*'|\S+)", as_env))
    environ = {key: value.strip("'") for key, value in environ.items()}
    [call] = [node for node in ast.walk(ast.parse(as_kwargs)) if isinstance(node, ast.Call)]
    kwargs = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    configs = [resolve_config(environ={}, config_file=str(tmp_path / "gradnan.json")),
               resolve_config(environ={}, config_file=str(tmp_path / "gradnan.toml")),
               resolve_config(environ=environ),
               resolve_config(environ={}, **kwargs)]
    assert configs[0] == configs[1] == configs[2] == configs[3]
    assert configs[0].trace_steps == "1,3" and configs[0].abort_after_step == 3 and configs[0].ranks == "0-3"
    assert options_from_env(environ) == options_from_file(str(tmp_path / "gradnan.json"))


def _normalized(lines):
    """Paths and the host name differ from machine to machine."""
    return [re.sub(r"\(tp0 pp0 dp0, [^ ]+ cpu\)", "(tp0 pp0 dp0, HOST cpu)",
                   re.sub(r"/\S+/run\b", "RUN", line))
            for line in lines]


@pytest.mark.slow
def test_the_custom_loop_example_logs_and_reports_what_the_page_shows(tmp_path):
    section = _section("## A custom training loop")
    [script] = _blocks(section, "python")
    logged, reported = _blocks(section, "text")
    script = script.replace("/tmp/gdoc/run", str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    output = [line for line in (done.stderr + done.stdout).splitlines()
              if line.startswith("[gradnan rank 0] ERROR") or line.startswith("gradnan: stopping")]
    assert _normalized(output) == _normalized(logged.strip().splitlines())
    report = subprocess.run([sys.executable, "-m", "gradnan", "report", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=300)
    tail = report.stdout.strip().splitlines()[-len(reported.strip().splitlines()):]
    assert _normalized(tail) == _normalized(reported.strip().splitlines())
