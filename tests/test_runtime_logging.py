"""The runtime's log policy: loud once, quiet on repeats, never a flood (unit level, fake optimizer)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gradnan.errors import InternalError
from gradnan.formats.maps import ParamSlot


class FakeOptimizer:
    pass


def _slot():
    return ParamSlot(0, "decoder.layers.0.mlp.linear_fc1.weight", (4,), "torch.float16", 4, 0, 1.0, 1.0,
                     False, 0, None, "torch.float32")


def _overflow_steps(runtime, optimizer, count, scale=1024.0, min_scale=1.0):
    grad = torch.tensor([1.0, float("inf"), 2.0, 3.0])
    for _ in range(count):
        runtime.begin_step(optimizer, lambda: [_slot()])
        runtime.loss_scale_overflow(optimizer, 0, scale, min_scale, [_slot()], [grad])
        runtime.end_step(optimizer, skipped=True)


def _applied_step(runtime, optimizer):
    runtime.begin_step(optimizer, lambda: [_slot()])
    runtime.end_step(optimizer, skipped=False)


def test_repeated_skips_warn_at_the_threshold_then_at_doubling_counts(tmp_path, caplog, make_runtime):
    runtime, optimizer = make_runtime(skip_warn_after=3), FakeOptimizer()
    _applied_step(runtime, optimizer)  # training has had a stable stretch: the scale is no longer warming up
    with caplog.at_level(logging.DEBUG, logger="gradnan"):
        _overflow_steps(runtime, optimizer, 13)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" consecutive")[0].split(": ")[1] for m in warned] == ["3", "6", "12"]


def test_skips_before_the_first_applied_update_are_the_loss_scale_warming_up(tmp_path, caplog, make_runtime):
    """Megatron-LM starts fp16 at a loss scale of 2**32: a healthy run skips a dozen steps or more while
    the scale comes down. Before any update is applied, that is routine: recorded, not warned about,
    nothing captured. Its collapse to the minimum is still an error (the other test)."""
    import json

    fc1 = ("decoder.layers.0.mlp.linear_fc1", torch.nn.Linear(4, 4))
    runtime, optimizer = make_runtime([fc1], skip_warn_after=3), FakeOptimizer()
    with caplog.at_level(logging.INFO, logger="gradnan"):
        _overflow_steps(runtime, optimizer, 13, scale=2.0 ** 20, min_scale=1.0)
    assert not caplog.records and runtime.captures.captures == {} and runtime.captures.finder is None
    lines = next((tmp_path / "records").glob("*.jsonl")).read_text().splitlines()
    assert len(lines) == 13 and all(json.loads(line)["warmup"] is True for line in lines)
    _applied_step(runtime, optimizer)
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        _overflow_steps(runtime, optimizer, 3, scale=2.0 ** 20, min_scale=1.0)
    [warned] = caplog.records
    assert "3 consecutive fp16 steps skipped" in warned.getMessage()
    assert runtime.captures.finder is not None  # a real run of skips (all of this rank's gradients): watched


def test_a_healthy_step_resets_the_skip_count(tmp_path, caplog, make_runtime):
    runtime, optimizer = make_runtime(skip_warn_after=3), FakeOptimizer()
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        _overflow_steps(runtime, optimizer, 2)
        runtime.begin_step(optimizer, lambda: [_slot()])
        runtime.end_step(optimizer, skipped=False)
        _overflow_steps(runtime, optimizer, 2)
    assert not caplog.records


def test_scale_collapse_is_reported_once_with_the_parameter(tmp_path, caplog, make_runtime):
    runtime, optimizer = make_runtime(), FakeOptimizer()
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        _overflow_steps(runtime, optimizer, 4, scale=1.0, min_scale=1.0)
    [collapse] = caplog.records
    assert "collapsed" in collapse.getMessage()
    assert "decoder.layers.0.mlp.linear_fc1.weight" in collapse.getMessage()


def test_consecutive_nonfinite_norms_are_loud_once(tmp_path, caplog, make_runtime):
    runtime, optimizer = make_runtime(), FakeOptimizer()
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    with caplog.at_level(logging.INFO, logger="gradnan"):
        for _ in range(6):
            runtime.begin_step(optimizer, lambda: [_slot()])
            runtime.nonfinite_grad_norm(optimizer, float("nan"), [_slot()], [grad])
            runtime.end_step(optimizer, skipped=False)
    levels = [r.levelname for r in caplog.records]
    # without NVML, said once at the first incident; then step 1, then 2 and 4 consecutive
    assert levels == ["INFO", "ERROR", "INFO", "WARNING", "WARNING"]
    assert "device health not read at this incident" in caplog.records[0].message
    assert ("no rerun of the failing step: it was not run by megatron-core's pipeline schedules"
            in caplog.records[2].message)


@pytest.mark.parametrize("strict", [False, True])
def test_internal_errors_are_logged_once_unless_strict(tmp_path, caplog, strict, make_runtime):
    runtime = make_runtime(strict=strict)

    def broken():
        raise KeyError("unexpected Megatron attribute")

    if strict:
        with pytest.raises(InternalError, match="internal error in scan: KeyError"):
            runtime.guarded("scan", broken)
        return
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        assert runtime.guarded("scan", broken) is None
        assert runtime.guarded("scan", broken) is None
    assert len(caplog.records) == 1
    assert "training goes on unchanged" in caplog.text


def test_records_stop_at_max_records_bytes_with_one_log_line(tmp_path, caplog, make_runtime):
    runtime, optimizer = make_runtime(max_records_bytes=4096), FakeOptimizer()
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        for _ in range(40):
            runtime.begin_step(optimizer, lambda: [_slot()])
            runtime.nonfinite_grad_norm(optimizer, float("nan"), [_slot()], [grad])
            runtime.end_step(optimizer, skipped=False)
    [records] = list((tmp_path / "records").glob("*.jsonl"))
    size = records.stat().st_size
    assert 4096 <= size < 4096 + 2048  # stops at the first record past the bound
    full = [r for r in caplog.records if "max_records_bytes" in r.getMessage()]
    assert len(full) == 1


@pytest.mark.parametrize("strict", [False, True])
def test_an_unwritable_out_dir_is_logged_once_and_training_goes_on(tmp_path, caplog, make_runtime, strict):
    """Not gradnan's bug but the machine's: one line per reason (not per file), naming the first file it
    stopped, even under strict."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    runtime, optimizer = make_runtime(out_dir=str(blocker), strict=strict), FakeOptimizer()
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        for _ in range(3):
            runtime.guarded("optimizer step", runtime.begin_step, optimizer, lambda: [_slot()])
            assert runtime.guarded("grad-norm check", runtime.nonfinite_grad_norm, optimizer,
                                   float("nan"), [_slot()], [grad]) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    writes = [m for m in errors if m.startswith("cannot write")]
    assert len(writes) == 1 and not any("internal error" in m for m in errors), errors
    assert writes[0].startswith(f"cannot write the map {blocker}/maps/rank00000_tp0_pp0_dp0.json:"
                                " Not a directory")
    assert blocker.read_text() == "x"


