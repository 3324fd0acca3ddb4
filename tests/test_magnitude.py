"""Issue 23, case 5, on real megatron-core (gloo, 2 processes): a module whose output jumps from a few
units to 3.9e28 (finite in bf16) is named as where the value grew out of line, next to the LayerNorm
where it went non-finite, in the rerun record, its log line, the report's headline, verdict and --json,
and the replay of the bundle blames the growth upstream rather than the operator that overflowed.
Healthy bf16, fp16 and fp32 steps, every frame traced, flag no growth."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gradnan.formats.magnitude import first_grown_frame
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.offline.replay.command import replay_bundle
from gradnan.offline.replay.text import format_text as replay_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank, rerun_block

pytestmark = pytest.mark.slow  # real gloo jobs: `pytest -m "not slow"` skips them

GROWN = "decoder.layers.0.mlp"
NONFINITE = "decoder.layers.1.input_layernorm"
BASE = TinyGPTJob(world_size=2, steps=3, micro_batches=2, quiet=True)
PLANTED = BASE.with_(dtype="bf16", injections=(Injection(1, 2, GROWN, "3.9e28", where="forward"),))
HEALTHY = {dtype: BASE.with_(dtype=dtype) for dtype in ("bf16", "fp16", "fp32")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("magnitude")
    jobs = [PLANTED.with_(gradnan={"out_dir": str(root / "planted")})]
    jobs += [job.with_(gradnan={"out_dir": str(root / dtype), "frames": "trace", "trace_steps": "1-3"})
             for dtype, job in HEALTHY.items()]
    launch_many(jobs)
    return root


def rerun_of(run_dir: Path, rank: int):
    [record] = [r for r in records_by_rank(run_dir)[rank] if r["kind"] == "rerun"]
    return record


def test_the_rerun_names_where_the_value_grew_next_to_where_it_went_nonfinite(runs):
    record = rerun_of(runs / "planted", 1)
    assert (record["role"], record["module"], record["class"]) == ("origin", NONFINITE, "LayerNorm")
    grew_in = record["grew_in"]
    assert (grew_in["module"], grew_in["class"], grew_in["micro_batch"]) == (GROWN, "MLP", 0)
    assert grew_in["output_abs_max"] == pytest.approx(3.9e28, rel=0.01)
    assert grew_in["dtype"] == "torch.bfloat16"
    assert 1 < grew_in["inputs_abs_max"] < 10 and not grew_in["near_limit"]
    assert grew_in["call"] < record["call"]
    assert rerun_of(runs / "planted", 0).get("grew_in") is None  # the other replica was clean


def test_the_headline_verdict_and_json_name_the_culprit_and_where_it_went_nonfinite(runs):
    report = analyze(read_run(runs / "planted"))
    lines = rerun_block(format_text(report))
    assert lines[0] == (f"Forward origin (step 2 run again in place): {GROWN} (MLP) grew a value to 3.9e28"
                        f" (from {lines[0].split('(from ')[1].split(')')[0]}), which went non-finite in"
                        f" {NONFINITE} (LayerNorm)")
    incident = report.to_json()["incident"]
    assert incident["rerun"]["module"] == NONFINITE
    assert (incident["rerun"]["grew_in"]["module"], incident["rerun"]["grew_in"]["global_rank"]) == (GROWN, 1)
    summary = incident["verdict"]["summary"]
    assert f"in {NONFINITE}, after {GROWN} (MLP) grew a value out of line" in summary


def test_the_log_line_says_where_it_grew_then_where_it_went_nonfinite(runs, caplog):
    """The rank's log line, as the rerun logs it from its record."""
    from gradnan.training.rerun import StepRerun

    record = rerun_of(runs / "planted", 1)
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        StepRerun.log(record)
    assert (f"values first grew out of line in {GROWN} (MLP) (" in caplog.text
            and f"-> 3.9e28), then went non-finite in {NONFINITE} (LayerNorm) on rank 1" in caplog.text)


def test_the_replay_says_the_inputs_were_already_out_of_line_and_names_the_growth(runs):
    record = rerun_of(runs / "planted", 1)
    manifest = json.loads((Path(record["bundle"]) / "manifest.json").read_text())
    assert manifest["grew_in"]["module"] == GROWN
    result = replay_bundle(Path(record["bundle"]), device="cpu")
    assert result["verdict"] == "inputs_out_of_line" and result["reproduces"]
    assert result["growth"]["where"] == "upstream" and result["growth"]["module"] == GROWN
    assert result["runs"]["captured"]["first_nonfinite"]["op"] == "aten.native_layer_norm.default"
    verdict = replay_text(result).splitlines()[2]
    assert verdict.startswith("Verdict: inputs_out_of_line: the module's inputs were already out of line"
                              " (args.0 abs-max 3.9e28): the value grew before this module, in"
                              f" {GROWN} (MLP) (")
    assert "went non-finite here at aten.native_layer_norm.default (forward)" in verdict


@pytest.mark.parametrize("dtype", sorted(HEALTHY))
def test_a_healthy_step_flags_no_growth_in_any_traced_frame(runs, dtype):
    frames = [r for records in records_by_rank(runs / dtype).values() for r in records
              if r["kind"] == "frames"]
    assert len(frames) == 6  # 3 steps on 2 ranks
    assert all(record["first_nonfinite"] is None for record in frames)
    assert all(first_grown_frame(record["frames"]) is None for record in frames)
    assert analyze(read_run(runs / dtype)).incident is None
