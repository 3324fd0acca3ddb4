"""Issue 26, the incident where users already look: at the run's first incident gradnan adds it to
TensorBoard at its step, through Megatron-LM's own writer (placed here where Megatron-LM's loop holds it:
``megatron.training.global_vars._GLOBAL_TENSORBOARD_WRITER`` on the last rank; Megatron-LM itself is not
installable in CI) or its own (``tensorboard_dir``). Real jobs on real megatron-core, read back with
TensorBoard's own event reader."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from gradnan.formats.incident import Conclusion
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import step_headline
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import read_board, records_by_rank

pytestmark = pytest.mark.slow
pytest.importorskip("tensorboard",
                    reason="TensorBoard is not installed: pip install -e '.[trackers]' (CI installs it)")

CORE = "decoder.layers.1.self_attention.core_attention"
# a forward overflow on tensor-parallel rank 0 that reproduces: the last rank (1), which holds the writer,
# knows its replica's forward origin (rank 0) from the rerun
REPRODUCIBLE = TinyGPTJob(world_size=2, tp=2, steps=3, micro_batches=2, quiet=True, dtype="bf16",
                          injections=(Injection(0, 2, CORE, "inf", where="forward"),))
SCALARS = ("gradnan/origin_rank", "gradnan/micro_batch", "gradnan/nonfinite_params", "gradnan/nan",
           "gradnan/inf")


def board_dir(job) -> Path:
    return Path(job.gradnan["out_dir"]).with_name("megatron_lm_tensorboard")


def megatron_lm_writer(job, rank):
    """Megatron-LM's global variables as its loop leaves them: a SummaryWriter on the last rank only."""
    from torch.utils.tensorboard import SummaryWriter

    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_TENSORBOARD_WRITER = (SummaryWriter(log_dir=str(board_dir(job)))
                                              if rank == job.world_size - 1 else None)
    sys.modules["megatron.training.global_vars"] = global_vars


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensorboard")
    # gradnan's own writer first: Megatron-LM's stays in its processes' sys.modules after its job
    launch_many([REPRODUCIBLE.with_(gradnan={"out_dir": str(root / "own"),
                                             "tensorboard_dir": str(root / "own_tensorboard")}),
                 REPRODUCIBLE.with_(gradnan={"out_dir": str(root / "megatron_lm")},
                                    prepare=f"{__name__}:megatron_lm_writer")])
    return root


@pytest.mark.parametrize("name, directory", [("megatron_lm", "megatron_lm_tensorboard"),
                                             ("own", "own_tensorboard")])
def test_the_first_incident_is_in_tensorboard_at_its_step_once_from_the_last_rank(runs, name, directory):
    texts, scalars, files = read_board(runs / directory)
    analysis = analyze(read_run(runs / name))
    incident = analysis.incident
    assert files == 1 and list(texts) == [incident.step] == [2]
    paragraphs = texts[2].split("\n\n")
    assert paragraphs[0] == step_headline(incident), texts  # the report's own first line
    assert incident.rerun.conclusion is Conclusion.REPRODUCIBLE and incident.rerun.global_rank == 0
    assert paragraphs[1] == (f"Rerun of step 2 in place: {Conclusion.REPRODUCIBLE.headline}, forward origin"
                             f" on rank 0, micro-batch {incident.rerun.micro_batch} (the data-parallel"
                             " replica of rank 1)")
    last = next(record for record in records_by_rank(runs / name)[1]
                if record["kind"] == "nonfinite_grad_norm")
    assert paragraphs[2] == f"Rank 1: {last['params_total']} parameter(s) with non-finite gradients"
    assert paragraphs[3] == f"The verdict, from every rank's records: gradnan report {runs / name}"
    assert set(scalars) == set(SCALARS)
    assert {tag: events for tag, events in scalars.items()} == {
        "gradnan/origin_rank": [(2, 0.0)], "gradnan/micro_batch": [(2, float(incident.rerun.micro_batch))],
        "gradnan/nonfinite_params": [(2, float(last["params_total"]))],
        "gradnan/nan": [(2, float(sum(param["nan"] for param in last["params"])))],
        "gradnan/inf": [(2, float(sum(param["inf"] for param in last["params"])))]}
