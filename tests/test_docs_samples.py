"""Issues 37 and 52: the sample outputs in the docs are the program's own. Each block marked
``<!-- sample: NAME -->`` in README.md or docs/ is produced here by running what the text before it says, on
real megatron-core, and compared whole (the run directory and the host name put back as the docs print
them; a block inside a list item is compared without its indentation). A stderr block holds lines whose
order varies between runs: its lines are compared as a set. Two runs serve every sample: the demo and the
quickstart's ``--inject-nan`` example (tests/test_docs_blocks.py checks the blocks that are not samples).
``DOCS_WRITE=1 pytest tests/test_docs_samples.py`` rewrites the blocks from a run instead."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import environ_without_gradnan

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^(?P<indent> *)<!-- sample: (?P<name>[a-z0-9-]+) -->\n(?P=indent)```(?P<lang>text|json)\n"
                  r"(?P<body>.*?)^(?P=indent)```\n", re.DOTALL | re.MULTILINE)
SAMPLES = {"cli-usage", "demo-stdout", "demo-stderr", "demo-report", "demo-replay-verdict", "dp-example",
           "example-stdout", "example-stderr", "example-report", "example-replay", "example-maps",
           "capture-stderr", "capture-report", "capture-replay", "capture-replay-json"}


def _dedented(body: str, indent: str) -> str:
    return "".join(line[len(indent):] + "\n" if line.startswith(indent) else line + "\n"
                   for line in body.splitlines())


def _blocks():
    """{name: [(page, the block's text as the program prints it, the match)]}: a sample may be shown on
    several pages."""
    found: dict = {}
    for page in PAGES:
        for match in MARK.finditer(page.read_text()):
            found.setdefault(match.group("name"), []).append(
                (page, _dedented(match.group("body"), match.group("indent")), match))
    return found


def _normalized(text: str, run_dir: Path, shown: str) -> str:
    host = socket.gethostname()
    text = text.replace(str(run_dir), shown)
    return re.sub(rf"\b{re.escape(host)} (cpu|cuda)", r"vm \1", text) if host != "vm" else text


def _check(name: str, produced: str, unordered: bool = False) -> None:
    for page, documented, match in _blocks()[name]:
        same = (sorted(documented.splitlines()) == sorted(produced.splitlines()) if unordered
                else documented == produced)
        if os.environ.get("DOCS_WRITE") == "1" and not same:
            indent = match.group("indent")
            indented = "".join(indent + line + "\n" if line else "\n" for line in produced.splitlines())
            fence = f"{indent}```{match.group('lang')}\n"
            page.write_text(page.read_text().replace(
                match.group(0), f"{indent}<!-- sample: {name} -->\n{fence}{indented}{indent}```\n"))
        else:
            assert same, f"{page.name}: the sample {name!r} drifted from the program's output"


def _gradnan(*argv: str) -> str:
    """What the ``gradnan`` console script prints on stdout for ``argv`` (it must succeed)."""
    run = subprocess.run([sys.executable, "-m", "gradnan", *argv], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _gradnan_lines(stderr: str) -> str:
    """gradnan's log lines in a process's stderr, with the indented lines that continue them (install's
    summary), less torchrun's banner and megatron-core's warnings."""
    kept, inside = [], False
    for line in stderr.splitlines():
        inside = line.startswith("[gradnan") or (inside and line.startswith("  "))
        if inside:
            kept.append(line + "\n")
    return "".join(kept)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "docs_demo"
    run = subprocess.run([sys.executable, "-m", "gradnan", "demo", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    gradnan_lines = "".join(line + "\n" for line in run.stderr.splitlines() if line.startswith("[gradnan"))
    bundle = re.search(r"replay it: gradnan replay (\S+)\)", run.stderr).group(1)
    return (_normalized(run.stdout, out, "/tmp/docs_demo"), _normalized(gradnan_lines, out, "/tmp/docs_demo"),
            _gradnan("replay", bundle))


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The quickstart's example: its unmodified Megatron-Core script under ``torchrun -m gradnan.run``, a NaN
    put into one gradient on rank 1 at step 2; then what the quickstart runs on it: {part: text} of stdout,
    stderr's gradnan lines, report, replay and maps, as the quickstart prints them."""
    out = tmp_path_factory.mktemp("example") / "gradnan_example"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "-m", "gradnan.run", "examples/train_gpt_megatron_core.py", "--tp", "2",
                          "--inject-nan", "1:2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**environ_without_gradnan(), "GRADNAN_OUT_DIR": str(out)})
    assert run.returncode == 0, run.stderr
    [bundle] = (out / "bundles").glob("*/*")
    return {name: _normalized(text, out, "/tmp/gradnan_example") for name, text in (
        ("stdout", run.stdout), ("stderr", _gradnan_lines(run.stderr)),
        ("report", format_text(analyze(read_run(out))) + "\n"), ("replay", _gradnan("replay", str(bundle))),
        ("maps", _gradnan("maps", str(out), "--rank", "1", "--id", "4")))}


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """capture-replay.md's fp16 example, its own Python block run as the page says, then the report and
    the replay of its bundle: {part: text} as the page prints them."""
    out = tmp_path_factory.mktemp("capture") / "docs_capture"
    page = (ROOT / "docs" / "capture-replay.md").read_text()
    [script] = [block for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL)
                if "/tmp/docs_capture" in block]
    run = subprocess.run([sys.executable, "-c", script.replace("/tmp/docs_capture", str(out))],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=environ_without_gradnan())
    assert run.returncode == 0, run.stderr
    [bundle] = (out / "bundles").glob("*/*")
    shown = bundle.relative_to(out.parent)
    return {name: _normalized(text, out, "/tmp/docs_capture") for name, text in (
        ("stderr", _gradnan_lines(run.stderr)),
        ("report", f"$ gradnan report {out}\n{format_text(analyze(read_run(out)))}\n"),
        ("replay", f"$ gradnan replay /tmp/{shown}\n{_gradnan('replay', str(bundle))}"),
        ("replay-json", _gradnan("replay", "--json", str(bundle))))}


def test_every_marked_block_is_produced_here():
    assert set(_blocks()) == SAMPLES


def test_the_quickstart_demo_output_is_the_programs(demo):
    _check("demo-stdout", demo[0])


def test_the_cli_pages_demo_report_is_the_programs(demo):
    report = demo[0][demo[0].index("gradnan report for "):demo[0].index("\n\nMaps:")]
    _check("demo-report", report + "\n")


def test_the_quickstart_demo_log_lines_are_the_programs(demo):
    _check("demo-stderr", demo[1], unordered=True)


def test_the_quickstart_demo_replay_verdict_is_the_programs(demo):
    [verdict] = [line for line in demo[2].splitlines() if line.startswith("Verdict: ")]
    _check("demo-replay-verdict", verdict + "\n")


@pytest.mark.parametrize("part", ["stdout", "stderr", "report", "replay", "maps"])
def test_the_quickstart_example_is_the_programs(example, part):
    _check(f"example-{part}", example[part], unordered=part == "stderr")


def test_the_data_parallel_example_in_how_it_works_is_the_programs(tmp_path):
    """DP=2 x TP=2, bf16, a NaN in element 5 of one weight's gradient on rank 3 in backward at step 2."""
    out = tmp_path / "docs_dp_example"
    launch(TinyGPTJob(world_size=4, tp=2, dtype="bf16", quiet=True, gradnan={"out_dir": str(out)},
                      injections=(Injection(3, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan",
                                            where="backward", index=5),)))
    _check("dp-example", _normalized(format_text(analyze(read_run(out))) + "\n", out, "/tmp/docs_dp_example"))


@pytest.mark.parametrize("part", ["stderr", "report", "replay", "replay-json"])
def test_the_capture_example_is_the_programs(capture, part):
    _check(f"capture-{part}", capture[part], unordered=part == "stderr")
