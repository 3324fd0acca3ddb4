"""The kit never hurts the run, loses nothing and overwrites nothing (real megatron-core, 2 processes)."""

from __future__ import annotations

import pytest

from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.toy import launch, launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

from .helpers import records_by_rank, step_trace

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

NAN_AT_2 = (Injection(1, 2, "decoder.layers.0.mlp.linear_fc1.weight", "nan", where="backward", index=3),)
JOB = TinyGPTJob(tp=2, dtype="bf16", steps=3, injections=NAN_AT_2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    not_a_directory = root / "a_file"
    not_a_directory.write_text("the out_dir cannot be created here\n")
    shared = root / "shared"
    jobs = [
        JOB,
        JOB.with_(gradnan={"out_dir": str(not_a_directory)}),
        JOB.with_(gradnan={"out_dir": str(shared), "run_id": "first"}),
        JOB.with_(gradnan={"out_dir": str(shared), "run_id": "second"}, injections=(
            Injection(0, 3, "decoder.layers.1.mlp.linear_fc2.weight", "inf", where="backward", index=1),)),
    ]
    return root, launch_many(jobs)


def test_an_unwritable_out_dir_changes_nothing_in_training(runs):
    root, (without, unwritable, *_) = runs
    assert step_trace(unwritable) == step_trace(without)
    assert (root / "a_file").read_text() == "the out_dir cannot be created here\n"


def test_restarts_into_one_directory_keep_both_launches(runs):
    root, _ = runs
    by_rank = records_by_rank(root / "shared")
    assert {r["run"]["id"] for records in by_rank.values() for r in records} == {"first", "second"}
    report = build_report(read_run(root / "shared"))
    assert [r["run"] for r in report["runs"]] == ["first#0", "second#0"]
    assert report["run"] == "second#0" and report["first_step"] == 3
    assert build_report(read_run(root / "shared"), run="first#0")["first_step"] == 2


def test_on_nonfinite_raise_stops_every_rank_after_the_record_is_on_disk(tmp_path):
    job = JOB.with_(gradnan={"out_dir": str(tmp_path), "on_nonfinite": "raise"})
    with pytest.raises(JobFailed) as failure:
        launch(job)
    assert failure.value.errors  # the launcher stops the peers once one rank raised: not all get to say so
    assert all(error.startswith("NonFiniteGradientError") for error in failure.value.errors.values())
    by_rank = records_by_rank(tmp_path)
    assert sorted(by_rank) == [0, 1]
    assert all(max(r["step"] for r in records) == 2 for records in by_rank.values())
    [norm] = [r for r in by_rank[1] if r["kind"] == "nonfinite_grad_norm"]
    assert [p["name"] for p in norm["params"]] == ["decoder.layers.0.mlp.linear_fc1.weight"]
