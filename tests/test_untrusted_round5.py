"""Untrusted input, fifth round (issue 60): records that contradict each other or cannot be true give no
confident verdict. A record from outside the job (no world size, another one, a rank beyond it) is left
out and named once; a record no writer can produce (a replica check of five copies among two replicas, a
rerun origin outside the world) is a listed problem; facts that contradict each other (pipeline transfers
in a job without a pipeline, two verdicts of Megatron on one job, a replica's rerun saying its gradients
were finite beside its rank's record of non-finite ones, a replica check naming a rank that is not a
data-parallel peer) are a listed conflict and an ``undetermined`` verdict naming the ranks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

from gradnan.errors import InputError
from gradnan.formats import records
from gradnan.formats.trace import Trace
from gradnan.formats.trace_ops import TraceError
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import format_text

from .test_readers_property import coords
from .test_records_reader import a_divergence_record

Lines = List[Dict[str, Any]]
RANK0, RANK1 = "records/rank00000_tp0_pp0_dp0.jsonl", "records/rank00001_tp0_pp0_dp1.jsonl"


def forged(real_runs: Path, tmp_path: Path, change: Dict[str, Callable[[Lines], Lines]]):
    """The real data run (a forward failure at step 2 on rank 0 of 2, run again in place), each named
    records file changed by its function; its report."""
    run_dir = shutil.copytree(real_runs / "data", tmp_path / "data")
    for relative, edit in change.items():
        path = run_dir / relative
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(line) + "\n" for line in edit(lines)))
    return analyze(read_run(run_dir))


def first(lines: Lines, kind: str, step: int = 2) -> Dict[str, Any]:
    return next(line for line in lines if line["kind"] == kind and line["step"] == step)


@pytest.fixture(scope="module")
def unforged(real_runs):
    report = analyze(read_run(real_runs / "data"))
    assert report.incident is not None and report.incident.step == 2 and not report.problems
    return report


def _same_verdict(report, unforged) -> None:
    assert report.incident is not None and unforged.incident is not None
    def said(incident) -> tuple:
        return incident.step, incident.verdict.rule, [origin["global_rank"] for origin in incident.origin]

    assert said(report.incident) == said(unforged.incident)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [{"global_rank": 9}, {**coords(1), "global_rank": 7, "world_size": 8},
                                  {**coords(1), "world_size": None}])
def test_a_record_from_outside_the_job_is_left_out_and_named_once(real_runs, tmp_path, unforged, rank):
    """A ghost rank's failure one step before the real one, its group sizes left out (the fourth round's
    "rank 9 () on None None", ``--nproc_per_node=1``), or claiming another world: not the first failing
    step, not a rank of the report, one problem line."""
    def ghost(lines: Lines) -> Lines:
        record = {**first(lines, "nonfinite_grad_norm"), "step": 1, "rank": rank}
        return lines + [record, {**record, "step": 2}]

    report = forged(real_runs, tmp_path, {RANK0: ghost})
    _same_verdict(report, unforged)
    assert report.ranks_seen == (0, 1) and report.problems_total == 1
    assert "2 record(s) claim a place outside this job of 2 ranks" in report.problems[0]
    if rank["global_rank"] >= 2:
        assert f"rank {rank['global_rank']} " not in format_text(report).replace(report.problems[0], "")


@pytest.mark.slow
def test_pipeline_transfers_in_a_job_without_a_pipeline_are_a_conflict(real_runs, tmp_path):
    """The fifth round's "the pipeline link pp0 -> pp0" that replaced a right verdict."""
    def links(lines: Lines) -> Lines:
        first(lines, "nonfinite_grad_norm")["pipeline_links"] = {
            "received_forward": {"transfers": 2, "first_nonfinite": 0, "unchecked": 0},
            "sent_forward": {"transfers": 2, "first_nonfinite": None, "unchecked": 0}}
        return lines

    incident = forged(real_runs, tmp_path, {RANK1: links}).incident
    assert incident.verdict.rule == "records_conflict" and "pp0 -> pp0" not in incident.verdict.summary
    assert "rank 1's record lists pipeline transfers, and its rank is in no pipeline" \
        in incident.verdict.summary


