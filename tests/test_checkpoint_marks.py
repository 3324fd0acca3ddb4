"""Issue 49 (checkpoint marks) and issue 48 case 7, unit level: what a rank marks at a save
(``weights.checkpoint_mark``), the record's validation, which save the restart advice names (the newest
known clean, never one written after the failure such as Megatron's exit save), and ``gradnan
checkpoints``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradnan.cli import main
from gradnan.decision.facts import Fact
from gradnan.errors import InputError
from gradnan.events import ParamTensors, StepState
from gradnan.formats import records
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.checkpoints import newest_clean, saves_of
from gradnan.offline.incident.read import RunFiles, read_run
from gradnan.offline.incident.report import format_text
from gradnan.training.weights import checkpoint_mark, weights_digest

from .test_weights_unit import slot

WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
RUN = {"id": "job", "attempt": "0", "started": 1.0, "rendezvous": None}


def held(weight_value=1.0, main_value=1.0, moment_value=0.0) -> StepState:
    weight = torch.full((2, 3), weight_value, dtype=torch.bfloat16)
    main = torch.full((2, 3), main_value)
    moments = {"exp_avg": torch.full((2, 3), moment_value), "exp_avg_sq": torch.zeros(2, 3)}
    bias = torch.ones(3)
    return StepState([(WEIGHT, weight), ("b.bias", bias)], [slot(0, WEIGHT, (2, 3)), slot(1, "b.bias", (3,))],
                     [ParamTensors(weight, main, moments),
                      ParamTensors(bias, None, {"exp_avg": torch.zeros(3)})])


def test_a_clean_state_is_marked_clean_with_the_weights_digest_of_the_state_record():
    mark = checkpoint_mark(held())
    assert mark["clean"] is True and mark["nonfinite"] == [] and mark["nonfinite_total"] == 0
    assert mark["checked"] == {"weight": 2, "main": 1, "moment": 3}
    assert mark["weights_digest"] == weights_digest(held().weights)


@pytest.mark.parametrize("state, found", [
    (dict(weight_value=float("nan"), main_value=float("nan")), [(WEIGHT, "weight"), (WEIGHT, "main")]),
    (dict(main_value=float("inf")), [(WEIGHT, "main")]),  # the model's copy finite, the stepped one not
    (dict(moment_value=float("nan")), [(WEIGHT, "exp_avg")]),
])
def test_a_non_finite_weight_main_copy_or_moment_makes_the_save_not_clean(state, found):
    mark = checkpoint_mark(held(**state))
    assert mark["clean"] is False
    assert [(entry["name"], entry["tensor"]) for entry in mark["nonfinite"]] == found
    assert mark["nonfinite_total"] == len(found)


def mark_record(save, iteration, rank, time, clean=True, after_incident=None, world_size=2):
    coords = {"global_rank": rank, "tp": 0, "pp": 0, "dp": rank, "dp_size": world_size,
              "world_size": world_size, "host": "h", "device": "cpu"}
    fields = checkpoint_mark(held() if clean else held(weight_value=float("nan"), main_value=float("nan")))
    record = records.to_json("checkpoint", 2, None, coords, RUN, [], 0, {
        "saved_iteration": iteration, "checkpoint": f"/ckpt/iter_{iteration:07d}", "save": save,
        "after_incident": after_incident, **fields})
    record["time"] = time
    return record


def test_the_reader_takes_a_mark_and_refuses_one_whose_fields_disagree():
    good = mark_record(1, 1, 0, 10.0)
    assert records.from_json(json.loads(json.dumps(good)), "r:1")["clean"] is True
    for broken in ({"clean": False}, {"nonfinite_total": "1"}, {"checked": {"weight": 1}},
                   {"nonfinite": [{"name": 3}]}, {"saved_iteration": 1.5}, {"weights_digest": None}):
        with pytest.raises(InputError, match="a checkpoint record needs"):
            records.from_json({**good, **broken}, "r:1")


def failing_run(marks, megatron=True):
    """Iteration 3 fails on a weight of rank 1 gone NaN before it (two data-parallel replicas, rank 0's
    finite): its incident records at time 30, ``marks`` beside them."""
    def coords(rank):
        return {"global_rank": rank, "tp": 0, "pp": 0, "dp": rank, "dp_size": 2, "world_size": 2, "host": "h",
                "device": "cpu"}

    incident = []
    for rank in (0, 1):
        base = {"schema": "gradnan.record", "version": 2, "step": 3, "iteration": 3, "time": 30.0,
                "rank": coords(rank), "run": RUN}
        bad = [{"id": 0, "name": WEIGHT, "copy": "model", "nan": 1, "inf": 0, "first_bad_index": [0, 0]}]
        incident.append({**base, "kind": "pre_reduction", "params": [{"id": 0, "name": WEIGHT, "nan": 6,
                                                                       "inf": 0, "order": 0}],
                         "params_total": 1, "pre_reduction": "nonfinite"})
        incident.append({**base, "kind": "state", "params": bad if rank == 1 else [],
                         "params_total": rank, "weights_digest": f"d{rank}", "params_checked": 2,
                         "optimizer_state_total": 0, "optimizer_state_checked": 2, "optimizer_state": []})
        if megatron:
            incident.append({**base, "kind": "rerun", "trigger": "megatron_validation", "params": [],
                             "params_total": 0, "megatron": "reproducible",
                             "role": "clean", "conclusion": "backward", "own_failure": None,
                             "micro_batch": 0, "module": None, "class": None, "bundle": None, "batch": None})
    return RunFiles(Path("/run"), records={Path("/run/records/r.jsonl"): incident + list(marks)})


REGULAR = [mark_record(1, 1, rank, 10.0 + rank) for rank in (0, 1)] + [
    mark_record(2, 2, rank, 20.0 + rank) for rank in (0, 1)]
# Megatron's exit save after the failure: labelled 2, written over the regular save of 2, NaN on rank 1
EXIT_SAVE = [mark_record(3, 2, rank, 40.0, clean=rank == 0, after_incident=3) for rank in (0, 1)]


def resume_step(files):
    report = analyze(files)
    [step] = [step for step in report.incident.next_steps if step.action.value == "resume"]
    return step, format_text(report)


def test_the_advice_names_the_newest_clean_save_and_never_the_exit_save_over_it():
    """Case 7: "older than iteration 3" would take the checkpoint of iteration 2, which Megatron's exit
    save rewrote after the failure with the NaN in it."""
    step, text = resume_step(failing_run(REGULAR + EXIT_SAVE))
    assert step.command == ("--ckpt-step", "1"), step.text
    assert step.text.startswith("restart from the checkpoint of iteration 1 (/ckpt/iter_0000001), the newest"
                                " known clean"), step.text
    assert "\n     --ckpt-step 1\n" in text


def test_without_the_exit_save_the_regular_save_before_the_failure_is_named():
    step, _ = resume_step(failing_run(REGULAR, megatron=False))
    assert step.command == ("--ckpt-step", "2")


def test_without_marks_the_advice_says_no_checkpoint_is_known_clean_and_why_and_warns_of_the_exit_save():
    step, _ = resume_step(failing_run([]))
    assert step.command is None
    assert "older than step 3 (iteration 3)" in step.text
    assert "not Megatron's exit save" in step.text
    assert ("No checkpoint is known clean: the run directory holds no checkpoint marks (to have them:"
            f" {Fact.CHECKPOINT_MARKS.how_to_observe})") in step.text


def test_a_save_one_rank_did_not_mark_is_not_known_clean():
    step, _ = resume_step(failing_run([REGULAR[0], *REGULAR[2:], *EXIT_SAVE]))  # rank 1 never marked save 1
    assert step.command is None and "No checkpoint is known clean: " in step.text
    saves = saves_of(REGULAR[:1] + REGULAR[2:] + EXIT_SAVE)
    known, why = newest_clean(saves, 30.0, 3)
    assert known is None
    assert ("the checkpoint of iteration 2 (/ckpt/iter_0000002) was written after the failure (the incident"
            " of step 3)") in why
    assert "was written over by a later save after the failure (not clean: non-finite on rank(s) 1" in why
    assert "is not known clean: marked by 1 of 2 ranks" in why


def test_gradnan_checkpoints_lists_each_save_and_why_one_is_not_clean(tmp_path, capsys):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "rank00000.jsonl").write_text(
        "".join(json.dumps(record) + "\n" for record in REGULAR + EXIT_SAVE))
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("the checkpoint of iteration 1 (/ckpt/iter_0000001)  launch job#0 save 1: clean")
    assert "save 3: not clean: non-finite on rank(s) 1:" in lines[2] and "(weight) on rank 1" in lines[2]
    assert "written after the incident of step 3 (do not restart from it)" in lines[2]
    assert main(["checkpoints", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(save["iteration"], save["clean"]) for save in listed] == [(1, True), (2, True), (2, False)]
    assert read_run(tmp_path).problems == []


def test_a_hostile_path_stays_on_its_line(tmp_path, capsys):
    forged = {**mark_record(1, 1, 0, 10.0), "checkpoint": "/ckpt\n2026-11-27 00:00:00 UTC  the checkpoint of"
              " iteration 9: clean"}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "rank00000.jsonl").write_text(json.dumps(forged) + "\n")
    assert main(["checkpoints", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_gradnan_checkpoints_without_marks_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "records").mkdir()
    [incident] = failing_run([]).records.values()
    (tmp_path / "records" / "rank00000.jsonl").write_text(json.dumps(incident[0]) + "\n")
    assert main(["checkpoints", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "no checkpoint marks" in error
    assert main(["checkpoints", str(tmp_path / "absent")]) == 2


def test_two_launches_read_as_one_keep_their_saves_apart():
    """A restart within minutes on the same rendezvous, without a run id, reads as one launch
    (``split_runs``): both launches' first save is save 1. Seen on pretrain_gpt.py: the restart's save of
    iteration 6 was counted as a second mark of iteration 1's, and vanished from the list."""
    restarted = [mark_record(1, 6, rank, 60.0 + rank) for rank in (0, 1)]
    saves = saves_of(REGULAR + restarted)
    assert [(save.number, save.iteration, save.ranks, save.clean) for save in saves] == [
        (1, 1, (0, 1), True), (2, 2, (0, 1), True), (1, 6, (0, 1), True)]
    again = [mark_record(1, 1, rank, 70.0 + rank) for rank in (0, 1)]  # the same save, again
    assert [(save.iteration, save.ranks) for save in saves_of(REGULAR + again)] == [
        (1, (0, 1)), (2, (0, 1)), (1, (0, 1))]


