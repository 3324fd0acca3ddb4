"""Report rules on hand-made records (pure: no Megatron): routine fp16 skips are not failures."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import RunFiles, collector_paused
from gradnan.offline.incident.report import build_report, format_text


def _record(step, kind, rank=0, params=(), **extra):
    coords = {"global_rank": rank, "tp": 0, "pp": 0, "dp": rank, "dp_size": 2, "host": "h", "device": "cpu"}
    return {"schema": "gradnan.record", "version": 1, "kind": kind, "step": step, "rank": coords,
            "params": [{"id": 1, "name": name, "nan": 0, "inf": 1, "order": 3} for name in params],
            "params_total": len(params), **extra}


def clean_states(records, step=2):
    """Each recording rank's ``state`` record of a run whose weights and optimizer state were finite when
    the failing step began (every recording rank reads them at the run's first incident)."""
    ranks = {record["rank"]["global_rank"]: record["rank"] for record in records}
    return [{**_record(step, "state", rank), "rank": dict(coords), "weights_digest": "equal",
             "params_checked": 1, "optimizer_state_total": 0, "optimizer_state_checked": 0,
             "optimizer_state": []} for rank, coords in sorted(ranks.items())]


def _files(*records):
    return RunFiles(Path("/run"), records={Path("/run/records/r.jsonl"): list(records)})


def _overflow(step, skips, collapsed=False, rank=0):
    return _record(step, "loss_scale_overflow", rank, ["decoder.layers.0.mlp.linear_fc1.weight"],
                   consecutive_skips=skips, scale_collapsed=collapsed, loss_scale=1024.0)


def test_isolated_fp16_skips_are_routine_not_a_failure():
    analysis = analyze(_files(_overflow(1, 1), _overflow(2, 2), _overflow(9, 1)))
    report = analysis.to_json()
    assert report["incident"] is None
    assert report["loss_scale_overflow_steps"] == [1, 2, 9]
    assert "routine fp16 loss-scale overflow" in format_text(analysis)


def test_a_run_of_skips_reaching_the_threshold_is_a_failure_from_where_it_began():
    records = [_overflow(1, 1), _overflow(5, 1), _overflow(6, 2), _overflow(7, 3)]
    report = build_report(_files(*records))
    assert report["first_step"] == 5


def test_the_threshold_is_configurable():
    assert build_report(_files(_overflow(5, 1), _overflow(6, 2)), serious_skips=2)["first_step"] == 5


def test_a_collapsed_scale_is_a_failure_at_once():
    assert build_report(_files(_overflow(4, 1, collapsed=True)))["first_step"] == 4


def test_a_skip_with_a_nonfinite_loss_is_a_failure_at_its_own_step_even_during_warm_up():
    """Skips before the first applied update are the scale warming up, unless the loss was non-finite:
    then the fault began at that step, not where the run of skips began."""
    warm = [{**_overflow(step, step), "warmup": True, "loss_finite": True} for step in (1, 2)]
    forward = {**_overflow(3, 3), "warmup": False, "loss_finite": False}
    assert build_report(_files(*warm))["first_step"] is None
    assert build_report(_files(*warm, forward))["first_step"] == 3


def test_a_nonfinite_grad_norm_is_always_a_failure():
    records = [_overflow(1, 1), _record(3, "nonfinite_grad_norm", params=["w"], pre_reduction="unchecked")]
    assert build_report(_files(*records))["first_step"] == 3


def test_a_pre_reduction_record_without_overflow_is_a_failure():
    """Megatron's own check raised after our sync record: no norm record follows."""
    records = [_record(2, "pre_reduction", rank=1, params=["decoder.layers.0.mlp.linear_fc1.weight"],
                       mode="sync")]
    report = build_report(_files(*records))
    assert report["first_step"] == 2
    assert [e["global_rank"] for e in report["incident"]["origin"]] == [1]


def _in_run(record, run_id=None, attempt=0, started=1000.0):
    return {**record, "run": {"id": run_id, "attempt": attempt, "started": started}}


def test_restarts_into_one_directory_stay_apart_and_the_latest_failure_is_shown():
    first = _in_run(_record(5, "nonfinite_grad_norm", params=["a.w"], pre_reduction="unchecked"), "job7", 0)
    second = _in_run(_record(2, "nonfinite_grad_norm", params=["b.w"], pre_reduction="unchecked"), "job7", 1)
    report = build_report(_files(first, second))
    assert report["run"] == "job7#1" and report["first_step"] == 2
    assert [r["run"] for r in report["runs"]] == ["job7#0", "job7#1"]
    assert build_report(_files(first, second), run="job7#0")["first_step"] == 5


def test_launches_without_an_id_are_told_apart_by_start_time():
    early = _in_run(_record(5, "nonfinite_grad_norm", params=["a.w"]), started=1000.0)
    same_launch = _in_run(_record(5, "nonfinite_grad_norm", rank=1), started=1003.0)
    late = _in_run(_overflow(2, 1), started=5000.0)
    report = build_report(_files(early, same_launch, late))
    assert len(report["runs"]) == 2
    assert report["first_step"] == 5  # the later launch only had a routine skip
    assert sorted(report["runs"][0]["ranks"]) == [0, 1]


def test_an_unknown_run_is_a_clear_error():
    import pytest

    from gradnan.errors import InputError

    with pytest.raises(InputError, match="no run 'nope'"):
        build_report(_files(_overflow(1, 1)), run="nope")


def _selftest(passed, failing=()):
    return {"schema": "gradnan.selftest", "version": 1, "time": "2026-11-22T12:00:00Z", "world_size": 4,
            "pass": passed, "failing_ranks": [{"rank": r, "host": "h", "device": "cpu", "reasons": ["matmul"]}
                                              for r in failing]}


def test_a_failed_selftest_on_the_origin_device_is_evidence():
    files = _files(_record(2, "pre_reduction", rank=1, params=["decoder.layers.0.mlp.linear_fc1.weight"]))
    files.selftests = {Path("/run/selftest/a.json"): _selftest(False, failing=[1])}
    analysis = analyze(files)
    report = analysis.to_json()
    assert any("FAILED on the origin's device" in item for item in report["incident"]["verdict"]["evidence"])
    assert "Self-test 2026-11-22T12:00:00Z: FAIL: rank 1 (h cpu)" in format_text(analysis)


def test_a_passed_selftest_is_reported_with_the_incident():
    files = _files(_record(2, "pre_reduction", rank=1, params=["decoder.layers.0.mlp.linear_fc1.weight"]))
    files.selftests = {Path("/run/selftest/a.json"): _selftest(True)}
    analysis = analyze(files)
    report = analysis.to_json()
    assert any("passed on all 4 ranks" in item for item in report["incident"]["verdict"]["evidence"])
    assert "Self-test 2026-11-22T12:00:00Z: PASS" in format_text(analysis)


def test_holders_without_pre_reduction_evidence_are_not_called_hardware():
    records = [_record(2, "nonfinite_grad_norm", rank=1, params=["decoder.layers.0.mlp.linear_fc1.weight"],
                       pre_reduction="unchecked"),
               _record(2, "nonfinite_grad_norm", rank=0, pre_reduction="unchecked")]
    incident = build_report(_files(*records))["incident"]
    assert incident["origin_basis"] == "unconfirmed"
    assert incident["verdict"]["cause"] == "undetermined"


def test_a_rank_with_several_bad_bucket_groups_is_one_origin_entry():
    names = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(3)]
    records = [_record(2, "pre_reduction", rank=1, params=[name]) for name in names]
    incident = build_report(_files(*records))["incident"]
    [origin] = incident["origin"]
    assert origin["params_total"] == 3 and len(origin["params"]) == 3