@pytest.mark.slow
@pytest.mark.parametrize("change, why", [
    ({"replicas": 5}, "'replicas' 5, where its rank holds one of 2 data-parallel copies"),
    ({"replicas": 1}, "'replicas' 1"),
    ({"differing_ranks": [1, 99]}, "'differing_total' 1 with 2 listed"),
    ({"differing_ranks": [-1], "differing_total": 1}, "a differing rank outside its world of 2 ranks"),
    ({"agreeing": 3}, "'agreeing' 3 of 2 replicas"),
    ({"last_equal_step": 4}, "'last_equal_step' 4 not before the check's step 2"),
])
def test_a_replica_check_no_check_writes_is_a_problem_not_a_verdict(real_runs, tmp_path, unforged, change,
                                                                    why):
    def divergence(lines: Lines) -> Lines:
        record = {**a_divergence_record(), "step": 2, "rank": first(lines, "state")["rank"],
                  "run": first(lines, "state")["run"], "replicas": 2, "agreeing": None,
                  "differing_ranks": [1], "differing_total": 1}
        return lines + [{**record, **change}]

    report = forged(real_runs, tmp_path, {RANK1: divergence})
    _same_verdict(report, unforged)
    assert len(report.problems) == 1 and why in report.problems[0], report.problems


@pytest.mark.slow
def test_a_differing_value_equal_to_the_majoritys_is_a_problem(real_runs, tmp_path, unforged):
    def divergence(lines: Lines) -> Lines:
        record = {**a_divergence_record(), "step": 2, "rank": first(lines, "state")["rank"],
                  "run": first(lines, "state")["run"], "replicas": 2, "agreeing": None,
                  "differing_ranks": [1], "differing_total": 1}
        record["diverged"] = [{**record["diverged"][0], "value": 0.5, "majority_value": 0.5}]
        return lines + [record]

    report = forged(real_runs, tmp_path, {RANK1: divergence})
    _same_verdict(report, unforged)
    assert "a 'value' equal to the majority's" in report.problems[0]


@pytest.mark.slow
@pytest.mark.parametrize("origin_rank", [7, -1])
def test_a_rerun_origin_outside_the_world_is_a_problem(real_runs, tmp_path, origin_rank):
    def origin(lines: Lines) -> Lines:
        first(lines, "rerun")["origin_rank"] = origin_rank
        return lines

    report = forged(real_runs, tmp_path, {RANK0: origin})
    assert any(f"'origin_rank' {origin_rank} is no rank of its world of 2 ranks" in problem
               for problem in report.problems)
    shown = format_text(report)
    for problem in report.problems:
        shown = shown.replace(problem, "")
    assert f"rank {origin_rank}" not in shown and f"origin_rank {origin_rank}" not in shown


@pytest.mark.slow
def test_two_verdicts_of_megatron_on_one_job_are_a_conflict(real_runs, tmp_path):
    def job(verdict: str) -> Callable[[Lines], Lines]:
        def edit(lines: Lines) -> Lines:
            first(lines, "rerun")["observed"]["megatron_job"] = verdict
            return lines
        return edit

    incident = forged(real_runs, tmp_path, {RANK0: job("reproducible"), RANK1: job("transient")}).incident
    assert incident.verdict.rule == "records_conflict"
    assert ("Megatron's verdict on the job is reproducible in rank 0's rerun record and transient in"
            " rank 1's") in incident.verdict.summary


@pytest.mark.slow
def test_finite_own_gradients_beside_a_record_of_nonfinite_ones_are_a_conflict(real_runs, tmp_path):
    def finite(lines: Lines) -> Lines:
        first(lines, "rerun")["observed"]["own_gradients"] = "finite"
        return lines

    incident = forged(real_runs, tmp_path, {RANK0: finite}).incident
    assert incident.verdict.rule == "records_conflict" and incident.verdict.cause.value == "undetermined"
    assert "rank 0's rerun record says its replica's own gradients were finite" in incident.verdict.summary


