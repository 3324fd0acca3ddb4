"""The report's first screen claims what the records hold and no more (issue 52), on real megatron-core runs:
a weight's origin rank marks its other non-finite gradients (not "clean"), a rank that got the value from
the origin within the step says so, a vocabulary weight's element names its token under tensor
parallelism, a forward origin above the origin weight says the weight is inside it, and a healthy run lists
the bundles it was asked to capture."""

from __future__ import annotations

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

pytestmark = pytest.mark.slow

BASE = TinyGPTJob(world_size=2, steps=3, quiet=True)
ROWS = BASE.vocab_size // 2  # each tensor-parallel rank's share of the vocabulary
ROW_5_COLUMN_2 = 5 * BASE.hidden_size + 2
JOBS = {
    "embedding_row_on_tp1": BASE.with_(tp=2, injections=(
        Injection(1, 2, "embedding.word_embeddings.weight", "nan", where="weight", index=ROW_5_COLUMN_2),)),
    "bias_inside_the_mlp": BASE.with_(injections=(
        Injection(1, 2, "decoder.layers.0.mlp.linear_fc2.bias", "inf", where="weight", index=3),)),
    "healthy_with_captures": BASE,
}
OPTIONS = {"healthy_with_captures": {"capture_modules": "decoder.layers.0.mlp", "capture_steps": "2"}}


@pytest.fixture(scope="module")
def screens(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_screen")
    launch_many([job.with_(gradnan={"out_dir": str(root / name), **OPTIONS.get(name, {})})
                 for name, job in JOBS.items()])
    return {name: format_text(analyze(read_run(root / name))) for name in JOBS}


def _table(text):
    rows = text.split("Offending modules in backward order")[1].splitlines()
    return {line.split()[0]: line.split()[1:3] for line in rows if line.startswith("  ") and "NaN" in line}


def test_a_vocabulary_weight_names_the_token_its_row_holds_on_its_tensor_parallel_rank(screens):
    text = screens["embedding_row_on_tp1"]
    token = ROWS + 5  # row 5 of tensor-parallel rank 1's shard
    assert f"embedding.word_embeddings.weight[5, 2] (token {token})" in text, text
    assert f"row 5 of embedding.word_embeddings.weight (token {token})" in text, text


def test_the_origin_ranks_other_gradients_are_marked_as_the_origins_not_clean(screens):
    text = screens["embedding_row_on_tp1"]
    table = _table(text)
    assert table["embedding.word_embeddings"] == ["r", "O"], text
    assert table["output_layer"] == ["r", "o"], text  # rank 1 holds them too: not "."
    assert "o non-finite gradients on an origin rank" in text and ". clean" not in text


def test_a_rank_that_got_the_value_within_the_step_says_so_where_its_own_gradients_are_listed(screens):
    text = " ".join(screens["embedding_row_on_tp1"].split())
    assert ("own gradients non-finite before the data-parallel collective on rank(s) 0, 1 (rank(s) 0 received"
            " the value from rank(s) 1 within the step") in text, text


def test_a_forward_origin_above_the_origin_weight_says_the_weight_is_inside_it(screens):
    text = " ".join(screens["bias_inside_the_mlp"].split())
    assert "Forward origin (step 2 run again in place): decoder.layers.0.mlp (MLP)" in text, text
    assert "the origin weight decoder.layers.0.mlp.linear_fc2.bias is inside it" in text, text
    assert "decoder.layers.0.mlp.linear_fc2.bias[3] 1 Inf" in text, text


def test_a_healthy_run_lists_the_bundles_it_was_asked_to_capture(screens):
    text = screens["healthy_with_captures"]
    assert "No non-finite gradient was recorded." in text
    assert text.count("gradnan replay ") == 2 and "step0000002_decoder.layers.0.mlp" in text, text


def test_no_line_prints_a_missing_value(screens):
    for text in screens.values():
        assert "None" not in text and "Run-up: the run-up does not say" not in text, text