def test_the_report_gives_the_settings_to_capture_the_failing_step_on_a_rerun():
    records = [_record(4, "pre_reduction", rank=3, params=["decoder.layers.1.mlp.linear_fc2.weight"])]
    analysis = analyze(_files(*records))
    report = analysis.to_json()
    assert report["rerun_capture"] == {"GRADNAN_CAPTURE_MODULES": "decoder.layers.1.mlp.linear_fc2",
                                       "GRADNAN_CAPTURE_STEPS": "4", "GRADNAN_CAPTURE_RANKS": "3"}
    assert "GRADNAN_CAPTURE_MODULES=decoder.layers.1.mlp.linear_fc2" in format_text(analysis)


def test_under_megatron_lm_the_rerun_settings_name_its_iteration():
    """A rerun resumes from a checkpoint: step filters follow Megatron-LM's iteration, not gradnan's count."""
    records = [_record(4, "pre_reduction", rank=3, params=["decoder.layers.1.mlp.linear_fc2.weight"],
                       iteration=1004)]
    assert build_report(_files(*records))["rerun_capture"]["GRADNAN_CAPTURE_STEPS"] == "1004"


def test_frames_and_probe_records_are_summarised_with_the_command_to_list_them():
    frame = {"step": 3, "module": "decoder.layers.1.mlp.linear_fc2", "class": "RowParallelLinear", "call": 7,
             "recomputed": 0, "entries": [{"name": "output[0]", "kind": "output", "dtype": "torch.float16",
                                           "abs_min": 4.8, "abs_max": "inf"}]}
    probe = {"label": "attn scores", "module": "decoder.layers.1.self_attention", "step": 3,
             "recompute": False, "nan": 0, "inf": 2, "abs_min": 0.0, "abs_max": "inf", "shape": [2],
             "dtype": "torch.float16"}
    records = [_record(3, "frames", rank=1, mode="detect", frames=[frame], frames_total=1, first_nonfinite=0),
               _record(3, "probe", rank=1, probes=[probe])]
    analysis = analyze(_files(*records))
    report = analysis.to_json()
    assert report["frames"][0]["first_nonfinite_module"] == "decoder.layers.1.mlp.linear_fc2"
    assert report["probes"] == [{"global_rank": 1, "step": 3, "label": "attn scores",
                                 "module": "decoder.layers.1.self_attention", "nan": 0, "inf": 2}]
    text = format_text(analysis)
    assert "first non-finite in decoder.layers.1.mlp.linear_fc2 (RowParallelLinear)" in text
    assert "gradnan frames /run --rank 1 --step 3" in text
    assert ("gradnan.check('attn scores') in decoder.layers.1.self_attention: 2 Inf at step 3 on rank 1"
            in text)