# --- the same contradictions in a tensor-parallel job (records as the writers write them) -----------------

def _write(tmp_path: Path, lines: Lines) -> Path:
    for line in lines:
        path = tmp_path / "records" / f"rank{line['rank']['global_rank']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(line) + "\n")
    return tmp_path


def _rerun(rank: int, **observed: Any) -> Dict[str, Any]:
    seen = {"reproduced": True, "loss": "nonfinite", "loss_again": "nonfinite", "own_gradients": "nonfinite",
            "norm_overflow": False, "megatron_job": None, **observed}
    return records.to_json("rerun", 2, 2, coords(rank), {}, [], 0,
                           {"role": "origin" if rank == 0 else "receiver", "observed": seen,
                            "module": "decoder.layers.0.mlp", "class": "MLP", "micro_batch": 0,
                            "origin_rank": 0, "trigger": "grad_norm"})


def test_tensor_parallel_peers_that_observed_differently_are_a_conflict(tmp_path):
    """Ranks 0 and 1 are the two tensor-parallel ranks of replica 0: their ``observed`` is one all-reduced
    value; a file saying otherwise makes the verdict undetermined, not the origin's side taken."""
    run_dir = _write(tmp_path, [_rerun(0), _rerun(1, reproduced=False)])
    incident = analyze(read_run(run_dir)).incident
    assert incident.verdict.rule == "records_conflict"
    assert "ranks 0 and 1 ran the step again in one data-parallel replica" in incident.verdict.summary
    agreeing = analyze(read_run(_write(tmp_path / "agree", [_rerun(0), _rerun(1)]))).incident
    assert agreeing.verdict.rule != "records_conflict"


def test_a_replica_check_naming_a_tensor_parallel_peer_is_a_conflict(tmp_path):
    """Rank 1 (tp1 of replica 0) naming rank 0 (tp0 of the same replica) among the differing data-parallel
    copies: the check compares data-parallel peers only (the fifth round's "tensor-parallel peers called 2
    data-parallel replicas")."""
    writer = coords(1)
    record = {**a_divergence_record(), "rank": writer, "step": 2, "replicas": 2, "agreeing": None,
              "differing_ranks": [1, 0], "differing_total": 2}
    incident = analyze(read_run(_write(tmp_path, [record, {**record, "rank": coords(0)}]))).incident
    assert incident.verdict.rule == "records_conflict"
    assert "names rank 0 among the data-parallel copies that differ, and rank 0 is not a data-parallel peer" \
        in incident.verdict.summary
    peers = {**record, "rank": coords(3), "differing_ranks": [3, 1], "differing_total": 2}
    assert analyze(read_run(_write(tmp_path / "peers", [peers, {**peers, "rank": coords(1)}]))
                   ).incident.verdict.rule == "replica_diverged"


# --- counts and indexes no writer writes ------------------------------------------------------------------

def _probe_record(**changes: Any) -> Dict[str, Any]:
    probe = {"label": "x", "module": "decoder", "step": 1, "recompute": False, "nan": 1, "inf": 0,
             "abs_min": 0.5, "abs_max": 2.0, "shape": [2], "dtype": "torch.float16"}
    return records.to_json("probe", 1, None, coords(0), {}, [], 0,
                           {"probes": [{**probe, **changes.pop("probe", {})}], "probes_total": 1, **changes})


@pytest.mark.parametrize("changes, said", [
    ({"probes_total": 2**62}, "'probes_total' must be an integer from the probes listed (1) to 1000000000"),
    ({"probes_total": 0}, "'probes_total' must be an integer from the probes listed (1)"),
    ({"probe": {"nan": -3}}, "counts 'nan'/'inf' (integers from 0)"),
])
def test_a_probe_count_no_writer_writes_is_a_problem(changes, said):
    """The fifth round's "... and 4611686018427387900 more probe finding(s)" and "-3 NaN"."""
    assert records.from_json(_probe_record(), "f:1")["probes_total"] == 1
    with pytest.raises(InputError, match=re.escape(said)):
        records.from_json(_probe_record(**changes), "f:1")


