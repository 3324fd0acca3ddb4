"""The run-up without a job: the device ring (order, wrap-around), the reader's validation of hostile
``gradnan.runup`` files (problems, never exceptions), and the growth rule of
``gradnan.offline.incident.runup``."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest
import torch

from gradnan.config import GradnanConfig
from gradnan.errors import ConfigError
from gradnan.formats import records, runup
from gradnan.formats.incident import RunUpFinding
from gradnan.formats.layout import RECORDS_DIR, RUNUP_DIR
from gradnan.formats.safe_write import append_json_line
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report, format_text
from gradnan.offline.incident.runup import GROWTH_FACTOR, MIN_BASELINE_STEPS, RECENT_STEPS, decide
from gradnan.training.runup import BucketGroupRing, RunUp

from .test_records_reader import coords

RUN = {"id": "job1", "attempt": "0", "started": 1.0, "rendezvous": None}
CULPRIT = "decoder.layers.0.mlp.linear_fc1.weight"
BUCKETS = [{"bucket": 0, "numel": 64, "params": ["decoder.layers.1.mlp.linear_fc2.weight"]},
           {"bucket": 1, "numel": 64, "params": [CULPRIT, "decoder.layers.0.mlp.linear_fc1.bias"]}]


def a_runup(rank: int, culprit_values: Sequence[Any], step: int = None, first_step: int = 1,
            other: float = 0.5) -> Dict[str, Any]:
    steps = list(range(first_step, first_step + len(culprit_values)))
    group = {"bucket_group": 0, "steps": steps, "buckets": BUCKETS,
             "values": [[other, value] for value in culprit_values]}
    return runup.to_json(coords(rank, dp=rank, dp_size=2, world_size=2), RUN, step or steps[-1], None,
                         [group])


def decided(documents: List[Dict[str, Any]], parameter: str = CULPRIT):
    return decide(((doc, doc["groups"]) for doc in documents), parameter, documents[0]["step"])


# -- the ring on the device ------------------------------------------------------------------------------

def test_the_ring_keeps_the_last_steps_oldest_first_and_wraps():
    ring = BucketGroupRing(0, 3, torch.zeros(2), lambda group: BUCKETS)
    for step in range(1, 6):
        ring.write(step, torch.tensor([float(step), 10.0 * step]))
    document = ring.to_json(None)
    assert document["steps"] == [3, 4, 5]
    assert document["values"] == [[3.0, 30.0], [4.0, 40.0], [5.0, 50.0]]
    assert document["buckets"] == BUCKETS


def test_a_ring_not_yet_full_holds_only_the_steps_written_and_nonfinite_values_as_json_text():
    ring = BucketGroupRing(2, 4, torch.zeros(2), lambda group: BUCKETS)
    ring.write(7, torch.tensor([1.0, math.inf]))
    ring.write(8, torch.tensor([math.nan, 2.0]))
    assert ring.to_json(None) == {"bucket_group": 2, "steps": [7, 8], "buckets": BUCKETS,
                              "values": [[1.0, "inf"], ["nan", 2.0]]}


class Group:
    """Stands in for a Megatron bucket group: the ring only keys on it (weakly) and hands it back."""

    def __init__(self, buckets: List[Dict[str, Any]]) -> None:
        self.buckets = buckets


def _contents(group: Group) -> List[Dict[str, Any]]:
    return group.buckets


def test_groups_come_in_bucket_group_order_and_capacity_zero_keeps_nothing():
    kept, off = RunUp(2), RunUp(0)
    first, second = Group(BUCKETS), Group(BUCKETS[:1])
    for keeper in (kept, off):
        keeper.write(second, 1, 1, torch.ones(1), _contents)
        keeper.write(first, 0, 1, torch.ones(2), _contents)
    assert [(group["bucket_group"], group["buckets"]) for group in kept.to_json()] == [(0, BUCKETS),
                                                                                       (1, BUCKETS[:1])]
    assert off.to_json() == []


def test_a_ring_goes_with_its_bucket_group():
    """A rebuilt model's old groups (and their device tensors) are not kept alive by the run-up."""
    kept, group = RunUp(2), Group(BUCKETS)
    kept.write(group, 0, 1, torch.ones(2), _contents)
    del group
    gc.collect()
    assert kept.to_json() == []


@pytest.mark.parametrize("value", [-1, runup.MAX_RUNUP_STEPS + 1])
def test_runup_steps_out_of_range_is_a_config_error(value):
    with pytest.raises(ConfigError, match="runup_steps"):
        GradnanConfig(runup_steps=value)


