"""The one step clock: what records call the step in progress, and what the step filters compare with."""

from __future__ import annotations

from gradnan.training.clock import StepClock


class Optimizer:
    pass


def test_records_count_optimizer_steps_and_filters_follow_megatron_lms_iteration():
    iteration = {"now": None}
    clock = StepClock(lambda: iteration["now"])
    optimizer = Optimizer()
    clock.add(optimizer)
    assert clock.current() == 1 and clock.filter_step() == 1  # before the first step: the first step
    clock.begin(optimizer)
    iteration["now"] = 42  # Megatron-LM resumed at iteration 41
    assert clock.current() == 1 and clock.filter_step() == 42
    clock.end(optimizer)
    assert clock.stepping() is None and clock.current() == 2 and clock.current(optimizer) == 1


def test_a_custom_loops_count_takes_over_from_the_optimizer_steps_taken():
    clock = StepClock(lambda: 7)
    optimizer = Optimizer()
    for _ in range(3):
        clock.begin(optimizer)
        clock.end(optimizer)
    assert clock.loop_step() == 3  # the loop's first step() ends the third optimizer step
    clock.advance_loop()
    assert (clock.counts_loop and clock.current() == 4 and clock.current(optimizer) == 4
            and clock.filter_step() == 4)


def test_a_loop_without_a_megatron_optimizer_starts_at_one():
    clock = StepClock(lambda: None)
    assert clock.loop_step() == 1
    clock.advance_loop()
    assert clock.current() == 2
