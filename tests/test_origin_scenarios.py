"""Issue: origin and incident report. DP=2 x TP=2 (4 gloo processes) on real megatron-core: the rank that
produced a NaN is told from the ranks that received it, and the report explains it."""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.distributed import DistributedDataParallelConfig

from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report, format_text
from gradnan.testing.toy import launch, launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

from .helpers import records_by_rank

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

STEP = 2
LAYOUT = TinyGPTJob(world_size=4, tp=2, dtype="bf16", quiet=True)
WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"

SCENARIOS = {
    "plain_ddp": (LAYOUT, [Injection(3, STEP, WEIGHT, "nan", where="backward", index=5)]),
    "distributed_optimizer": (LAYOUT.with_(distributed_optimizer=True),
                              [Injection(3, STEP, WEIGHT, "nan", where="backward", index=5)]),
    "forward_inf_everywhere": (LAYOUT.with_(bucket_size=6000),  # several bucket groups: one record each
                               [Injection(rank, STEP, "decoder.layers.1.mlp", "inf", where="forward")
                                for rank in range(4)]),
    "nan_inside_backward_at_layer_1": (LAYOUT, [Injection(1, STEP, "decoder.layers.1.mlp", "nan",
                                                          where="module_backward")]),
    "overlap_buckets_accumulation": (
        LAYOUT.with_(overlap_grad_reduce=True, bucket_size=6000, micro_batches=2),
        [Injection(2, STEP, "decoder.layers.1.self_attention.linear_qkv.weight", "inf", where="backward",
                   index=11)]),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    jobs = [job.with_(injections=tuple(injections), gradnan={"out_dir": str(root / name)})
            for name, (job, injections) in SCENARIOS.items()]
    launch_many(jobs)
    return {name: (root / name, build_report(read_run(root / name))) for name in SCENARIOS}


def _origin_ranks(report):
    return [entry["global_rank"] for entry in report["incident"]["origin"]]


def _receiver_ranks(report):
    return [view["global_rank"] for view in report["incident"]["receivers"]]


@pytest.mark.parametrize("name", ["plain_ddp", "distributed_optimizer"])
def test_one_rank_produced_it_and_the_others_received_it(reports, name):
    run_dir, report = reports[name]
    incident = report["incident"]
    assert incident["step"] == STEP
    assert incident["origin_basis"] == "before_collective"
    assert _origin_ranks(report) == [3]
    assert _receiver_ranks(report) == [0, 1, 2]
    [origin] = incident["origin"]
    assert (origin["tp"], origin["pp"], origin["dp"]) == (1, 0, 1)
    assert [p["name"] for p in origin["params"]] == [WEIGHT]
    assert origin["params"][0]["first_bad_index"] == [0, 5]
    assert incident["verdict"]["cause"] == "backward_op"
    summary = incident["verdict"]["summary"]
    assert WEIGHT in summary and "rank 3 (tp1 pp0 dp1" in summary
    assert "Only one data-parallel replica of 2 produced it" in incident["verdict"]["summary"]


def test_the_dp_peer_holds_the_nan_after_the_collective_but_is_a_receiver(reports):
    """Plain DDP all-reduces: rank 1 (dp0, same tp) holds the NaN at the grad norm, yet was clean before."""
    run_dir, report = reports["plain_ddp"]
    peer = next(v for v in report["incident"]["receivers"] if v["global_rank"] == 1)
    assert peer["holds_nonfinite"] is True
    [norm_record] = [r for r in records_by_rank(run_dir)[1] if r["step"] == STEP and r["kind"] != "state"]
    assert norm_record["pre_reduction"] == "clean" and norm_record["params"]


@pytest.mark.parametrize("missing, rule, origin", [(3, "unchecked_ranks", [3]),
                                                   (2, "backward_operator", [3])])
def test_a_rank_without_records_is_not_taken_as_checked(reports, tmp_path, missing, rule, origin):
    """Rank 3 made the NaN. Without its records (it died first, or its files were not copied), every rank
    left was clean before the collective and rank 1 holds the value after it: the collective is not
    concluded, and rank 3 is named as not checked. Without another rank's records, rank 3's own non-finite
    gradients still decide."""
    import shutil

    run_dir = shutil.copytree(reports["plain_ddp"][0], tmp_path / "run")
    for file in (run_dir / "records").glob(f"rank{missing:05d}_*.jsonl"):
        file.unlink()
    incident = build_report(read_run(run_dir))["incident"]
    assert incident["verdict"]["rule"] == rule and _origin_ranks({"incident": incident}) == origin
    if rule == "unchecked_ranks":
        text = format_text(analyze(read_run(run_dir)))
        assert "Verdict: undetermined" in text and "collective: the data-parallel" not in text
        assert "its own gradients not checked at this step" in text


def test_forward_inf_on_every_replica_points_at_data_and_the_forward_pass(reports):
    _, report = reports["forward_inf_everywhere"]
    incident = report["incident"]
    assert sorted(_origin_ranks(report)) == [0, 1, 2, 3]
    assert incident["pattern"]["pass"] == "forward"
    assert incident["verdict"]["cause"] == "forward_op" and incident["verdict"]["rule"] == "forward_operator"
    assert "decoder.layers.1.mlp" in incident["verdict"]["summary"]
    assert (incident["rerun"]["module"] == "decoder.layers.1.mlp"
            and incident["rerun"]["conclusion"] == "reproducible")
    assert "100% of the origin's gradients are non-finite" in " ".join(incident["verdict"]["evidence"])


def test_a_nan_made_inside_backward_names_that_layer_first(reports):
    _, report = reports["nan_inside_backward_at_layer_1"]
    incident = report["incident"]
    assert incident["pattern"]["pass"] == "backward"
    assert incident["pattern"]["first_in_backward"].startswith("decoder.layers.1.mlp.")
    assert 1 in _origin_ranks(report)
    assert incident["pattern"]["first_rank"] == 1
    assert "on rank 1 (tp1 pp0 dp0" in incident["verdict"]["summary"]
    names = [p["name"] for module in incident["parameters"] for p in module["params"]]
    assert names[0].startswith("decoder.layers.1.mlp.")
    assert not any(name.startswith(("output_layer", "decoder.final_layernorm")) for name in names)
    assert any(name.startswith("decoder.layers.0.") for name in names)


def test_overlapped_reduction_with_several_buckets_and_accumulation(reports):
    run_dir, report = reports["overlap_buckets_accumulation"]
    assert _origin_ranks(report) == [2]
    [pre] = [r for r in records_by_rank(run_dir)[2] if r["kind"] == "pre_reduction" and r["step"] == STEP]
    assert pre["params"][0]["name"] == "decoder.layers.1.self_attention.linear_qkv.weight"
    assert pre["params"][0]["inf"] == 1 and pre["params"][0]["first_bad_flat"] == 11
    bucket_counts = {r["bucket_group"] for r in records_by_rank(run_dir)[2] if r["kind"] == "pre_reduction"}
    assert bucket_counts  # the bad bucket was identified by its group


def test_text_report_fits_one_screen_for_a_four_rank_job(reports):
    for run_dir, _ in reports.values():
        lines = format_text(analyze(read_run(run_dir))).splitlines()
        # 40, up to 8 lines of next steps and 4 of the run-up (docs/cli.md promises 60 at any scale)
        assert len(lines) <= 52
        # the replay command lines hold the bundle's path, as long as wherever the user keeps the run
        assert max(len(line) for line in lines if not line.strip().startswith("gradnan replay ")) <= 160


@pytest.mark.skipif("param_name_patterns_for_fp32_local_accumulation" not in
                    {spec.name for spec in dataclasses.fields(DistributedDataParallelConfig)},
                    reason="core 0.19+: main_grad accumulated locally in fp32")
def test_a_gradient_accumulated_in_fp32_outside_the_buffer_is_checked_before_the_collective(tmp_path):
    """core 0.19's fp32 local accumulation keeps each main_grad out of the bf16 buffer until
    ``start_grad_sync`` copies it in, after gradnan's check: the check reads those main_grads too."""
    job = TinyGPTJob(world_size=2, dtype="bf16", quiet=True, fp32_local_accumulation=True,
                     gradnan={"out_dir": str(tmp_path)},
                     injections=(Injection(1, STEP, WEIGHT, "nan", where="backward", index=5),))
    launch(job)
    report = build_report(read_run(tmp_path))
    assert report["incident"]["step"] == STEP and _origin_ranks(report) == [1]
    assert report["incident"]["origin_basis"] == "before_collective"
    by_rank = records_by_rank(tmp_path)
    [pre] = [r for r in by_rank[1] if r["kind"] == "pre_reduction" and r["step"] == STEP]
    assert [(p["name"], p["first_bad_flat"], p["nan"]) for p in pre["params"]] == [(WEIGHT, 5, 1)]
    assert not [r for r in by_rank[0] if r["kind"] == "pre_reduction" and r["step"] == STEP]


def test_megatron_check_for_nan_in_grad_raises_after_our_record_is_on_disk(tmp_path):
    job = LAYOUT.with_(check_for_nan_in_grad=True, gradnan={"out_dir": str(tmp_path)},
                       injections=(Injection(3, STEP, WEIGHT, "nan", where="backward", index=5),))
    with pytest.raises(JobFailed) as failure:
        launch(job)
    assert "found NaN in local grad norm" in failure.value.errors["job0_rank3"]
    report = build_report(read_run(tmp_path))
    assert report["incident"]["step"] == STEP
    assert _origin_ranks(report) == [3]
    [pre] = [r for r in records_by_rank(tmp_path)[3] if r["kind"] == "pre_reduction"]
    assert pre["mode"] == "sync"
    assert [p["name"] for p in pre["params"]] == [WEIGHT]