# -- the rule ---------------------------------------------------------------------------------------------

STEADY = [0.2, 0.25, 0.22, 0.3, 0.21, 0.24, 0.26, 0.23, 0.25]


def test_a_bucket_that_grew_on_one_rank_is_found_with_its_onset():
    growing = STEADY[:5] + [5.0, 50.0, 500.0, 5000.0, "inf"]
    result = decided([a_runup(0, STEADY + ["inf"]), a_runup(1, growing)])
    assert result.finding is RunUpFinding.GREW
    assert result.first_ranks == (1,)
    assert result.onset == 6 and result.step == 10
    assert "first on rank 1" in result.summary and "4 step(s) before it" in result.summary
    by_rank = {rank.global_rank: rank for rank in result.ranks}
    assert by_rank[0].grew is False and by_rank[1].grew is True
    assert by_rank[1].values[-1] == "inf"  # the failing step's own value kept for the plot


def test_the_rank_where_it_grew_earliest_is_first_and_a_tie_names_both():
    early = STEADY[:4] + [3.0, 30.0, 300.0, 3000.0, 30000.0, "nan"]
    late = STEADY[:6] + [30.0, 300.0, 3000.0, "nan"]
    assert decided([a_runup(0, late), a_runup(1, early)]).first_ranks == (1,)
    tie = decided([a_runup(0, early), a_runup(1, early)])
    assert tie.first_ranks == (0, 1) and "rank 0" in tie.summary and "rank 1" in tie.summary


def test_steady_gradients_then_a_nan_did_not_grow():
    result = decided([a_runup(0, STEADY + ["nan"]), a_runup(1, STEADY + [0.3])])
    assert result.finding is RunUpFinding.SUDDEN
    assert result.first_ranks == () and result.onset is None
    assert "did not grow" in result.summary


def test_too_few_steps_does_not_decide_and_says_why():
    short = STEADY[:MIN_BASELINE_STEPS + RECENT_STEPS - 1] + ["inf"]
    result = decided([a_runup(0, short)])
    assert result.finding is RunUpFinding.UNDECIDED
    assert f"at most {len(short) - 1} finite step(s) before it" in result.summary
    assert f"needs {MIN_BASELINE_STEPS + RECENT_STEPS}" in result.summary
    skipped = decided([a_runup(0, ["inf"] * 5 + STEADY[:4] + ["inf"])])  # fp16 skips are not counted
    assert skipped.finding is RunUpFinding.UNDECIDED and "at most 4 finite step(s)" in skipped.summary


def test_a_culprit_in_no_bucket_or_none_named_does_not_decide():
    documents = [a_runup(0, STEADY + ["inf"])]
    assert "in no bucket" in decided(documents, "no.such.weight").summary
    unnamed = decide(((doc, doc["groups"]) for doc in documents), None, 10)
    assert unnamed.finding is RunUpFinding.UNDECIDED and "no culprit" in unnamed.summary


def test_growth_from_an_all_zero_bucket_counts_and_a_zero_bucket_that_stays_zero_does_not():
    assert decided([a_runup(0, [0.0] * 7 + [1e-3, "inf"])]).finding is RunUpFinding.GREW
    assert decided([a_runup(0, [0.0] * 8 + ["inf"])]).finding is RunUpFinding.SUDDEN


def test_just_under_the_growth_factor_is_not_growth():
    edge = [1.0] * 6 + [GROWTH_FACTOR * 0.99] * 3 + ["inf"]
    assert decided([a_runup(0, edge)]).finding is RunUpFinding.SUDDEN
    assert decided([a_runup(0, [1.0] * 6 + [GROWTH_FACTOR] * 3 + ["inf"])]).finding is RunUpFinding.GREW


def test_nonfinite_rows_before_the_failing_step_are_left_out_of_the_rule():
    """fp16's routine skips leave Inf rows in the ring: not growth, and not in the baseline."""
    skips = ["inf", "inf"] + STEADY + ["inf"]
    result = decided([a_runup(0, skips)])
    assert result.finding is RunUpFinding.SUDDEN


# -- the reader: hostile files are problems ------------------------------------------------------------------

