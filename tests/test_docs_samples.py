"""Issue 37: the sample outputs in the docs are the program's own. Each block marked
``<!-- sample: NAME -->`` in docs/ is produced here by running what the text before it says, on real
megatron-core, and compared whole (the run directory and the host name put back as the docs print them).
A stderr block holds lines whose order varies between runs: its lines are compared as a set.
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

pytestmark = pytest.mark.slow

DOCS = Path(__file__).parents[1] / "docs"
MARK = re.compile(r"<!-- sample: ([a-z0-9-]+) -->\n```text\n(.*?)```\n", re.DOTALL)


def _blocks():
    found = {}
    for page in sorted(DOCS.glob("*.md")):
        for match in MARK.finditer(page.read_text()):
            found[match.group(1)] = (page, match.group(2))
    return found


def _normalized(text: str, run_dir: Path, shown: str) -> str:
    host = socket.gethostname()
    text = text.replace(str(run_dir), shown)
    return re.sub(rf"\b{re.escape(host)} (cpu|cuda)", r"vm \1", text) if host != "vm" else text


def _check(name: str, produced: str, unordered: bool = False) -> None:
    page, documented = _blocks()[name]
    same = (sorted(documented.splitlines()) == sorted(produced.splitlines()) if unordered
            else documented == produced)
    if os.environ.get("DOCS_WRITE") == "1" and not same:
        page.write_text(page.read_text().replace(f"<!-- sample: {name} -->\n```text\n{documented}```",
                                                 f"<!-- sample: {name} -->\n```text\n{produced}```"))
        return
    assert same, f"{page.name}: the sample {name!r} drifted from the program's output"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "docs_demo"
    run = subprocess.run([sys.executable, "-m", "gradnan", "demo", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    gradnan_lines = "".join(line + "\n" for line in run.stderr.splitlines() if line.startswith("[gradnan"))
    return _normalized(run.stdout, out, "/tmp/docs_demo"), _normalized(gradnan_lines, out, "/tmp/docs_demo")


def test_every_marked_block_is_produced_here():
    assert set(_blocks()) == {"demo-stdout", "demo-stderr", "demo-report", "dp-example"}


def test_the_quickstart_demo_output_is_the_programs(demo):
    _check("demo-stdout", demo[0])


def test_the_cli_pages_demo_report_is_the_programs(demo):
    report = demo[0][demo[0].index("gradnan report for "):demo[0].index("\n\nMaps:")]
    _check("demo-report", report + "\n")


def test_the_quickstart_demo_log_lines_are_the_programs(demo):
    _check("demo-stderr", demo[1], unordered=True)


def test_the_data_parallel_example_in_how_it_works_is_the_programs(tmp_path):
    """DP=2 x TP=2, bf16, a NaN in element 5 of one weight's gradient on rank 3 in backward at step 2."""
    out = tmp_path / "docs_dp_example"
    launch(TinyGPTJob(world_size=4, tp=2, dtype="bf16", quiet=True, gradnan={"out_dir": str(out)},
                      injections=(Injection(3, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan",
                                            where="backward", index=5),)))
    _check("dp-example", _normalized(format_text(analyze(read_run(out))) + "\n", out, "/tmp/docs_dp_example"))