def test_records_and_log_lines_carry_megatron_lms_iteration_when_its_loop_runs(tmp_path, megatron_lm_args,
                                                                              make_runtime, caplog):
    """A resumed run: gradnan's own step count starts at 1, the log says the iteration Megatron-LM prints."""
    import json

    from gradnan.patches.model import megatron_lm_iteration

    assert megatron_lm_iteration() is None
    megatron_lm_args.curr_iteration = 41
    runtime = make_runtime(facts={"iteration": megatron_lm_iteration})
    optimizer = FakeOptimizer()
    runtime.begin_step(optimizer, lambda: [_slot()])
    with caplog.at_level(logging.ERROR, logger="gradnan"):
        runtime.nonfinite_grad_norm(optimizer, float("nan"), [_slot()], [torch.tensor([float("nan")] * 4)])
    [line] = next((tmp_path / "records").glob("*.jsonl")).read_text().splitlines()
    assert json.loads(line)["iteration"] == 42 and json.loads(line)["step"] == 1
    assert caplog.records[0].getMessage().startswith("iteration 42: grad norm is nan;")


def test_an_explicit_capture_of_the_first_iteration_after_a_resume_is_taken(tmp_path, megatron_lm_args,
                                                                             make_runtime):
    """Resumed at iteration 1: the optimizer is built before Megatron-LM sets ``curr_iteration``, so the step
    the filters see is known only at the module's first call. The bundle is named by that iteration."""
    from gradnan.patches.model import megatron_lm_iteration

    def run(capture_steps):
        module = torch.nn.Linear(4, 4)
        runtime = make_runtime([("lin", module)], capture_modules="lin", capture_steps=capture_steps,
                               out_dir=str(tmp_path / capture_steps),
                               facts={"iteration": megatron_lm_iteration})
        optimizer = FakeOptimizer()
        vars(megatron_lm_args).pop("curr_iteration", None)
        runtime.optimizer_built(optimizer, lambda: [_slot()])
        megatron_lm_args.curr_iteration = 1  # the loop starts: its log line says iteration 2
        module(torch.ones(2, 4)).sum().backward()
        runtime.begin_step(optimizer, lambda: [_slot()])
        runtime.end_step(optimizer, skipped=False)
        return module, sorted(path.name for path in (tmp_path / capture_steps).glob("bundles/*/*"))

    module, bundles = run("2")
    assert bundles == ["iter0000002_lin"]
    module, bundles = run("1")
    assert bundles == [] and "forward" not in vars(module)  # not this step: disarmed, the module untouched
def test_in_sync_mode_the_norm_record_says_the_local_gradients_were_bad(tmp_path, make_runtime):
    import json

    runtime, optimizer = make_runtime(), FakeOptimizer()
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    runtime.begin_step(optimizer, lambda: [_slot()])
    group = FakeOptimizer()  # any weak-referenceable object stands for a bucket group
    assert runtime.first_sync_of_step(group)
    runtime.pre_reduction_flags(group, torch.tensor([math.nan]),
                                lambda g, bad: ([_slot()], [grad], [{"bucket": 0}]), mode="sync")
    runtime.nonfinite_grad_norm(optimizer, float("nan"), [_slot()], [grad])
    kinds = [json.loads(line)
             for line in next((tmp_path / "records").glob("*.jsonl")).read_text().splitlines()]
    assert [r["kind"] for r in kinds] == ["pre_reduction", "nonfinite_grad_norm"]
    assert kinds[1]["pre_reduction"] == "nonfinite"