def _run_dir(tmp_path: Path, documents: Dict[str, Any]) -> Path:
    """A run directory with one incident record (rank 0, step 10) and the given run-up files (raw text or
    documents)."""
    record = records.to_json("nonfinite_grad_norm", 10, None, coords(0, dp_size=2, world_size=2), RUN, [
        {"name": CULPRIT, "nan": 0, "inf": 1, "abs_max_finite": 0.5, "id": 1}], 1,
        {"grad_norm": "inf", "pre_reduction": "nonfinite"})
    append_json_line(tmp_path / RECORDS_DIR / "rank00000_tp0_pp0_dp0.jsonl", record)
    (tmp_path / RUNUP_DIR).mkdir()
    for name, document in documents.items():
        raw = document if isinstance(document, bytes) else (
            document if isinstance(document, str) else json.dumps(document)).encode()
        (tmp_path / RUNUP_DIR / name).write_bytes(raw)
    return tmp_path


def _with(document: Dict[str, Any], **group_changes: Any) -> Dict[str, Any]:
    return {**document, "groups": [{**document["groups"][0], **group_changes}]}


GOOD = a_runup(0, STEADY + ["inf"])
ELSEWHERE = {**GOOD, "groups": [{**GOOD["groups"][0], "buckets": [  # the same, not naming the culprit
    {**bucket, "params": [name.replace(CULPRIT, "other.weight") for name in bucket["params"]]}
    for bucket in BUCKETS]}]}
