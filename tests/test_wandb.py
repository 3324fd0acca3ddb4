"""Issue 40, the incident where users already look, in Weights & Biases: at the run's first incident
gradnan logs it to Megatron-LM's W&B run (placed here where Megatron-LM's loop holds it:
``megatron.training.global_vars._GLOBAL_WANDB_WRITER``, the ``wandb`` module after ``wandb.init`` on the
last rank; Megatron-LM itself is not installable in CI) or to a run of its own (``wandb_project``). Real
jobs on real megatron-core and the real ``wandb`` package in offline mode, read back from the run folder
that ``wandb sync`` would upload."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import step_headline
from gradnan.testing.toy import launch_many

from .helpers import read_board, records_by_rank, wandb_incident, wandb_records, wandb_run_folder
from .test_tensorboard import REPRODUCIBLE  # skips this module too where TensorBoard is not installed

pytestmark = pytest.mark.slow
pytest.importorskip("wandb", reason="W&B is not installed: pip install -e '.[trackers]' (CI installs it)")

PROJECT = "gradnan-test"


def trackers_dir(job, name: str) -> Path:
    return Path(job.gradnan["out_dir"]).with_name(name)


def megatron_lm_trackers(job, rank):
    """Megatron-LM's global variables as its loop leaves them (``_set_wandb_writer``,
    ``_set_tensorboard_writer``): on the last rank the ``wandb`` module with its run initialised, and a
    SummaryWriter; None elsewhere."""
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_WANDB_WRITER = global_vars._GLOBAL_TENSORBOARD_WRITER = None
    if rank == job.world_size - 1:
        wandb.init(project=PROJECT, name="megatron-lm", dir=str(trackers_dir(job, "megatron_lm_wandb")))
        global_vars._GLOBAL_WANDB_WRITER = wandb
        board = trackers_dir(job, "megatron_lm_tensorboard")
        global_vars._GLOBAL_TENSORBOARD_WRITER = SummaryWriter(str(board))
    sys.modules["megatron.training.global_vars"] = global_vars


def megatron_lm_finish(job, rank):
    """What Megatron-LM's ``pretrain`` does at its end: ``wandb_writer.finish()`` (the run folder's records
    reach disk then)."""
    global_vars = sys.modules["megatron.training.global_vars"]
    if global_vars._GLOBAL_WANDB_WRITER is not None:
        global_vars._GLOBAL_WANDB_WRITER.finish()
        global_vars._GLOBAL_TENSORBOARD_WRITER.close()


def megatron_lm_run_gone(job, rank):
    """Megatron-LM's writer whose W&B run has ended before the incident (as when W&B's service is gone):
    every call on it raises."""
    megatron_lm_trackers(job, rank)
    writer = sys.modules["megatron.training.global_vars"]._GLOBAL_WANDB_WRITER
    if writer is not None:
        writer.finish()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, wandb_offline):
    root = tmp_path_factory.mktemp("wandb_runs")
    # gradnan's own run first (a healthy job before it: no run at all), then Megatron-LM's, whose global
    # variables stay in its processes' sys.modules after its job
    own = {"out_dir": str(root / "own"), "wandb_project": PROJECT}
    launch_many([REPRODUCIBLE.with_(injections=(), gradnan={**own, "out_dir": str(root / "healthy")}),
                 REPRODUCIBLE.with_(gradnan=own),
                 REPRODUCIBLE.with_(gradnan={"out_dir": str(root / "megatron_lm")},
                                    prepare=f"{__name__}:megatron_lm_trackers",
                                    finish=f"{__name__}:megatron_lm_finish")])
    return root


def test_megatron_lm_run_holds_the_incident_as_tensorboard_shows_it(runs):
    """The same text, scalars and step as TensorBoard's (tests/test_tensorboard.py asserts their wording),
    and an alert with that text."""
    board_texts, board_scalars, _ = read_board(runs / "megatron_lm_tensorboard")
    wandb = wandb_incident(wandb_run_folder(runs / "megatron_lm_wandb"))
    incident = analyze(read_run(runs / "megatron_lm")).incident
    assert list(board_texts) == [incident.step] == [2]
    text = board_texts[2]
    assert text.split("\n\n")[0] == step_headline(incident)  # the report's own first line
    assert wandb["texts"] == [text]
    assert wandb["alerts"] == [("gradnan: the incident at step 2", text, "ERROR")]
    assert wandb["history"] == {2: {tag: value for tag, [(step, value)] in board_scalars.items()}}
    last = next(record for record in records_by_rank(runs / "megatron_lm")[1]
                if record["kind"] == "nonfinite_grad_norm")
    assert wandb["history"][2]["gradnan/nonfinite_params"] == last["params_total"] > 0


def test_own_run_in_wandb_project_holds_the_same_incident_only_a_failing_job_makes_one(runs, wandb_offline):
    own_folder = wandb_run_folder(wandb_offline)  # exactly one: the healthy job made none
    own = wandb_incident(own_folder)
    megatron_lm = wandb_incident(wandb_run_folder(runs / "megatron_lm_wandb"))
    [run] = [record.run for record in wandb_records(own_folder) if record.WhichOneof("record_type") == "run"]
    assert (run.project, run.job_type) == (PROJECT, "gradnan")
    [text] = own["texts"]
    # the same job as Megatron-LM's: the same incident, but for where its records are
    assert text == megatron_lm["texts"][0].replace(str(runs / "megatron_lm"), str(runs / "own"))
    assert own["history"] == megatron_lm["history"]
    assert own["alerts"] == [("gradnan: the incident at step 2", text, "ERROR")]


def test_a_failing_wandb_costs_its_own_write_only(tmp_path, wandb_offline, capfd):
    """W&B raising at the incident: one WARNING, TensorBoard still written, training to its last step."""
    job = REPRODUCIBLE.with_(gradnan={"out_dir": str(tmp_path / "megatron_lm")},
                             prepare=f"{__name__}:megatron_lm_run_gone",
                             finish=f"{__name__}:megatron_lm_finish")
    [outcome] = launch_many([job])
    err = capfd.readouterr().err
    assert ("the incident could not be written to W&B (training goes on): Error: You must call wandb.init()"
            in err), err
    assert "the incident is in TensorBoard at step 2" in err
    texts, _, _ = read_board(tmp_path / "megatron_lm_tensorboard")
    assert list(texts) == [2]
    assert all(len(result.steps) == REPRODUCIBLE.steps for result in outcome.values())


def test_wandb_project_without_the_wandb_package_is_one_warning(make_runtime, monkeypatch, caplog):
    """A machine without wandb (its import blocked): the incident goes on to the other trackers."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    runtime = make_runtime(wandb_project=PROJECT)
    with caplog.at_level(logging.INFO, logger="gradnan"):
        runtime.board.incident(None, None, None)
    assert [record.getMessage() for record in caplog.records] == [
        "wandb_project is set but W&B cannot be written (import of wandb halted; None in sys.modules):"
        " pip install wandb"]
