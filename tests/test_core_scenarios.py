"""Issue: core kit. Real megatron-core, real gloo processes, a NaN/Inf injected into one parameter's
gradient on one rank at one step; the record names exactly that parameter, rank and step.

Jobs of one world size share one set of processes (``launch_many``) so start-up is paid once.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gradnan.formats.layout import rank_tag
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import assert_clean_elsewhere, assert_origin, records_by_rank

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

STEP = 2

# name -> (job, injection) ; world size 1
SINGLE = {
    "fp32": (TinyGPTJob(world_size=1, dtype="fp32"),
             Injection(0, STEP, "decoder.layers.1.self_attention.linear_qkv.weight", "nan", index=77)),
    "bf16_distopt": (TinyGPTJob(world_size=1, dtype="bf16", distributed_optimizer=True),
                     Injection(0, STEP, "output_layer.weight", "inf", index=5)),
    "fp16": (TinyGPTJob(world_size=1, dtype="fp16"),
             Injection(0, STEP, "decoder.layers.0.mlp.linear_fc2.weight", "inf", index=3)),
}
# world size 2
PAIR = {
    "tp2_bf16": (TinyGPTJob(tp=2, dtype="bf16"),
                 Injection(1, STEP, "decoder.layers.0.mlp.linear_fc1.weight", "nan", index=9)),
    "tp2_fp16": (TinyGPTJob(tp=2, dtype="fp16"),
                 Injection(0, STEP, "decoder.layers.1.self_attention.linear_proj.weight", "inf", index=4)),
    "dp2_fp32": (TinyGPTJob(dtype="fp32"),
                 Injection(1, STEP, "decoder.layers.0.mlp.linear_fc2.bias", "nan", index=2)),
    "dp2_bf16_distopt": (TinyGPTJob(dtype="bf16", distributed_optimizer=True),
                         Injection(1, STEP, "embedding.word_embeddings.weight", "inf")),
    "dp2_fp16_distopt": (TinyGPTJob(dtype="fp16", distributed_optimizer=True),
                         Injection(0, STEP, "decoder.final_layernorm.weight", "nan")),
    "dp2_bf16_norm_as_tensor": (TinyGPTJob(dtype="bf16", norm_as_tensor=True),  # core 0.18+ with TE
                                Injection(1, STEP, "decoder.layers.1.mlp.linear_fc1.bias", "nan", index=3)),
    # MoE: 4 experts over EP=2 (allgather dispatcher); the NaN is in global expert 2, rank 1's first local one
    "ep2_moe_bf16": (TinyGPTJob(dtype="bf16", experts=4, ep=2),
                     Injection(1, STEP, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
                               "nan", index=5)),
    "pp2_fp32": (TinyGPTJob(pp=2, dtype="fp32", micro_batches=2),
                 Injection(1, STEP, "decoder.layers.1.mlp.linear_fc1.weight", "nan", index=100)),
    # interleaved pipeline: 2 chunks per rank, rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
    "pp2_vpp2_fp32": (TinyGPTJob(pp=2, vpp=2, num_layers=4, micro_batches=2),
                      Injection(0, STEP, "decoder.layers.2.mlp.linear_fc1.weight", "nan", index=7)),
    "dp2_bf16_overlap_param_gather": (TinyGPTJob(dtype="bf16", distributed_optimizer=True,
                                                 overlap_grad_reduce=True, overlap_param_gather=True,
                                                 bucket_size=6000),
                                      Injection(1, STEP, "decoder.layers.0.mlp.linear_fc2.weight", "inf")),
    "pp2_bf16_distopt": (TinyGPTJob(pp=2, dtype="bf16", micro_batches=2, distributed_optimizer=True),
                         Injection(0, STEP, "embedding.position_embeddings.weight", "inf", index=31)),
}


def _run(tmp_path_factory, scenarios):
    root = tmp_path_factory.mktemp("core")
    jobs = [job.with_(injections=(injection,), gradnan={"out_dir": str(root / name)})
            for name, (job, injection) in scenarios.items()]
    outcomes = launch_many(jobs)
    return {name: (root / name, outcome) for name, outcome in zip(scenarios, outcomes)}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    return _run(tmp_path_factory, SINGLE)


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory):
    return _run(tmp_path_factory, PAIR)


def _check(runs, scenarios, name):
    run_dir, outcome = runs[name]
    job, injection = scenarios[name]
    [injected] = outcome[injection.rank].injected
    kind = "loss_scale_overflow" if job.dtype == "fp16" else "nonfinite_grad_norm"
    record = assert_origin(run_dir, rank=injection.rank, step=injection.step, param=injection.target,
                           value=injection.value, index=injected["index"], kind=kind)
    assert_clean_elsewhere(run_dir, origin=injection.rank, step=injection.step)
    return record, outcome


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_world_size_one_names_the_parameter(single_runs, name):
    record, _ = _check(single_runs, SINGLE, name)
    assert record["rank"]["global_rank"] == 0


@pytest.mark.parametrize("name", sorted(PAIR))
def test_two_ranks_name_the_parameter_and_rank(pair_runs, name):
    record, outcome = _check(pair_runs, PAIR, name)
    job, injection = PAIR[name]
    coords = record["rank"]
    assert (coords["tp_size"], coords["pp_size"], coords["dp_size"]) == (
        job.tp, job.pp, 2 // (job.tp * job.pp))
    assert Path(record["map"]).name == rank_tag(coords) + ".json"
    if job.dtype != "fp16":
        assert math.isnan(outcome[injection.rank].steps[STEP - 1].grad_norm) or math.isinf(
            outcome[injection.rank].steps[STEP - 1].grad_norm)


def test_fp16_overflow_is_its_own_quiet_kind_with_the_scale(single_runs):
    run_dir, outcome = single_runs["fp16"]
    [record] = [r for r in records_by_rank(run_dir)[0] if r["step"] == STEP]
    assert record["kind"] == "loss_scale_overflow"
    assert record["loss_scale"] == 2.0 ** 12
    assert record["consecutive_skips"] == 1
    assert outcome[0].steps[STEP - 1].update_successful is False


def test_pipeline_names_are_global(pair_runs):
    run_dir, _ = pair_runs["pp2_fp32"]
    from .helpers import map_names

    stage_names = {}
    for path in sorted((run_dir / "maps").glob("*.json")):
        stage_names[path.name] = set(map_names(str(path)).values())
    first, last = stage_names["rank00000_tp0_pp0_dp0.json"], stage_names["rank00001_tp0_pp1_dp0.json"]
    assert any(name.startswith("decoder.layers.0.") for name in first)
    assert not any(name.startswith("decoder.layers.1.") for name in first)
    assert any(name.startswith("decoder.layers.1.") for name in last)
    assert not any(name.startswith("decoder.layers.0.") for name in last)
    assert not any(name.startswith("module.") for name in first | last)


def test_virtual_pipeline_chunks_carry_their_global_layer_numbers(pair_runs):
    run_dir, _ = pair_runs["pp2_vpp2_fp32"]
    from .helpers import map_names

    layers = {path.name: {int(name.split(".")[2]) for name in map_names(str(path)).values()
                          if name.startswith("decoder.layers.")}
              for path in sorted((run_dir / "maps").glob("*.json"))}
    assert layers == {"rank00000_tp0_pp0_dp0.json": {0, 2}, "rank00001_tp0_pp1_dp0.json": {1, 3}}


def test_expert_names_carry_the_global_expert_number_on_every_expert_parallel_rank(pair_runs):
    run_dir, _ = pair_runs["ep2_moe_bf16"]
    from .helpers import map_names

    experts = {}
    for path in sorted((run_dir / "maps").glob("*.json")):
        names = map_names(str(path)).values()
        experts[path.name] = {int(name.split(".local_experts.")[1].split(".")[0]) for name in names
                              if ".local_experts." in name}
    assert experts == {"rank00000_tp0_pp0_dp0_ep0.json": {0, 1}, "rank00001_tp0_pp0_dp1_ep1.json": {2, 3}}


def test_only_the_rank_that_holds_the_nan_scans_it_when_norms_are_not_shared(pair_runs):
    """DP=2 without the distributed optimizer: the norm is reduced over the model-parallel group only,
    so the clean replica computes a finite norm and writes nothing at that step. (At the next step the
    replica that applied the NaN update sends NaN gradients through the all-reduce: both record.)"""
    run_dir, _ = pair_runs["dp2_fp32"]
    by_rank = records_by_rank(run_dir)
    assert [r["step"] for r in by_rank[1]][0] == STEP
    assert min(r["step"] for r in by_rank[0]) == STEP + 1


def test_a_healthy_fp16_run_from_megatron_lms_initial_loss_scale_is_no_incident(tmp_path):
    """Megatron-LM starts fp16 at a loss scale of 2**32: a healthy run skips steps until the scale has come
    down. Those skips are recorded as the scale warming up, and the report finds no failure."""
    from gradnan.offline.incident.read import read_run
    from gradnan.offline.incident.report import build_report

    [outcome] = launch_many([TinyGPTJob(world_size=1, dtype="fp16", initial_loss_scale=2.0 ** 32, steps=20,
                                        gradnan={"out_dir": str(tmp_path)})])
    skipped = [not step.update_successful for step in outcome[0].steps]
    assert skipped[:3] == [True] * 3 and skipped[-1] is False  # a real warm-up: many skips, then updates
    records = [r for r in records_by_rank(tmp_path)[0] if r["kind"] == "loss_scale_overflow"]
    assert len(records) == sum(skipped) and all(r["warmup"] for r in records)
    report = build_report(read_run(tmp_path))
    assert report["incident"] is None and report["loss_scale_overflow_steps"] == [r["step"] for r in records]
