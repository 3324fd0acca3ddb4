"""start/stop/step in a hand-written loop records only the window asked for (real megatron-core, 2 gloo
processes), and ``start(model=...)`` serves a loop whose optimizer is not Megatron's (in-process).

The Megatron loops run fp16 with data parallelism 2: a NaN put into rank 1's main gradient makes that rank's
loss scaler skip the step (a ``loss_scale_overflow`` record) without spreading to rank 0 or to later steps,
so every step of the loop has exactly one record on rank 1 when recording is on. Each record's
``consecutive_skips`` is the count of optimizer steps so far (all skipped): it tells which optimizer step
wrote the record, whatever ``step`` the record carries.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import gradnan
from gradnan.offline.incident.read import read_run
from gradnan.testing.gloo import free_port, gloo_process, one_job
from gradnan.testing.toy import TinyGPT
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import gradnan_variables_cleared, records_by_rank

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

TARGET = "decoder.layers.1.mlp.linear_fc1.weight"
EVERY_STEP_ON_RANK_1 = tuple(Injection(1, step, TARGET, "nan", where="main_grad") for step in range(1, 7))
JOB = TinyGPTJob(dtype="fp16", steps=6, injections=EVERY_STEP_ON_RANK_1, quiet=True)


def _build(job: TinyGPTJob, rank: int, out_dir: Path, **options):
    """The toy model with gradnan installed where a user would install it; returns (model, installation)."""
    installed = []
    model = TinyGPT(job, rank,
                    install=lambda: installed.append(gradnan.install(out_dir=str(out_dir), strict=True,
                                                                     **options)))
    return model, installed[0]


def _window(rank: int, out_dir: Path) -> None:
    """stop() before step 1, start() before step 3, stop() after step 4, step() after every step."""
    model, handle = _build(JOB, rank, out_dir)
    for step in range(1, 7):
        if step == 1:
            handle.stop()
        if step == 3:
            handle.start()
        model.step()
        if step == 4:
            handle.stop()
        handle.step()


def _steps_filter(rank: int, out_dir: Path) -> None:
    """steps="2,5" in the config, no start/stop/step: the optimizer's count selects."""
    model, _ = _build(JOB, rank, out_dir, steps="2,5")
    for _ in range(6):
        model.step()


def _ranks_filter(rank: int, out_dir: Path) -> None:
    """ranks="1" with a NaN on both ranks at step 2."""
    both = tuple(Injection(r, 2, TARGET, "nan", where="main_grad") for r in (0, 1))
    model, _ = _build(JOB.with_(steps=3, injections=both), rank, out_dir, ranks="1")
    for _ in range(3):
        model.step()


def _micro_batches(rank: int, out_dir: Path) -> None:
    """step() twice per optimizer step, as a loop counting micro-batches: step() ends micro-batch 1, the
    optimizer steps at the end of micro-batch 2, then step() ends it."""
    model, handle = _build(JOB.with_(steps=3), rank, out_dir)
    for _ in range(3):
        handle.step()
        model.step()
        handle.step()


LOOPS = {"window": _window, "steps_filter": _steps_filter, "ranks_filter": _ranks_filter,
         "micro_batches": _micro_batches}


def _worker(rank: int, port: int, root: str) -> None:
    """gradnan.testing.toy._worker's pattern: one gloo group, then each hand-written loop in turn."""
    with gloo_process(rank, 2, port):
        for name, loop in LOOPS.items():
            with one_job():
                loop(rank, Path(root) / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("control")
    with gradnan_variables_cleared():  # only what each loop passes to install()
        mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root


def _steps_by_rank(run_dir: Path):
    return {rank: sorted(record["step"] for record in records)
            for rank, records in records_by_rank(run_dir).items()}


def test_without_control_every_step_of_the_loop_records_on_rank_1(runs):
    """The micro-batch loop's three optimizer steps each wrote one overflow record on rank 1: the loops
    below record every step unless told otherwise."""
    records = records_by_rank(runs / "micro_batches")
    assert sorted(records) == [1]
    assert [r["kind"] for r in records[1]] == ["loss_scale_overflow"] * 3
    assert [r["consecutive_skips"] for r in records[1]] == [1, 2, 3]
    assert all([p["name"] for p in r["params"]] == [TARGET] for r in records[1])


def test_start_and_stop_record_only_the_optimizer_steps_inside_the_window(runs):
    records = records_by_rank(runs / "window")
    assert sorted(records) == [1], "rank 0 has no NaN and records nothing"
    # the 3rd and 4th optimizer steps, nothing before start() or after stop()
    assert [r["consecutive_skips"] for r in records[1]] == [3, 4]
    assert all(r["kind"] == "loss_scale_overflow" and [p["name"] for p in r["params"]] == [TARGET]
               for r in records[1])
    assert len(read_run(runs / "window").maps) == 2


def test_start_and_stop_records_carry_the_loops_own_step_numbers(runs):
    assert _steps_by_rank(runs / "window") == {1: [3, 4]}


def test_a_steps_filter_without_start_stop_records_only_those_steps(runs):
    records = records_by_rank(runs / "steps_filter")
    assert _steps_by_rank(runs / "steps_filter") == {1: [2, 5]}
    assert [r["consecutive_skips"] for r in records[1]] == [2, 5]


def test_a_ranks_filter_silences_the_other_ranks_but_keeps_their_maps(runs):
    files = read_run(runs / "ranks_filter")
    assert sorted(m["rank"]["global_rank"] for m in files.maps.values()) == [0, 1]
    assert not (runs / "ranks_filter" / "records" / "rank00000_tp0_pp0_dp0.jsonl").exists()
    assert _steps_by_rank(runs / "ranks_filter") == {1: [2]}


def test_step_switches_records_to_the_loops_own_count(runs):
    """Two step() calls per optimizer step: the optimizer steps fall on the loop's counts 2, 4 and 6."""
    assert _steps_by_rank(runs / "micro_batches") == {1: [2, 4, 6]}


def test_start_with_a_model_serves_a_loop_whose_optimizer_is_not_megatrons(tmp_path, no_gradnan_variables):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = gradnan.install(out_dir=str(tmp_path), frames="trace", trace_steps="2")
    try:
        handle.start(model=model)
        for step in range(1, 4):
            batch = torch.randn(3, 4)
            if step == 3:
                batch[0, 0] = math.nan
            gradnan.check(batch, "probe")
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
    finally:
        gradnan.uninstall()
    records = records_by_rank(tmp_path)[0]
    assert [(r["kind"], r["step"]) for r in records] == [("frames", 2), ("probe", 3)]
    frames, probe = records
    assert frames["mode"] == "trace"
    assert [f["module"] for f in frames["frames"]] == ["0", "1", "2", ""]  # inner calls finish first
    assert {f["step"] for f in frames["frames"]} == {2}
    assert frames["first_nonfinite"] is None
    [found] = probe["probes"]
    assert (found["label"], found["step"], found["nan"], found["inf"]) == ("probe", 3, 1, 0)
    assert found["module"] is None  # called in the loop, outside any module