def test_a_second_moment_below_zero_makes_a_mark_not_clean():
    """Finite, so the finiteness scan passes it; the next update's square root of it is NaN."""
    state = held()
    state.stepped[0].state["exp_avg_sq"][0, 1] = -1.0
    mark = checkpoint_mark(state)
    assert mark["negative_moments"] == [{"name": WEIGHT, "tensor": "exp_avg_sq"}]
    assert mark["negative_total"] == 1
    record = {**mark_record(1, 1, 0, 10.0), **mark}
    assert records.from_json(json.loads(json.dumps(record)), "r:1")["negative_total"] == 1
    [save] = saves_of([record])
    assert not save.clean
    assert save.condition() == f"not clean: a second moment (exp_avg_sq) below zero: {WEIGHT} on rank 0"


def resumed_run(marks):
    """A launch resumed from the checkpoint of iteration 20 whose optimizer state held a negative second
    moment: its first update (step 1, iteration 21) wrote a NaN weight, found at step 2 (iteration 22)."""
    run = {"id": "job", "attempt": "1", "started": 50.0, "rendezvous": None}
    incident = []
    for rank in (0, 1):
        coords = {"global_rank": rank, "tp": 0, "pp": 0, "dp": rank, "dp_size": 2, "world_size": 2,
                  "host": "h", "device": "cpu"}
        base = {"schema": "gradnan.record", "version": 2, "step": 2, "iteration": 22, "time": 60.0,
                "rank": coords, "run": run}
        incident.append({**base, "kind": "pre_reduction", "params": [{"id": 0, "name": WEIGHT, "nan": 6,
                                                                       "inf": 0, "order": 0}],
                         "params_total": 1, "pre_reduction": "nonfinite"})
        bad = [{"id": 0, "name": WEIGHT, "copy": "model", "nan": 1, "inf": 0, "first_bad_index": [0, 0]}]
        incident.append({**base, "kind": "state", "params": bad, "params_total": 1, "weights_digest": "d",
                         "params_checked": 2, "optimizer_state_total": 1, "optimizer_state_checked": 2,
                         "launch_weights_finite": True,
                         "optimizer_state": [{"name": WEIGHT, "state": "exp_avg_sq", "nan": 0, "inf": 0,
                                              "negative": 1}]})
    return RunFiles(Path("/run"), records={Path("/run/records/r.jsonl"): incident + list(marks)})


