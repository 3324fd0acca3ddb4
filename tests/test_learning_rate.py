"""Issue 48 (case 3), on issue 47's table: an update with a non-finite learning rate writes non-finite
weights on every replica; the report named `weights` ("by the update ... or a bad write"). The learning
rate each step used is kept on the host and read with the weights, so the rule ``learning_rate`` names
the update and the rate. Real megatron-core through its schedules, 2 gloo processes."""

from __future__ import annotations

import pytest

from gradnan.decision.evidence import RateFault
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.evidence import rate_fault
from gradnan.offline.incident.read import read_run
from gradnan.testing.toy import launch
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import records_by_rank


def _kept(*rates):
    return {"learning_rates": [{"step": step, "lr": [rate]} for step, rate in enumerate(rates, start=1)],
            "rank": {"global_rank": 0}}


@pytest.mark.parametrize("rates, fault", [
    ((1e-4, 1e-4, "inf"), RateFault(0, 3, 0, "inf", 1e-4)),
    ((1e-4, 1e-4, "nan"), RateFault(0, 3, 0, "nan", 1e-4)),
    ((1e-4, 1e-4, 1.0), RateFault(0, 3, 0, 1.0, 1e-4)),  # 10,000 times the rate before it
    ((1e-7, 2e-7, 3e-7), None),  # a warm-up
    ((0.0, 1e-4, 1e-4), None),  # a warm-up from zero: no finite positive rate to compare with first
    ((1e-4, 1e-4), None),  # the update of step 3 is not kept
])
def test_the_rate_the_update_before_the_failing_step_used_is_judged(rates, fault):
    assert rate_fault([_kept(*rates)], 4) == fault


@pytest.mark.slow
@pytest.mark.megatron_surface
def test_an_infinite_learning_rate_is_the_update_not_a_bad_write(tmp_path):
    job = TinyGPTJob(world_size=2, steps=3, quiet=True, dtype="fp32",
                     injections=tuple(Injection(rank, 2, "", "inf", where="learning_rate")
                                      for rank in (0, 1)),
                     gradnan={"out_dir": str(tmp_path)})
    launch(job)
    states = [r for records in records_by_rank(tmp_path).values() for r in records if r["kind"] == "state"]
    for record in states:  # one rate per param group (Megatron's with and without weight decay)
        assert [(entry["step"], set(entry["lr"])) for entry in record["learning_rates"]] == [
            (1, {0.001}), (2, {"inf"}), (3, {"inf"})]
    incident = analyze(read_run(tmp_path)).incident
    assert (incident.step, incident.verdict.cause.value, incident.verdict.rule) == (
        3, "optimizer_update", "learning_rate"), incident.verdict
    assert "with the learning rate inf (param group 0, step 2" in incident.verdict.summary
    assert [step.action.value for step in incident.next_steps][:2] == ["resume", "fix_learning_rate"]