def test_run_identity_keeps_slurm_requeues_and_torchrun_restarts_apart():
    from gradnan.formats.layout import run_identity

    both = run_identity("", {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1",
                             "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "none"}, 5.0)
    assert both == {"id": "77", "attempt": "1.2", "started": 5.0, "rendezvous": None}
    assert run_identity("mine", {"TORCHELASTIC_RUN_ID": "abc"}, 1.0)["id"] == "mine"
    assert run_identity("", {}, 1.0) == {"id": None, "attempt": "0", "started": 1.0, "rendezvous": None}
    assert (run_identity("", {"MASTER_ADDR": "node7", "MASTER_PORT": "29500"}, 1.0)["rendezvous"]
            == "node7:29500")


def test_two_anonymous_jobs_started_together_are_two_launches_told_apart_by_their_rendezvous():
    from gradnan.offline.incident.runs import split_runs

    def record(rendezvous, started):
        return {"run": {"id": None, "attempt": "0", "started": started, "rendezvous": rendezvous}}

    records = [record("a:1", 100.0), record("b:2", 100.5), record("a:1", 101.0), record(None, 100.2)]
    runs = split_runs(records)
    assert sorted(len(group) for group in runs.values()) == [1, 1, 2]
    assert all(len({r["run"]["rendezvous"] for r in group}) == 1 for group in runs.values())


def test_the_log_rank_falls_back_to_slurm_before_torch_distributed_starts(monkeypatch):
    from gradnan.log import launcher_rank

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert launcher_rank() == "5"
    monkeypatch.setenv("RANK", "3")
    assert launcher_rank() == "3"


def test_an_origin_without_its_data_parallel_coordinate_is_still_reported():
    """Shared files may lack a coordinate: the verdict must not compare a missing ``dp`` with a number."""
    with_dp = _record(2, "nonfinite_grad_norm", 0, ["decoder.layers.0.mlp.linear_fc1.weight"])
    without_dp = {**with_dp, "rank": {key: value for key, value in with_dp["rank"].items() if key != "dp"}}
    analysis = analyze(_files(with_dp, without_dp))
    report = analysis.to_json()
    assert report["first_step"] == 2 and report["incident"]["verdict"]["cause"]
    assert "First failing step: 2" in format_text(analysis)


def test_a_run_up_file_naming_its_launch_with_any_json_value_is_compared_not_a_crash():
    """Found by the readers' property test: a run-up file whose ``run`` holds a list (unhashable)."""
    record = _record(1, "nonfinite_grad_norm", 0, ["decoder.layers.0.mlp.linear_fc1.weight"],
                     run={"": []}, pre_reduction="nonfinite", grad_norm="nan")
    files = _files(record)
    files.runups[Path("/run/runup/r.json")] = {"step": 1, "rank": record["rank"], "run": {"": []},
                                               "groups": []}
    assert analyze(files).incident.step == 1


def test_the_collector_is_paused_while_a_run_is_read_and_back_after_even_on_an_error():
    seen = []
    with collector_paused():
        seen.append(gc.isenabled())
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a bad file")
    assert seen == [False] and gc.isenabled()


def test_a_rank_with_a_record_per_optimizer_is_one_receiver_and_one_column():
    """Expert parallelism: a rank writes one record per optimizer (its experts have their own); it received
    the value once, and the module table gives it one column."""
    origin = _record(2, "pre_reduction", 1, ["decoder.layers.0.mlp.linear_fc1.weight"])
    dense = _record(2, "nonfinite_grad_norm", 0, ["output_layer.weight"], pre_reduction="clean",
                    sub_optimizer=0)
    experts = _record(2, "nonfinite_grad_norm", 0, ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"
                                                    ".weight"], pre_reduction="clean", sub_optimizer=1)
    held = _record(2, "nonfinite_grad_norm", 1, ["decoder.layers.0.mlp.linear_fc1.weight"],
                   pre_reduction="nonfinite")
    analysis = analyze(_files(origin, dense, experts, held, *clean_states([dense, held])))
    receivers = analysis.to_json()["incident"]["receivers"]
    assert [view["global_rank"] for view in receivers] == [0]
    assert receivers[0]["modules"] == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1",
                                       "output_layer"]
    header = next(line for line in format_text(analysis).splitlines() if line.lstrip().startswith("module "))
    assert header.split().count("r0") == 1, header