@pytest.mark.parametrize("marked_negative", [True, False], ids=["marked", "marked_before_negative_moments"])
def test_a_bad_moment_that_came_with_the_resumed_checkpoint_restarts_from_the_one_before(marked_negative):
    """Issue 59 (6): "older than the update of step 1" admitted the resumed checkpoint itself. A mark that
    read its negative moment says so; one written before marks read them is left out by its iteration."""
    earlier = [mark_record(1, 10, rank, 10.0 + rank) for rank in (0, 1)]
    resumed = [mark_record(2, 20, rank, 20.0 + rank) for rank in (0, 1)]
    for mark in resumed:
        mark.update({"negative_moments": [{"name": WEIGHT, "tensor": "exp_avg_sq"}], "negative_total": 1}
                    if marked_negative else {})
    report = analyze(resumed_run(earlier + resumed))
    text = format_text(report)
    assert report.incident.verdict.rule == "optimizer_state", text
    assert "came with the checkpoint it resumed from" in report.incident.verdict.summary, text
    [step] = [step for step in report.incident.next_steps if step.action.value == "resume"]
    assert step.text.startswith("restart from the checkpoint of iteration 10 ("), step.text
    assert "older than the checkpoint this launch resumed from (iteration 20)" in step.text, step.text


def test_gradnan_checkpoints_lists_the_newest_saves_and_counts_the_older(tmp_path, capsys):
    """Issue 60: over 50,000 saves it printed 50,000 lines (and --json 800,002)."""
    marks = [mark_record(save, save, 0, float(save), world_size=1) for save in range(1, 131)]
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "rank00000.jsonl").write_text("".join(json.dumps(mark) + "\n" for mark in marks))
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "(30 older save(s) not shown: --last 130 lists them all)" and len(lines) == 101
    assert "iteration 31 " in lines[1] and "iteration 130 " in lines[-1]
    assert main(["checkpoints", str(tmp_path), "--json", "--last", "5"]) == 0
    out, err = capsys.readouterr()
    assert [save["iteration"] for save in json.loads(out)] == [126, 127, 128, 129, 130]
    assert err.strip() == "125 older save(s) not shown: --last 130 lists them all"


