"""Frame tracing (Hugging Face DebugUnderflowOverflow parity) and gradnan.check probes on real megatron-core.

- detect, fp16 TP=2: an overflow driven in one rank's MLP is written once, as the frames leading to the first
  module whose output went non-finite; its TP peer shows the same Inf arriving through the all-reduce;
- trace: every frame of the chosen steps, the root GPTModel included, in call order;
- activation recompute does not double frames, it counts ``recomputed`` on the forward frames;
- ``max_frames``, ``modules`` and ``exclude_modules`` choose what is kept and traced;
- ``abort_after_step`` stops every rank once that step is on disk;
- ``gradnan.check`` records non-finite probes with the enclosing module's global name, and is a no-op
  without an installation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import gradnan
from gradnan.offline.incident.read import read_run
from gradnan.patches.instrumentor import megatron_version
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, JobFailed, TinyGPTJob

from .helpers import records_by_rank

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

FC1, FC2 = "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2"
LAYOUT = TinyGPTJob(world_size=2, tp=2, dtype="fp16", quiet=True)


# core 0.19 stopped calling attention's identity q/k layernorms (no QK norm in this model)
QK_NORM_CALLS = 2 if megatron_version() < Version("0.19") else 0


def _overflow(step):
    """Rank 1's layer-1 MLP weights grown so that fc1 stays finite and fc2 overflows fp16 in forward."""
    return (Injection(1, step, FC1 + ".weight", "30", where="scale_to"),
            Injection(1, step, FC2 + ".weight", "3000", where="scale_to"))


def _layer(i):
    prefix = f"decoder.layers.{i}"
    attention = f"{prefix}.self_attention"
    qk_layernorms = [f"{attention}.q_layernorm", f"{attention}.k_layernorm"][:QK_NORM_CALLS]
    return [f"{prefix}.input_layernorm", f"{attention}.linear_qkv", *qk_layernorms,
            f"{attention}.core_attention.scale_mask_softmax",
            f"{attention}.core_attention.attention_dropout", f"{attention}.core_attention",
            f"{attention}.linear_proj", attention, f"{prefix}.pre_cross_attn_layernorm",
            f"{prefix}.cross_attention", f"{prefix}.pre_mlp_layernorm",
            f"{prefix}.mlp.linear_fc1", f"{prefix}.mlp.linear_fc2", f"{prefix}.mlp", prefix]


# every module call of one forward of the toy GPT, in the order the calls finish (children first); the
# cross_attn_bda call (an IdentityFuncOp returning a function: no tensor) makes no frame
ALL_MODULES = (["embedding.word_embeddings", "embedding.position_embeddings", "embedding.embedding_dropout",
                "embedding"] + _layer(0) + _layer(1)
               + ["decoder.final_layernorm", "decoder", "output_layer", ""])
FC2_AT = ALL_MODULES.index(FC2)