def test_an_optimizer_index_is_never_reused_after_an_optimizer_is_collected(make_runtime):
    """Each optimizer's map file is named by its index: a new optimizer built after an old one was garbage
    collected must not take the old one's index (and overwrite its map)."""
    import gc

    runtime = make_runtime()
    first, second = FakeOptimizer(), FakeOptimizer()
    for optimizer in (first, second):
        runtime.optimizer_built(optimizer, lambda: [_slot()])
    del first
    gc.collect()
    third = FakeOptimizer()
    runtime.optimizer_built(third, lambda: [_slot()])
    assert runtime.detections.optimizer(third)[0].index == 2


def test_a_rank_producing_a_nonfinite_gradient_is_one_error_whichever_way_it_was_read(make_runtime, caplog):
    """Read at once (``pre_reduction="sync"``, or Megatron's ``check_for_nan_in_grad`` on) or at the norm:
    the same finding, the same level."""
    grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    levels = {}
    for mode in ("sync", "deferred"):
        runtime, optimizer, group = make_runtime(), FakeOptimizer(), FakeOptimizer()
        runtime.begin_step(optimizer, lambda: [_slot()])
        assert runtime.first_sync_of_step(group)
        describe = lambda g, bad: ([_slot()], [grad], [{"bucket": 0}])  # noqa: E731
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="gradnan"):
            if mode == "sync":
                runtime.pre_reduction_flags(group, torch.tensor([math.nan]), describe, mode="sync")
            else:
                runtime.defer_pre_reduction_flags(group, torch.tensor([math.nan]), describe)
                runtime.nonfinite_grad_norm(optimizer, float("nan"), [_slot()], [grad])
        [levels[mode]] = [r.levelname for r in caplog.records if "BEFORE the data-parallel" in r.getMessage()]
    assert levels == {"sync": "ERROR", "deferred": "ERROR"}


def _records(tmp_path):
    import json

    path = next((tmp_path / "records").glob("*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_finite_gradient_whose_square_overflows_is_a_pre_reduction_record_not_a_nonfinite_one(
        tmp_path, make_runtime, caplog):
    """Issue 23, case 3: a bucket's largest magnitude, finite, squares past float32's range: recorded before
    the collective as a norm overflow naming the element; the norm record says this rank produced it."""
    runtime, optimizer, group = make_runtime(), FakeOptimizer(), FakeOptimizer()
    grad = torch.tensor([0.5, -1e30, 1.0, 1.0])
    runtime.begin_step(optimizer, lambda: [_slot()])
    assert runtime.first_sync_of_step(group)
    runtime.defer_pre_reduction_flags(group, torch.tensor([1e30]),
                                      lambda g, bad: ([_slot()], [grad], [{"bucket": 0}]))
    with caplog.at_level(logging.DEBUG, logger="gradnan"):
        runtime.nonfinite_grad_norm(optimizer, float("inf"), [_slot()], [grad])
    pre, norm = _records(tmp_path)[:2]
    assert pre["kind"] == "pre_reduction" and pre["norm_overflow"] is True and pre["params"] == []
    huge = float(torch.tensor(-1e30))  # as float32 holds it
    assert pre["largest_grad"] == {"id": 0, "name": _slot().name, "flat": 1, "index": [1], "value": huge,
                                   "overflows": True}
    assert norm["pre_reduction"] == "overflow" and norm["largest_grad"]["overflows"] is True
    assert runtime.detections.last_at_norm == "overflow"
    [line] = [r.getMessage() for r in caplog.records
              if r.levelname == "ERROR" and "grad norm is" in r.getMessage()]
    assert "the grad norm overflowed although every gradient is finite" in line
    assert "produced in this replica" in line


def test_a_bucket_below_the_square_limit_is_clean_and_the_norm_record_names_the_largest(tmp_path,
                                                                                      make_runtime):
    runtime, optimizer, group = make_runtime(), FakeOptimizer(), FakeOptimizer()
    grad = torch.tensor([0.5, 3.0, 1.0, 1.0])
    runtime.begin_step(optimizer, lambda: [_slot()])
    assert runtime.first_sync_of_step(group)
    runtime.defer_pre_reduction_flags(group, torch.tensor([3.0]),
                                      lambda g, bad: ([_slot()], [grad], [{"bucket": 0}]))
    runtime.nonfinite_grad_norm(optimizer, float("inf"), [_slot()], [grad])
    [norm] = _records(tmp_path)[:1]
    assert norm["kind"] == "nonfinite_grad_norm" and norm["pre_reduction"] == "clean"
    assert norm["largest_grad"]["value"] == 3.0 and norm["largest_grad"]["overflows"] is False
    assert runtime.detections.last_at_norm == "finite"