HOSTILE = {
    "not_json": "{\"schema\": ",
    "not_an_object": "[1, 2, 3]",
    "wrong_schema": json.dumps({**GOOD, "schema": "gradnan.record"}),
    "newer_version": json.dumps({**GOOD, "version": 99}),
    "wrong_statistic": json.dumps({**GOOD, "statistic": "sum_of_squares"}),
    "groups_not_a_list": json.dumps({**GOOD, "groups": {"0": 1}}),
    "row_too_short": json.dumps(_with(GOOD, values=[[0.5]] + GOOD["groups"][0]["values"][1:])),
    "row_too_long": json.dumps(_with(GOOD, values=[[0.5, 0.5, 0.5]] + GOOD["groups"][0]["values"][1:])),
    "rows_fewer_than_steps": json.dumps(_with(GOOD, values=GOOD["groups"][0]["values"][:-1])),
    "negative_magnitude": json.dumps(_with(GOOD, values=[[-1.0, 0.5]] * 10)),
    "text_magnitude": json.dumps(_with(GOOD, values=[["big", 0.5]] * 10)),
    "boolean_magnitude": json.dumps(_with(GOOD, values=[[True, 0.5]] * 10)),
    "nan_literal": json.dumps(_with(GOOD, values=[[math.nan, 0.5]] * 10)),  # json.dumps writes NaN
    "minus_inf": json.dumps(_with(GOOD, values=[["-inf", 0.5]] * 10)),
    "steps_not_increasing": json.dumps(_with(GOOD, steps=[1, 2, 3, 3, 5, 6, 7, 8, 9, 10])),
    "steps_not_integers": json.dumps(_with(GOOD, steps=[1.5] * 10)),
    "too_many_steps": json.dumps(_with(GOOD, steps=list(range(runup.MAX_RUNUP_STEPS + 1)),
                                       values=[[0.5, 0.5]] * (runup.MAX_RUNUP_STEPS + 1))),
    "bucket_without_params": json.dumps(_with(GOOD, buckets=[{"bucket": 0, "numel": 1}, BUCKETS[1]])),
    "param_name_not_text": json.dumps(_with(GOOD, buckets=[{"bucket": 0, "numel": 1, "params": [7]},
                                                           BUCKETS[1]])),
    "no_buckets": json.dumps(_with(GOOD, buckets=[], values=[[]] * 10)),
    "huge_integer_step": json.dumps({**GOOD, "step": 10 ** 400}),
    "group_twice": json.dumps({**GOOD, "groups": GOOD["groups"] * 2}),
    "too_many_buckets": json.dumps(_with(GOOD, steps=[1], buckets=[BUCKETS[0]] * (runup.MAX_BUCKETS + 1),
                                         values=[[0.5] * (runup.MAX_BUCKETS + 1)])),
    "deeply_nested": "[" * 100000 + "]" * 100000,
    "not_utf8": b"\xff\xfe{",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_runup_file_is_one_problem_and_the_report_goes_on(tmp_path, name):
    run_dir = _run_dir(tmp_path, {f"rank00000_tp0_pp0_dp0_step0000010_{name}.json": HOSTILE[name]})
    files = read_run(run_dir)
    assert len(files.problems) == 1 and name in files.problems[0], files.problems
    assert files.runups == {}
    report = analyze(files)
    assert report.incident is not None and report.incident.runup is None
    assert "Files that could not be read: 1" in format_text(report)


def test_a_good_runup_beside_a_hostile_one_is_read_and_decides(tmp_path):
    files = read_run(_run_dir(tmp_path, {"a.json": GOOD, "b.json": HOSTILE["row_too_short"]}))
    assert len(files.problems) == 1
    runup_json = build_report(files)["incident"]["runup"]
    assert runup_json["finding"] == "sudden" and runup_json["parameter"] == CULPRIT
    assert [rank["global_rank"] for rank in runup_json["ranks"]] == [0]


def test_a_runup_of_another_launch_or_step_is_not_this_incidents(tmp_path):
    other_launch = {**GOOD, "run": {**RUN, "id": "job2"}}
    other_step = a_runup(0, STEADY + ["inf"], step=9, first_step=0)
    files = read_run(_run_dir(tmp_path, {"a.json": other_launch, "b.json": other_step}))
    assert not files.problems
    assert analyze(files).incident.runup is None


def test_read_without_params_lists_the_runups_and_reads_them_when_the_report_needs_them(tmp_path):
    files = read_run(_run_dir(tmp_path, {"a.json": GOOD}), params=False)
    assert files.runups == {} and files.runups_unread == ["a.json"]
    [(path, document)] = files.all_runups()
    assert path == tmp_path / RUNUP_DIR / "a.json" and document["groups"] == GOOD["groups"]
    assert analyze(files).incident.runup.finding is RunUpFinding.SUDDEN


def test_read_without_params_parses_only_the_runups_that_name_the_culprit(tmp_path, monkeypatch):
    """A run-up whose bytes cannot name the culprit parameter is never parsed, and the finding is the same
    as where every file was read whole."""
    other_rank = {**ELSEWHERE, "rank": {**GOOD["rank"], "global_rank": 1}}
    run_dir = _run_dir(tmp_path, {"a.json": GOOD, "b.json": other_rank})
    parsed = []
    monkeypatch.setattr(runup, "from_json", lambda document, where: parsed.append(where) or document)
    lean = build_report(read_run(run_dir, params=False))
    assert parsed == [str(run_dir / RUNUP_DIR / "a.json")]  # once
    monkeypatch.undo()
    assert lean == build_report(read_run(run_dir))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_runup_read_lean_gives_the_report_read_whole(tmp_path, name):
    """``gradnan report`` reads run-ups lean (``params=False``): a hostile file is still one problem (read
    where none names the culprit, to say whether any rank wrote one), and the report is the one read
    whole."""
    run_dir = _run_dir(tmp_path, {f"rank00000_tp0_pp0_dp0_step0000010_{name}.json": HOSTILE[name]})
    report = build_report(read_run(run_dir, params=False))
    assert len(report["problems"]) == 1 and name in report["problems"][0]
    assert report == build_report(read_run(run_dir))


def test_a_position_whose_first_replica_cannot_name_the_culprit_is_searched_no_further(tmp_path,
                                                                                       monkeypatch):
    """Data-parallel replicas step the same parameters: where the first replica's run-up of a model-parallel
    position cannot name the culprit, its other replicas' files are not read; where it can, each is."""
    names = {f"rank0000{dp}_tp0_pp0_dp{dp}_step0000010.json": {**GOOD, "rank": {**GOOD["rank"], "dp": dp,
                                                                               "global_rank": dp}}
             for dp in range(2)}
    names.update({f"rank0000{2 + dp}_tp0_pp1_dp{dp}_step0000010.json": {
        **ELSEWHERE, "rank": {**GOOD["rank"], "pp": 1, "pp_size": 2, "dp": dp, "global_rank": 2 + dp,
                              "world_size": 4}} for dp in range(2)})
    run_dir = _run_dir(tmp_path, names)
    read, real = [], runup.read_bytes
    monkeypatch.setattr(runup, "read_bytes",
                        lambda path, *bound: read.append(Path(path).name) or real(path, *bound))
    lean = build_report(read_run(run_dir, params=False))
    assert sorted(read) == sorted(names)[:3]  # pp1's second replica: not read
    assert [rank["global_rank"] for rank in lean["incident"]["runup"]["ranks"]] == [0, 1]
    monkeypatch.undo()
    assert lean == build_report(read_run(run_dir))