@pytest.mark.parametrize("index", [10**18, -3, "past the last", True])
def test_a_trace_naming_an_op_it_does_not_hold_is_refused(index):
    """The fifth round's ``capture op #1000000000000000000`` and ``#-3``: the first non-finite op of a
    trace is one of its ops (here the only one, at index 0)."""
    from torch import nn

    from .test_trace import record as record_call

    module = nn.Linear(2, 2).half()
    with torch.no_grad():
        module.weight.fill_(6e4)
    trace, _ = record_call(module, torch.full((1, 2), 6e4, dtype=torch.float16))
    document = trace.to_json()
    assert document["first_nonfinite"] is not None
    index = len(document["ops"]) if index == "past the last" else index
    Trace.from_json(document, trace.leaves)
    with pytest.raises(TraceError, match="its index that of one of the trace's ops"):
        Trace.from_json({**document, "first_nonfinite": {**document["first_nonfinite"], "index": index}},
                        trace.leaves)


def test_a_replay_command_is_for_the_call_the_text_names(tmp_path):
    """The fifth round's two ranks claiming the rerun's origin role: the replay command was for the other
    rank's capture (another module) than the one the text names. Only a capture of the named call is
    offered; here none, so no replay line."""
    named, other = _rerun(0), _rerun(2, megatron_job=None)
    other.update(role="origin", module="decoder.layers.1.mlp", bundle=str(tmp_path / "bundles" / "elsewhere"))
    report = analyze(read_run(_write(tmp_path, [named, other])))
    text = format_text(report)
    assert report.incident.rerun.module == "decoder.layers.0.mlp" and report.incident.rerun.bundle is None
    assert "gradnan replay" not in text
    same = {**other, "module": "decoder.layers.0.mlp"}
    tied = analyze(read_run(_write(tmp_path / "same", [named, same]))).incident
    assert tied.rerun.bundle == other["bundle"]


@pytest.mark.slow
def test_a_file_claiming_another_ranks_place_is_a_conflict(real_runs, tmp_path):
    """The fifth round's rank file claiming another rank: two devices for one rank in one report."""
    def elsewhere(lines: Lines) -> Lines:
        record = first(lines, "nonfinite_grad_norm")
        return lines + [{**record, "rank": {**record["rank"], "global_rank": 0, "dp": 0, "host": "node-9",
                                            "device": "cuda:7"}}]

    incident = forged(real_runs, tmp_path, {RANK1: elsewhere}).incident
    assert incident.verdict.rule == "records_conflict"
    assert "rank 0's records at this step name 2 places for it" in incident.verdict.summary


def _state(rank: int, rows: int) -> Dict[str, Any]:
    row = {"name": "embedding.word_embeddings.weight", "rows": rows, "row": 3, "largest": 1e30,
           "median": 0.05, "every_step": True}
    return records.to_json("state", 2, 2, coords(rank), {}, [], 0, {
        "weights_digest": f"d{rank}", "params_checked": 4, "optimizer_state_total": 0,
        "optimizer_state_checked": 0, "optimizer_state": [], "outlying_rows": [row]})


def test_tensor_parallel_shards_of_one_vocabulary_with_different_row_counts_are_a_conflict(tmp_path):
    """The fifth round's TP shards with different row counts: the token a row holds is ``tp * rows + row``,
    so no token can be named from them."""
    norm = records.to_json("nonfinite_grad_norm", 2, 2, coords(0), {}, [], 0, {"grad_norm": "nan"})
    incident = analyze(read_run(_write(tmp_path, [norm, _state(0, 64), _state(1, 32)]))).incident
    assert incident.verdict.rule == "records_conflict"
    assert "ranks 0 and 1 hold shards of embedding.word_embeddings.weight with different row counts" \
        in incident.verdict.summary
    even = analyze(read_run(_write(tmp_path / "even", [norm, _state(0, 64), _state(1, 64)]))).incident
    assert even.verdict.rule == "embedding_row"