RUNS = {
    "detect": LAYOUT.with_(steps=4, injections=_overflow(3), gradnan={"frames": "detect"}),
    "trace": LAYOUT.with_(steps=4, gradnan={"frames": "trace", "trace_steps": "1,3"}),
    "recompute": LAYOUT.with_(steps=1, recompute=True, gradnan={"frames": "trace", "trace_steps": "1"}),
    "max5": LAYOUT.with_(steps=1, injections=_overflow(1), gradnan={"frames": "detect", "max_frames": 5}),
    "only_layer1": LAYOUT.with_(steps=1, gradnan={"frames": "trace", "trace_steps": "1",
                                                  "modules": "decoder.layers.1.*"}),
    "no_attention": LAYOUT.with_(steps=1, gradnan={"frames": "trace", "trace_steps": "1",
                                                   "exclude_modules": "*.self_attention*"}),
    "pipeline": LAYOUT.with_(tp=1, pp=2, dtype="bf16", steps=2, micro_batches=2,
                             gradnan={"frames": "trace", "trace_steps": "2"}),
    # last: its processes stop with AbortRequested, so nothing after it would run
    "abort": LAYOUT.with_(steps=4, gradnan={"frames": "trace", "trace_steps": "1-4", "abort_after_step": 2}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frames")
    jobs = [job.with_(gradnan={**job.gradnan, "out_dir": str(root / name)}) for name, job in RUNS.items()]
    try:
        launch_many(jobs)
        failure = None
    except JobFailed as exc:
        failure = exc
    return root, failure


def _frames_records(run_dir, rank):
    return [r for r in records_by_rank(run_dir)[rank] if r["kind"] == "frames"]


def _trace(runs, name, rank, step):
    [record] = [r for r in _frames_records(runs[0] / name, rank) if r["step"] == step]
    return record


def _entry(frame, name):
    [entry] = [e for e in frame["entries"] if e["name"] == name]
    return entry


def _finite(value):
    return value is None or (isinstance(value, float) and math.isfinite(value))


def _frame_finite(frame):
    return all(_finite(e["abs_min"]) and _finite(e["abs_max"]) for e in frame["entries"])


def test_detect_writes_the_frames_up_to_the_first_overflowing_module_once(runs):
    [record] = _frames_records(runs[0] / "detect", 1)
    assert record["step"] == 3 and record["mode"] == "detect" and record["local_nonfinite"] is True
    frames = record["frames"]
    assert len(frames) == record["frames_total"] == 21  # max_frames' default
    assert record["first_nonfinite"] == 20
    # one step's calls, ending at layer 1's fc2
    assert [f["module"] for f in frames] == ALL_MODULES[FC2_AT - 20:FC2_AT + 1]
    assert all(f["step"] == 3 and f["recomputed"] == 0 for f in frames)
    assert [f["module"] for f in frames[-3:]] == ["decoder.layers.1.pre_mlp_layernorm", FC1, FC2]
    last = frames[-1]
    assert last["class"] == "RowParallelLinear"
    assert _entry(last, "output[0]")["abs_max"] == "inf"
    assert _entry(last, "weight")["abs_max"] == 3000.0
    assert all(_finite(_entry(last, name)["abs_max"]) for name in ("weight", "bias", "input[0]", "output[1]"))
    assert all(_frame_finite(f) for f in frames[:-1])
    # the growth is in the frames: fc1's weight and output against the same step of the healthy run
    fc1 = frames[-2]
    assert _entry(fc1, "weight")["abs_max"] == 30.0
    healthy_fc1 = next(f for f in _trace(runs, "trace", 1, 3)["frames"] if f["module"] == FC1)
    assert _entry(fc1, "output[0]")["abs_max"] > 50 * _entry(healthy_fc1, "output[0]")["abs_max"]
    assert _entry(last, "input[0]")["abs_max"] == _entry(fc1, "output[0]")["abs_max"]  # GeLU(fc1) feeds fc2
    # up to the grown weights nothing differs from the healthy run's step 3: the same frames, bit for bit
    healthy = _trace(runs, "trace", 1, 3)["frames"][FC2_AT - 20:FC2_AT - 1]
    assert [f["call"] for f in frames] == list(range(FC2_AT - 20, FC2_AT + 1))
    assert [f["entries"] for f in frames[:19]] == [f["entries"] for f in healthy]
    assert _entry(fc1, "input[0]") == _entry(healthy_fc1, "input[0]")


def test_gradnan_frames_prints_them_as_debug_underflow_overflow_does_and_the_report_points_there(runs,
                                                                                                 capsys):
    from gradnan.cli import main

    run_dir = runs[0] / "detect"
    assert main(["frames", str(run_dir), "--rank", "1", "--last", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("rank 1 (tp1 pp0 dp0) step 3, detect mode: 2 forward frame(s); first non-finite:"
                        f" {FC2} RowParallelLinear")
    assert lines[1].split() == ["abs", "min", "abs", "max", "metadata"]
    assert lines[2].strip() == f"{FC1} ColumnParallelLinear" and lines[3].endswith(" 3.00e+01 weight")
    assert lines[-2].split()[1:] == ["inf", "output[0]"] and lines[-6].strip() == f"{FC2} RowParallelLinear"
    assert main(["report", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert (f"Forward frames: rank 1 (tp1 pp0 dp0) step 3: first non-finite in {FC2} (RowParallelLinear);"
            f" gradnan frames {run_dir} --rank 1 --step 3") in report
    assert main(["frames", str(run_dir), "--step", "2"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no frames recorded for step 2" in error


def test_the_tensor_parallel_peer_received_the_overflow_through_the_all_reduce(runs):
    [record] = _frames_records(runs[0] / "detect", 0)
    assert record["step"] == 3 and record["mode"] == "detect"
    frames = record["frames"]
    assert len(frames) == 21 and [f["module"] for f in frames[-3:]] == ["decoder.layers.1.pre_mlp_layernorm",
                                                                         FC1, FC2]
    last = frames[-1]
    assert _entry(last, "output[0]")["abs_max"] == "inf"
    # its own are small
    assert _entry(last, "weight")["abs_max"] < 1 and _entry(last, "input[0]")["abs_max"] < 10
    assert _entry(frames[-2], "weight")["abs_max"] < 1
    assert all(_frame_finite(f) for f in frames[:-1])
    [origin] = _frames_records(runs[0] / "detect", 1)
    # rank 1's weights are the grown ones; both ranks hold the same reduced output
    assert _entry(origin["frames"][-1], "weight")["abs_max"] > 1000 * _entry(last, "weight")["abs_max"]
    assert _entry(origin["frames"][-1], "output[0]") == _entry(last, "output[0]")


def test_trace_writes_every_frame_of_the_chosen_steps(runs):
    run_dir = runs[0] / "trace"
    for rank in (0, 1):
        records = _frames_records(run_dir, rank)
        assert sorted(r["step"] for r in records) == [1, 3]
        for record in records:
            assert record["mode"] == "trace" and record["first_nonfinite"] is None
            frames = record["frames"]
            assert record["frames_total"] == len(frames) == len(ALL_MODULES)
            assert [f["module"] for f in frames] == ALL_MODULES
            assert [f["call"] for f in frames] == list(range(len(ALL_MODULES)))
            assert all(f["step"] == record["step"] and f["recomputed"] == 0 for f in frames)
            assert all(_frame_finite(f) for f in frames)
            root = frames[-1]  # the unwrapped GPTModel: no DDP or Float16Module frame
            assert root["module"] == "" and root["class"] == "GPTModel"
            assert not {"DistributedDataParallel", "Float16Module"} & {f["class"] for f in frames}
            assert [e["name"] for e in root["entries"]] == ["input[0]", "input[1]", "input[2]",
                                                            "kwargs.labels", "output"]
            # integer/bool inputs
            assert [e["abs_max"] is None for e in root["entries"]] == [True] * 4 + [False]
            assert _entry(frames[ALL_MODULES.index(FC1)], "weight")["dtype"] == "torch.float16"
    # the trained step differs from the first
    step1, step3 = _trace(runs, "trace", 1, 1), _trace(runs, "trace", 1, 3)
    assert _entry(step1["frames"][-1], "output") != _entry(step3["frames"][-1], "output")


def test_activation_recompute_counts_on_the_forward_frames_instead_of_doubling_them(runs):
    for rank in (0, 1):
        [record] = _frames_records(runs[0] / "recompute", rank)
        plain = _trace(runs, "trace", rank, 1)
        assert (record["step"] == 1
                and record["frames_total"] == len(record["frames"]) == plain["frames_total"])
        assert [f["module"] for f in record["frames"]] == ALL_MODULES
        recomputed = {f["module"]: f["recomputed"] for f in record["frames"]}
        assert {m for m, n in recomputed.items() if n} == {m for m in ALL_MODULES
                                                           if m.startswith("decoder.layers.")}
        assert all(n == 1 for n in recomputed.values() if n)
        assert all(f["recomputed"] == 0 for f in plain["frames"])
        # the forward's values, not the recompute's overwriting them (they are equal anyway)
        assert [f["entries"] for f in record["frames"]] == [f["entries"] for f in plain["frames"]]


def test_under_pipeline_parallelism_each_stage_traces_its_own_modules_by_global_name(runs):
    """PP=2, 1F1B with 2 micro-batches: stage 0 holds the embedding and layer 0, stage 1 layer 1 (named by
    its global number) and the output layer; each stage's record holds both micro-batches' calls."""
    first = ["embedding.word_embeddings", "embedding.position_embeddings", "embedding.embedding_dropout",
             "embedding"] + _layer(0) + ["decoder", ""]
    last = _layer(1) + ["decoder.final_layernorm", "decoder", "output_layer", ""]
    for rank, modules in ((0, first), (1, last)):
        [record] = _frames_records(runs[0] / "pipeline", rank)
        assert record["step"] == 2 and record["rank"]["pp"] == rank
        assert [f["module"] for f in record["frames"]] == modules * 2
        assert all(_frame_finite(f) for f in record["frames"])
        fc1 = [f for f in record["frames"] if f["module"].endswith("mlp.linear_fc1")]
        assert len(fc1) == 2 and _entry(fc1[0], "input[0]") != _entry(fc1[1], "input[0]")  # two micro-batches


def test_max_frames_keeps_the_last_frames_before_the_first_nonfinite_one(runs):
    [record] = _frames_records(runs[0] / "max5", 1)
    assert record["step"] == 1 and record["frames_total"] == len(record["frames"]) == 5
    assert [f["module"] for f in record["frames"]] == ALL_MODULES[FC2_AT - 4:FC2_AT + 1]
    assert record["first_nonfinite"] == 4 and _entry(record["frames"][-1], "output[0]")["abs_max"] == "inf"
    assert all(_frame_finite(f) for f in record["frames"][:-1])


def test_modules_and_exclude_modules_choose_the_traced_modules(runs):
    only = [m for m in ALL_MODULES if m.startswith("decoder.layers.1.")]
    assert len(only) == 13 + QK_NORM_CALLS
    without = [m for m in ALL_MODULES if ".self_attention" not in m]
    assert len(without) == len(ALL_MODULES) - 2 * (6 + QK_NORM_CALLS)
    for rank in (0, 1):
        assert [f["module"] for f in _trace(runs, "only_layer1", rank, 1)["frames"]] == only
        assert [f["module"] for f in _trace(runs, "no_attention", rank, 1)["frames"]] == without


def test_abort_after_step_stops_every_rank_once_that_step_is_written(runs):
    root, failure = runs
    assert isinstance(failure, JobFailed)
    abort = list(RUNS).index("abort")
    assert sorted(failure.errors) == [f"job{abort}_rank0", f"job{abort}_rank1"]
    for error in failure.errors.values():
        assert error.startswith("AbortRequested: gradnan: stopping after step 2 ")
        assert "abort_after_step=2" in error
    for rank in (0, 1):
        assert [r["step"] for r in _frames_records(root / "abort", rank)] == [1, 2]


def test_every_run_directory_reads_without_problems(runs):
    root, _ = runs
    for name in RUNS:
        assert read_run(root / name).problems == [], name


# -- gradnan.check ----------------------------------------------------------------------------------

PROBE_JOB = TinyGPTJob(world_size=2, dtype="fp16", steps=3, quiet=True,  # DP=2
                       injections=(Injection(1, 2, FC2, "inf", where="forward"),))


def _probe_worker(rank: int, job: TinyGPTJob, port: int, out_dir: str, results_dir: str) -> None:
    from gradnan.testing.gloo import gloo_process, one_job
    from gradnan.testing.toy import TinyGPT
    from gradnan.testing.toy_faults import _module_by_global_name

    with gloo_process(rank, job.world_size, port), one_job():
        gradnan.check(torch.tensor([float("nan")]), "before install")  # no installation yet: nothing
        model = TinyGPT(job, rank, install=lambda: gradnan.install(out_dir=out_dir, strict=True))
        mlp = _module_by_global_name([model.chunk], "decoder.layers.1.mlp")
        mlp.register_forward_hook(lambda _module, _args, output: gradnan.check(output[0], "mlp out"))
        for _ in range(job.steps):
            gradnan.check(torch.tensor([float("nan")]), "outside")
            model.step()
        Path(results_dir, f"rank{rank}.json").write_text(json.dumps(dataclasses.asdict(model.result)))


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    import torch.multiprocessing as mp

    from gradnan.testing.gloo import free_port

    root = tmp_path_factory.mktemp("probes")
    out_dir, results = root / "run", root / "results"
    results.mkdir()
    mp.spawn(_probe_worker, args=(PROBE_JOB, free_port(), str(out_dir), str(results)),
             nprocs=PROBE_JOB.world_size, join=True)
    return out_dir, {rank: json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_check_names_the_enclosing_module_and_the_step(probed):
    run_dir, results = probed
    assert [s["update_successful"] for s in results[1]["steps"]] == [True, False, True]  # the fp16 skip at 2
    assert read_run(run_dir).problems == []
    by_rank = records_by_rank(run_dir)
    for rank in (0, 1):
        probes = {r["step"]: r for r in by_rank[rank] if r["kind"] == "probe"}
        assert sorted(probes) == [1, 2, 3]  # "outside" is NaN at every step
        for step, record in probes.items():
            assert record["local_nonfinite"] is True
            assert record["probes"][0] == {"label": "outside", "module": None, "step": step,
                                           "recompute": False, "nan": 1, "inf": 0, "abs_min": "nan",
                                           "abs_max": "nan", "shape": [1], "dtype": "torch.float32"}
        labels = {step: [p["label"] for p in record["probes"]] for step, record in probes.items()}
        assert labels == {1: ["outside"], 2: ["outside", "mlp out"] if rank == 1 else ["outside"],
                          3: ["outside"]}
    [record] = [r for r in by_rank[1] if r["kind"] == "probe" and r["step"] == 2]
    mlp_out = record["probes"][1]
    assert (mlp_out["module"] == "decoder.layers.1.mlp" and mlp_out["step"] == 2
            and mlp_out["recompute"] is False)
    assert (mlp_out["nan"], mlp_out["inf"]) == (0, 1) and mlp_out["abs_max"] == "inf"
    assert mlp_out["shape"] == [PROBE_JOB.seq_length, PROBE_JOB.micro_batch_size, PROBE_JOB.hidden_size]
    assert mlp_out["dtype"] == "torch.float16"
    assert not any(p["label"] == "before install" for records in by_rank.values() for r in records
                   for p in r.get("probes", []))


def test_check_without_an_installation_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gradnan.current() is None
    assert gradnan.check(torch.tensor([float("nan"), float("inf")]), "no install") is None
    assert gradnan.check("not even a tensor", "no install") is None
    assert list(tmp_path.iterdir()) == []
