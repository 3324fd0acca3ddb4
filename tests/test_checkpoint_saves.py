"""Issue 49 (checkpoint marks) and issue 48 case 7 on real megatron-core and gloo: a job that saves its
model with ``dist_checkpointing.save`` after every step (``iter_NNNNNNN``, as Megatron-LM names them), one
replica's copy of a weight set to NaN before step 3. Every save is marked; the restart advice names the
newest save known clean, never the save made after the failure (Megatron's exit save under
``validate_results``, labelled 2 and written over the regular save of 2)."""

from __future__ import annotations

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.checkpoints import saves_of
from gradnan.offline.incident.read import read_run
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
NAN_WEIGHT = Injection(1, 3, WEIGHT, "nan", where="weight")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(run dir, result) of: Megatron's validate_results (its exit save after the failure); no result
    validation (the job trains on past the NaN, saving); the same without gradnan (its weights)."""
    dirs = [tmp_path_factory.mktemp(name) for name in ("validate", "trains_on", "without")]
    base = TinyGPTJob(world_size=2, steps=4, quiet=True, dtype="bf16", injections=(NAN_WEIGHT,))
    jobs = [base.with_(rerun_mode="validate_results", gradnan={"out_dir": str(dirs[0])},
                       checkpoint_dir=str(dirs[0] / "ckpt")),
            base.with_(gradnan={"out_dir": str(dirs[1])}, checkpoint_dir=str(dirs[1] / "ckpt")),
            base.with_(checkpoint_dir=str(dirs[2] / "ckpt"))]
    return list(zip(dirs, launch_many(jobs)))


def _resume(run_dir):
    report = analyze(read_run(run_dir))
    return next(step for step in report.incident.next_steps if step.action.value == "resume")


@pytest.mark.slow
def test_megatrons_exit_save_is_marked_not_clean_and_the_advice_names_the_save_before_it(runs):
    run_dir, result = runs[0]
    assert result[0].exit_code == 16  # Megatron's rerun reproduced it: checkpoint and exit
    saves = saves_of(read_run(run_dir).all_records())
    assert [(save.iteration, save.clean, save.after_incident) for save in saves] == [
        (1, True, None), (2, True, None), (2, False, 3)]
    assert {(rank, name, tensor) for rank, name, tensor in saves[2].nonfinite} == {
        (1, WEIGHT, "weight"), (1, WEIGHT, "main")}  # rank 0's copy is finite
    assert all(save.path.endswith(f"iter_{save.iteration:07d}") for save in saves)
    step = _resume(run_dir)  # a Megatron-Core loop of one's own: what to load, no flag (issue 58)
    assert step.command is None and step.text.endswith("(load it as your loop does)"), step.text
    assert "the checkpoint of iteration 1 (" in step.text and "ckpt/iter_0000001" in step.text


@pytest.mark.slow
def test_a_run_that_trains_on_marks_its_later_saves_after_the_failure_and_names_the_last_before(runs):
    run_dir, _ = runs[1]
    saves = saves_of(read_run(run_dir).all_records())
    assert [(save.iteration, save.clean, save.after_incident) for save in saves] == [
        (1, True, None), (2, True, None), (3, False, 3), (4, False, 3)]
    assert "the checkpoint of iteration 2 (" in _resume(run_dir).text


@pytest.mark.slow
def test_marking_saves_changes_no_weight(runs):
    assert runs[1][1][0].param_digest == runs[2][1][0].param_digest
    assert runs[1][1][1].param_digest == runs[2][1][1].param_digest
