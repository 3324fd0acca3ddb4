"""Issue 48, case 6, on real megatron-core (gloo, 2 processes): a token's row of the vocabulary's weights set
to 1e30 (finite, every other weight finite) is named, with its token and its rank, and the Next: step
restores that row. Before, a tied embedding's row gave `norm_overflow` naming `decoder.final_layernorm.bias`
and "change the numerics", which fails the same way. Planted where the issue did not: one replica only,
both, the tensor-parallel rank that holds the row's vocabulary shard, untied embeddings, the output layer,
the first step, Megatron's validate_results and disabled loss checks."""

from __future__ import annotations

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.testing.toy import launch, launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

pytestmark = [pytest.mark.slow]

WORDS = "embedding.word_embeddings.weight"
BASE = TinyGPTJob(world_size=2, steps=3, quiet=True, dtype="bf16")


def _row(ranks, name=WORDS, row=7, step=2):
    return tuple(Injection(rank, step, name, "1e30", where="row", index=row) for rank in ranks)


PLANTS = {  # name -> (job, (weight, row, ranks holding it))
    "tied_one_replica": (BASE.with_(tied_embeddings=True, injections=_row([1])), (WORDS, 7, [1])),
    "tied_tp_rank_1": (BASE.with_(tp=2, tied_embeddings=True, injections=_row([1], row=5)), (WORDS, 5, [1])),
    "untied_tp_rank_0": (BASE.with_(tp=2, injections=_row([0], row=3)), (WORDS, 3, [0])),
    "output_layer_tp_rank_1": (BASE.with_(tp=2, injections=_row([1], "output_layer.weight", 9)),
                               ("output_layer.weight", 9, [1])),
    "tied_from_the_first_step": (BASE.with_(tied_embeddings=True, injections=_row([0, 1], step=1)),
                                 (WORDS, 7, [0, 1])),
    "tied_validate_results": (BASE.with_(tied_embeddings=True, rerun_mode="validate_results",
                                         injections=_row([0, 1])), (WORDS, 7, [0, 1])),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_rows")
    launch_many([job.with_(gradnan={"out_dir": str(root / name)}) for name, (job, _) in PLANTS.items()])
    return {name: root / name for name in PLANTS}


def _token(job: TinyGPTJob, rank: int, row: int) -> int:
    """The vocabulary entry of row ``row`` on ``rank``: Megatron splits the vocabulary evenly over TP."""
    return (rank % job.tp) * (job.vocab_size // job.tp) + row


def _check(incident, job, planted):
    name, row, ranks = planted
    verdict = incident.verdict
    assert (verdict.cause.value, verdict.rule) == ("weights", "embedding_row"), verdict
    token = _token(job, ranks[0], row)
    assert f"row {row} of {name} (token {token})" in verdict.summary, verdict.summary
    assert {entry["global_rank"] for entry in incident.origin} == set(ranks)
    steps = incident.next_steps
    assert steps[0].action.value == "restore_row" and f"row {row} of {name} (token {token})" in steps[0].text
    assert all(step.action.value != "tune_numerics" for step in steps)


@pytest.mark.parametrize("name", list(PLANTS))
def test_a_tokens_row_far_out_of_range_is_named_with_its_token(runs, name):
    job, planted = PLANTS[name]
    _check(analyze(read_run(runs[name])).incident, job, planted)


def test_a_row_caught_by_megatrons_loss_check_in_disabled_mode_is_named(tmp_path):
    """The loss check ends the step before any gradient: the weights read there name the row."""
    job = BASE.with_(tied_embeddings=True, rerun_mode="disabled", injections=_row([0]))
    with pytest.raises(JobFailed):
        launch(job.with_(gradnan={"out_dir": str(tmp_path)}))
    _check(analyze(read_run(tmp_path)).incident, job, (WORDS, 7, [0]))