def _mark_as(rank, world_size, save=1, iteration=1):
    mark = mark_record(save, iteration, rank, 10.0 + rank, world_size=world_size)
    mark["rank"] = {**mark["rank"], "global_rank": rank, "dp": rank}
    return mark


@pytest.mark.parametrize("marks, why", [
    # ranks 0-2 and a rank 7 of a 4-rank job: rank 3 never marked it
    ([_mark_as(rank, 4) for rank in (0, 1, 2, 7)],
     "marked by 3 of 4 ranks, and 1 mark(s) from outside the job"),
    # one rank's mark claims a world of one, where the job's other records say four
    ([_mark_as(0, 1)], "marked by 0 of 4 ranks, and 1 mark(s) from outside the job"),
])
def test_marks_that_do_not_cover_the_jobs_ranks_cannot_make_a_save_clean(marks, why):
    """Issue 60: marks counted without checking the job."""
    job = [{**_mark_as(rank, 4, save=2, iteration=2), "kind": "pre_reduction"} for rank in range(4)]
    [save] = [save for save in saves_of(marks + job) if save.iteration == 1]
    assert not save.clean and save.condition() == f"not known clean: {why}"


def test_a_save_whose_data_parallel_copies_differ_is_not_known_clean():
    """Issue 60: every rank marked the save clean, yet rank 1's weights are not its data-parallel peer's (a
    silent corruption of one replica): which copy the checkpoint holds is not known, so the advice names
    the save before it."""
    unequal = REGULAR[:3] + [{**REGULAR[3], "weights_digest": "another"}]
    [first, second] = saves_of(unequal)
    assert first.clean and not second.clean
    assert second.condition() == ("not known clean: its data-parallel copies differ (the weight digests of"
                                  " ranks 0, 1), and which copy is right is not known")
    assert newest_clean(saves_of(unequal), 30.0, 3)[0].iteration == 1
    assert newest_clean(saves_of(REGULAR), 30.0, 3)[0].iteration == 2


def test_a_save_marked_after_the_failing_step_is_after_the_failure_whatever_its_time_says():
    """Issue 60: a save of the failing launch marked at step 5 (the failure is at step 3), its time stamp
    earlier than the failure's, with no iteration to compare (the records name none): restarting from it
    ("the checkpoint of iteration 99 ... --ckpt-step 99") would bring the failure back. The launch's steps
    are what its records agree on; its time stamps are not."""
    files = failing_run(REGULAR)
    for record in files.records[Path("/run/records/r.jsonl")]:
        record["iteration"] = None
    late = [{**mark_record(3, 99, rank, 25.0), "step": 5} for rank in (0, 1)]
    files.records[Path("/run/records/r.jsonl")] += late
    step, text = resume_step(files)
    assert step.text.startswith("restart from the checkpoint of iteration 2 ("), text
    assert "99" not in step.text + " ".join(step.command or ()), text
