"""Issue 23 (cases 4 and 6): transient or reproducible per data-parallel replica, from that replica's own
facts (its loss, its forward pass, its gradients before the collective), worded from those facts; the
micro-batch kept for a transient fault; Megatron's own conclusions shown per rank where they split. The
gloo jobs are real megatron-core through Megatron's ``RerunStateMachine`` as Megatron-LM drives it."""

from __future__ import annotations

import pytest

from gradnan.decision.replica import conclude, conclusion_of, own_failure_of
from gradnan.events import MegatronRerun
from gradnan.formats.incident import Conclusion, OwnFailure
from gradnan.formats.observed import ReplicaObservation
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob
from gradnan.training.rerun_pass import observation

from .helpers import records_by_rank
from .test_report_unit import _files, _record

CORE = "decoder.layers.1.self_attention.core_attention"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
BASE = TinyGPTJob(world_size=2, steps=3, micro_batches=1, quiet=True, dtype="bf16")
FORWARD_GLITCH = Injection(1, 2, CORE, "inf", where="forward", transient=True)
SCENARIOS = {
    # a one-off forward fault on rank 1 (dp1): gradnan's own rerun at the grad norm
    "forward_glitch": BASE.with_(injections=(FORWARD_GLITCH,)),
    # the same under Megatron's validate_results: Megatron reruns the step, finds it finite, exits
    "forward_glitch_validated": BASE.with_(rerun_mode="validate_results", injections=(FORWARD_GLITCH,)),
    # a one-off NaN in one weight gradient on rank 1: Megatron's bucket check, its rerun finite
    "gradient_glitch_validated": BASE.with_(
        rerun_mode="validate_results", check_for_nan_in_grad=True,
        injections=(Injection(1, 2, FC1, "nan", where="backward", index=3, transient=True),)),
    # one huge, finite gradient element on rank 1: Megatron's bucket check finds its norm Inf and reruns
    "exploding_validated": BASE.with_(
        rerun_mode="validate_results", check_for_nan_in_grad=True,
        injections=(Injection(1, 2, FC1, "1e30", where="backward", index=5),)),
    # one replica's copy of a weight made huge but finite before step 2 (a bad write on rank 1 only)
    "one_replica_weight": BASE.with_(injections=(Injection(1, 2, FC1, "1e30", where="weight", index=5),)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    launch_many([job.with_(gradnan={"out_dir": str(root / name)}) for name, job in SCENARIOS.items()])
    return {name: root / name for name in SCENARIOS}


def _reruns(run_dir):
    return {rank: next(r for r in records if r["kind"] == "rerun")
            for rank, records in records_by_rank(run_dir).items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["forward_glitch", "forward_glitch_validated"])
def test_a_forward_glitch_is_transient_on_its_own_replica_only_and_keeps_its_micro_batch(runs, name):
    found = _reruns(runs[name])
    assert (conclusion_of(found[1]), own_failure_of(found[1])) == ("transient", "loss")
    assert (conclusion_of(found[0]), own_failure_of(found[0])) == ("after_collective", None)
    assert found[1]["batch"] and found[1]["micro_batch"] == 0
    analysis = analyze(read_run(runs[name]))
    incident = analysis.incident
    assert incident.step == 2 and incident.rerun.concluded_by == (1,)
    assert incident.verdict.cause.value == "device" and "its loss was not" in incident.verdict.summary
    assert [entry["global_rank"] for entry in incident.origin] == [1]
    drain, selftest = incident.next_steps
    origin = incident.origin[0]
    assert drain.text.startswith(f"drain {origin['host']} {origin['device']} (rank 1)")
    assert selftest.command[:2] == ("torchrun", "--nproc_per_node=2")  # both ranks ran on this host
    text = format_text(analysis)
    assert ("NOT reproduced: transient, on data-parallel replica(s) dp1 (each its whole model-parallel group;"
            " recorded by rank(s) 1)") in " ".join(text.split()), text
    assert "  rank(s) 0: forward pass and local gradients clean" in text, text
    assert f"the micro-batch: {found[1]['batch']['path']}" in text, text
    assert "Verdict: device" in text and "forward_op" not in text, text  # no reading that contradicts it
    report = analysis.to_json()["incident"]["rerun"]
    assert report["conclusions"] == [
        {"conclusion": "transient", "ranks": [1], "own_failure": "loss"},
        {"conclusion": "after_collective", "ranks": [0], "own_failure": None}]


@pytest.mark.slow
def test_megatron_stopping_before_the_norm_is_still_an_incident_with_its_origin(runs):
    text = format_text(analyze(read_run(runs["forward_glitch_validated"])))
    assert "First failing step: 2  (rerun)" in text, text
    assert "Megatron's own rerun of it (validate_results): transient" in text, text
    origin = text.split("Origin (the replica whose own loss or gradients were non-finite")[1].splitlines()
    assert origin[1].startswith("  rank 1 (tp0 pp0 dp1) on ") and origin[1].endswith(
        ": its own loss non-finite in the failing pass"), text
    assert "No non-finite gradient was recorded" not in text


@pytest.mark.slow
def test_a_gradient_glitch_is_transient_by_its_gradients_not_its_loss(runs):
    found = _reruns(runs["gradient_glitch_validated"])
    assert (conclusion_of(found[1]), own_failure_of(found[1]), found[1]["megatron"]) == (
        "transient", "gradients", "transient")
    assert conclusion_of(found[0]) == "after_collective"
    analysis = analyze(read_run(runs["gradient_glitch_validated"]))
    assert analysis.incident.rerun.concluded_by == (1,)
    assert [entry["global_rank"] for entry in analysis.incident.origin] == [1]
    assert "its own gradients were not" in analysis.incident.verdict.summary
    assert "loss was not" not in format_text(analysis)


def _facts(reproduced, loss, gradients, megatron):
    """A replica's observations from its group's all-reduced states (1 non-finite, 0 finite, -1 unseen)."""
    return observation(float(reproduced), loss, gradients, 0.0, 0.0, -1.0, megatron)


REPRODUCIBLE = MegatronRerun("reproducible", "reproducible")
TRANSIENT = MegatronRerun("transient", "transient")


@pytest.mark.parametrize("facts, expected", [
    (_facts(True, 1, 1, None), Conclusion.REPRODUCIBLE),
    (_facts(False, 1, 1, None), Conclusion.TRANSIENT),
    (_facts(False, 1, 1, REPRODUCIBLE), Conclusion.TRANSIENT),
    (_facts(False, 0, 1, TRANSIENT), Conclusion.TRANSIENT),
    (_facts(False, 0, 1, None), Conclusion.BACKWARD),
    (_facts(False, 0, 1, REPRODUCIBLE), Conclusion.BACKWARD),
    # Megatron's word is job-wide: a replica whose own loss and gradients were clean received the values
    (_facts(False, 0, 0, TRANSIENT), Conclusion.AFTER_COLLECTIVE),
    (_facts(False, -1, 0, None), Conclusion.AFTER_COLLECTIVE),
    (_facts(False, 0, -1, None), Conclusion.BACKWARD),
    (_facts(False, -1, -1, TRANSIENT), Conclusion.NOT_REPRODUCED),
])
def test_each_replica_concludes_from_its_own_facts(facts, expected):
    assert conclude(facts) is expected
    assert conclude(ReplicaObservation.from_json(facts.to_json())) is expected  # as the report reads it


def test_the_transient_wording_names_what_failed():
    by_loss = Conclusion.TRANSIENT.explain(OwnFailure.LOSS)
    by_gradients = Conclusion.TRANSIENT.explain(OwnFailure.GRADIENTS)
    assert "loss was not" in by_loss and "loss" not in by_gradients.split("although")[1]
    assert "gradients were non-finite before the data-parallel collective" in by_gradients


def _rerun(rank, conclusion, megatron, pp, own=None, module=None):
    record = _record(2, "rerun", rank, trigger="megatron_validation", megatron=megatron,
                     role="origin" if module else "clean", conclusion=conclusion, own_failure=own,
                     micro_batch=0, module=module, bundle=None, batch=None,
                     **{"class": "DotProductAttention" if module else None})
    record["rank"].update(pp=pp, dp=0, dp_size=1)
    return record


def test_split_conclusions_across_pipeline_stages_are_shown_as_such():
    analysis = analyze(_files(_rerun(0, "transient", "transient", 0, own="loss"),
                              _rerun(1, "reproducible", "reproducible", 1, module=CORE)))
    rerun = analysis.to_json()["incident"]["rerun"]
    assert rerun["megatron"] == "reproducible"
    assert rerun["megatron_split"] == [
        {"conclusion": "reproducible", "ranks": [1], "own_failure": None},
        {"conclusion": "transient", "ranks": [0], "own_failure": "loss"}]
    text = format_text(analysis)
    assert ("Megatron's own rerun of it (validate_results): split: reproducible on rank(s) 1; transient on"
            " rank(s) 0") in text, text
    assert "  rank(s) 0: NOT reproduced: transient" in text, text


def test_each_rank_records_megatrons_word_from_its_own_validation():
    """Megatron's state machine on each rank compares only that rank's results: a rank whose own check
    failed says whether its rerun failed again; a rank whose results were all accepted takes the job's."""
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    from gradnan.patches.result_validation import _own_conclusion

    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    assert _own_conclusion(machine) is None
    machine.failed_validation_call = object()
    assert _own_conclusion(machine) == "transient"
    machine.checkpoint_requested = True
    assert _own_conclusion(machine) == "reproducible"


@pytest.mark.slow
def test_exploding_gradients_stopped_by_megatrons_bucket_check_are_a_norm_overflow(runs):
    """No grad norm is computed (Megatron exits after its rerun): the pre-reduction check's overflow is
    the group's fact, not "the backward pass"."""
    found = _reruns(runs["exploding_validated"])
    assert conclusion_of(found[1]) == "norm_overflow" and conclusion_of(found[0]) == "after_collective"
    incident = analyze(read_run(runs["exploding_validated"])).incident
    assert incident.rerun.conclusion.value == "norm_overflow" and incident.rerun.concluded_by == (1,)
    assert incident.verdict.cause.value == "norm_overflow"
    assert "exploding gradients" in incident.verdict.summary


@pytest.mark.slow
def test_of_two_replicas_whose_weights_differ_the_one_that_failed_is_named(runs):
    """Two replicas, rank 1's copy of a weight finite but huge: the digests differ with no majority, and
    only rank 1 produced the non-finite values, so its copy is the odd one."""
    incident = analyze(read_run(runs["one_replica_weight"])).incident
    assert (incident.verdict.cause.value, incident.verdict.rule) == ("weights", "replicas_disagree")
    assert [entry["global_rank"] for entry in incident.origin] == [1]
    assert "only theirs produced the non-finite values" in incident.verdict.summary
