"""Issue 26 (data): the failing micro-batch located in the training data on real megatron-core (gloo, 2
processes, megatron-core's MockGPTDataset read as Megatron-LM's loop reads it, its arguments where
Megatron-LM keeps them): the samples consumed before the iteration, the micro-batch's global sample indices
on its data-parallel rank, the dataset's documents behind each, printed by the report; ``gradnan batch``
shows the kept micro-batch and the token where the value went non-finite. Bad files: one line, exit 2."""

from __future__ import annotations

import pytest
import torch

from gradnan.cli import main
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import TinyGPTJob

from .helpers import records_by_rank

# a global batch of 8 samples per iteration: 2 data-parallel ranks x 2 micro-batches x 2 samples
BASE = TinyGPTJob(world_size=2, steps=3, micro_batches=2, quiet=True, data="mock_gpt", poison_position=3)
POISONED = {  # global sample -> (iteration, data-parallel rank, micro-batch, its samples)
    "sample13": (13, 2, 0, 1, [12, 13]),  # 13 - 8 consumed = 5: round 1 (micro-batch 1), rank 0's block
    "sample10": (10, 2, 1, 0, [10, 11]),  # 10 - 8 = 2: round 0, rank 1's block
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    launch_many([BASE.with_(poisoned_samples=(sample,), gradnan={"out_dir": str(root / name)})
                 for name, (sample, *_) in POISONED.items()])
    return {name: root / name for name in POISONED}


def _origin(run_dir):
    [(rank, record)] = [(rank, r) for rank, records in records_by_rank(run_dir).items() for r in records
                        if r["kind"] == "rerun" and r["role"] == "origin"]
    return rank, record


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POISONED))
def test_the_rerun_record_locates_the_poisoned_sample_in_the_data(runs, name):
    sample, iteration, dp_rank, micro_batch, indices = POISONED[name]
    rank, record = _origin(runs[name])
    assert (rank, record["iteration"], record["micro_batch"]) == (dp_rank, iteration, micro_batch)
    samples = record["samples"]
    assert (samples["consumed"], samples["data_parallel_rank"], samples["indices"]) == (8, dp_rank, indices)
    # the documents are the dataset's own: what MockGPTDataset reads for each sample
    from gradnan.testing.toy_data import MegatronLMData

    dataset = MegatronLMData(BASE, 0, 1)
    try:
        for source in samples["sources"]:
            # (tokens, documents), and from core 0.19 a third item
            documents = dataset.dataset.dataset._query_document_sample_shuffle_indices(source["index"])[1]
            assert source["dataset"] == "MockGPTDataset"
            assert source["documents"] == [int(d) for d in documents]
    finally:
        dataset.close()
    # the origin's output [sequence, batch, hidden] first went non-finite at the poisoned token
    assert record["nonfinite_at"]["index"][:2] == [BASE.poison_position, indices.index(sample)]


@pytest.mark.slow
def test_the_report_prints_the_samples_and_the_skip_option(runs):
    report = analyze(read_run(runs["sample13"]))
    [entry] = report.to_json()["incident"]["rerun"]["samples"]  # the failing replica's only
    assert entry["indices"] == [12, 13] and entry["micro_batch"] == 1
    text = format_text(report)
    assert "data-parallel rank 0 of 2, micro-batch 1: global samples 12, 13 (8 samples consumed" in text
    assert "\n     --iterations-to-skip 1\n" in text and "--result-rejected-tracker-filename" in text


@pytest.mark.slow
def test_gradnan_batch_shows_the_kept_micro_batch_and_the_poisoned_token(runs, capsys):
    _, record = _origin(runs["sample13"])
    assert main(["batch", record["batch"]["path"]]) == 0
    out = capsys.readouterr().out
    assert "tokens: [2, 16] int64" in out
    assert "sample 1 (global sample 13): " in out and f" [{BASE.vocab_size - 1}] " in out
    assert "input_layernorm output, sample 1 (global sample 13), token position 3" in out


def _exit_and_error(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_a_hostile_batch_file_is_refused_in_one_line(tmp_path, capsys):
    class Planted:
        def __reduce__(self):
            return (print, ("PWNED",))

    pickled = tmp_path / "pickled.pt"
    torch.save({"tokens": Planted()}, pickled)
    junk, nested, link = tmp_path / "junk.pt", tmp_path / "nested.pt", tmp_path / "link.pt"
    junk.write_bytes(b"not a torch file")
    torch.save({"a": {"b": torch.zeros(2)}}, nested)
    link.symlink_to(nested)
    for path, reason in ((pickled, "refused"), (junk, "junk.pt: "), (nested, "not a flat name -> tensor"),
                         (link, "symbolic link"), (tmp_path / "absent.pt", "cannot read")):
        code, error = _exit_and_error(capsys, ["batch", str(path)])
        assert code == 2 and reason in error and "\n" not in error, (path, error)
    assert "PWNED" not in capsys.readouterr().out


def test_a_batch_without_its_run_shows_ids_bounded_and_says_where_is_unknown(tmp_path, capsys):
    path = tmp_path / "mb0.pt"
    torch.save({"tokens": torch.arange(20 * 100).view(20, 100)}, path)
    assert main(["batch", str(path)]) == 0
    out = capsys.readouterr().out
    assert "... (36 more)" in out and "... and 12 more sample(s) not shown" in out
    assert "unknown (no rerun record in this run directory names this file)" in out


def test_a_tokenizer_that_cannot_load_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "mb0.pt"
    torch.save({"tokens": torch.zeros(1, 4, dtype=torch.long)}, path)
    code, error = _exit_and_error(capsys, ["batch", str(path), "--tokenizer", str(tmp_path / "nope")])
    assert code == 2 and "--tokenizer" in error and "\n" not in error
