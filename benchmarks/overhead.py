"""gradnan's cost, measured side by side in one run: healthy-step overhead, scan speed, extra memory.

    python benchmarks/overhead.py                 # ~1M, 10M and 50M parameter GPTs,
                                                  # about 6 minutes on 2 cores
    python benchmarks/overhead.py --sizes 1m --rounds 5 --scan-reps 5   # a quick look
    python benchmarks/overhead.py --sizes 1b      # on a GPU: a 1.1B-parameter GPT, bf16, sequence 2048
    python benchmarks/overhead.py --sizes 20layers --dtype bf16 --rounds 3 --scan-reps 3 --incident 1
                                                  # the incident's operators: a 20-layer GPT, 245 tensors

Real megatron-core, one process (CPU with the shim, or a real GPU when CUDA is there, without the shim).
1. Step time, interleaved round by round (off, defaults, defaults without the run-up ring
   (``runup_steps=0``: the run-up's own cost is defaults / runup_off, printed per size), defaults without
   the rerun's kept step (``rerun="off"``), pre-reduction sync, capture armed on one MLP with retention,
   i.e. its every call traced; each mode installed, one untimed step, one timed step, then one step with
   the kit's own time clocked, whose device synchronizations stay out of the timed one), reported as
   medians and the median of the per-round ratios; and, the kit off, Megatron's own per-bucket
   ``check_for_nan_in_grad`` (``megatron_check``: a norm and two host reads per bucket), the check a user
   would weigh gradnan's against.
2. The replica check alone (issue 49): one check's digest of the weights, its all-reduce and its read, timed,
   with its operators and host syncs, and its share of a healthy step at the default cadence
   (``replica_check_every``).
3. The localization scan alone, one parameter's gradient holding a NaN: gradnan's scan over the
   ``main_grad`` views, over separate tensors (fp16/bf16 main copies, distributed-optimizer shards), the
   hand-made recipe's per-parameter ``torch.isnan(g).any()`` loop, the floor: one finite check over
   the contiguous grad buffer (every gradient byte read once), and a plain device copy of that buffer.
   Throughput in GB/s of gradient bytes, host syncs and peak extra memory of each.
4. The incident (``--incident``): a forward overflow in an fp16 copy of the model (the step is skipped, the
   weights stay), the failing step timed without the kit and with it (detection, the rerun of the step's
   forward pass, the capture and the files), the extra in forward passes of that model; and the operators
   the failing step dispatches (on a GPU: kernel launches) without and with the kit, in forward passes,
   by phase of the kit (``incident_operators``: the same on any machine).
4. A checkpoint save (``--checkpoint-reps``): megatron-core's ``dist_checkpointing.save`` of the model alone,
   and the mark gradnan takes at each save alone (the weights, main copies and moments read as at a save,
   ``weights.checkpoint_mark``), interleaved: the mark's cost against the save's, and its host reads.
Prints a markdown table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from functools import partial
from typing import Any, Callable, Dict, List

import torch

import gradnan
import gradnan.training.incidents as incident_module
from gradnan.config import GradnanConfig
from gradnan.patches.model import global_named_parameters
from gradnan.patches.undo_log import patch_scope
from gradnan.testing.measure import HostSyncCounter, OperatorCounter, PeakMemory
from gradnan.testing.toy import TinyGPT
from gradnan.testing.toy_job import Injection, TinyGPTJob
from gradnan.training.error_guard import ErrorGuard
from gradnan.training.replicas import ReplicaCheck, compared_weights
from gradnan.training.rerun import StepRerun
from gradnan.training.runup import RunUp
from gradnan.training.scan import abs_max, find_nonfinite, finite_flag
from gradnan.training.weights import checkpoint_mark

SHAPE = dict(vocab_size=1024, seq_length=128, micro_batch_size=2)
SIZES = {
    "1m": dict(SHAPE, hidden_size=128, num_layers=4, num_heads=4),
    "10m": dict(SHAPE, hidden_size=384, num_layers=5, num_heads=6),
    "50m": dict(SHAPE, hidden_size=768, num_layers=7, num_heads=12),
    "20layers": dict(SHAPE, hidden_size=64, num_layers=20, num_heads=4),
    "1b": dict(hidden_size=2048, num_layers=20, num_heads=16, vocab_size=32768, seq_length=2048,
               micro_batch_size=2),
}
MODES = {"off": None, "defaults": {}, "runup_off": {"runup_steps": 0}, "rerun_off": {"rerun": "off"},
         "pre_reduction_sync": {"pre_reduction": "sync"},
         "capture_armed": {"capture_modules": "decoder.layers.0.mlp", "capture_retain": True},
         "megatron_check": None}
MEGATRON_CHECK = "megatron_check"  # the kit off, Megatron's own per-bucket check_for_nan_in_grad on


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class KitClock:
    """Host time spent inside the kit during a step: every hook runs its work through the runtime's guard
    (``ErrorGuard``); only the outermost of nested guarded calls is timed. On CPU that is the kit's whole
    cost; on a GPU it is what the kit adds to the host's side of the step, the device not waited for (a
    synchronization there would time the queued training kernels instead). Not the traced forward of an
    armed capture, which runs inside the module: for that mode the step ratio is the figure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = ErrorGuard.__call__
        self._depth = 0

    def __enter__(self) -> "KitClock":
        original, clock = self._original, self

        def timed_guarded(guard, what, fn, *args):
            if clock._depth:
                return original(guard, what, fn, *args)
            start = time.perf_counter()
            clock._depth += 1
            try:
                return original(guard, what, fn, *args)
            finally:
                clock._depth -= 1
                clock.seconds += time.perf_counter() - start

        ErrorGuard.__call__ = timed_guarded
        return self

    def __exit__(self, *exc: Any) -> None:
        ErrorGuard.__call__ = self._original


def _quartiles(values: List[float]) -> List[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def step_times(model: TinyGPT, rounds: int, out_dir: str, device: torch.device) -> Dict[str, Any]:
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    kit_share: Dict[str, List[float]] = {mode: [] for mode in MODES if MODES[mode] is not None}
    names = list(MODES)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for mode in order:
            gradnan.uninstall()
            if MODES[mode] is not None:
                gradnan.install(out_dir=out_dir, log_level="ERROR", **MODES[mode])
            for chunk in model.chunks:
                chunk.ddp_config.check_for_nan_in_grad = mode == MEGATRON_CHECK
            model.step()
            times[mode].append(_timed(model.step, device))
            if mode in kit_share:
                with KitClock() as clock:
                    seconds = _timed(model.step, device)
                kit_share[mode].append(clock.seconds / seconds)
    gradnan.uninstall()
    for chunk in model.chunks:
        chunk.ddp_config.check_for_nan_in_grad = False
    ratios = {mode: [t / base for t, base in zip(times[mode], times["off"])]
              for mode in times if mode != "off"}
    runup = [t / base for t, base in zip(times["defaults"], times["runup_off"])]
    return {
        "runup_ratio": {"median": statistics.median(runup), "quartiles": _quartiles(runup),
                        "kit_share_difference": statistics.median(kit_share["defaults"])
                        - statistics.median(kit_share["runup_off"])},
        "median_s": {mode: statistics.median(values) for mode, values in times.items()},
        "median_ratio": {mode: statistics.median(values) for mode, values in ratios.items()},
        "ratio_quartiles": {mode: _quartiles(values) for mode, values in ratios.items()},
        "median_kit_share": {mode: statistics.median(values) for mode, values in kit_share.items()},
    }


def runup_write_cost(model: TinyGPT, steps: int, device: torch.device) -> Dict[str, Any]:
    """The run-up's own work on a healthy step, alone: every bucket group's maxima (as the pre-reduction
    check computed them) copied into its ring, ``steps`` times (the ring wraps); median seconds per step."""
    groups = [group for chunk in model.chunks for group in chunk.bucket_groups]
    maxima = [torch.stack([abs_max(bucket.grad_data) for bucket in group.buckets]) for group in groups]
    ring = RunUp(32)

    def write(step: int) -> None:
        for index, (group, values) in enumerate(zip(groups, maxima)):
            ring.write(group, index, step, values, list)

    seconds = [_timed(partial(write, step), device) for step in range(steps)]
    return {"bucket_groups": len(groups), "buckets": sum(len(g.buckets) for g in groups),
            "median_s": statistics.median(seconds)}


def replica_check_cost(model: TinyGPT, reps: int, device: torch.device) -> Dict[str, Any]:
    """The replica check alone (``replicas.py``), on this one-process job's weights (its group of one
    stands in for the data-parallel peers: the same kernels, an all-reduce of 16 bytes): one check started
    and its result read, timed with the device waited for, ``reps`` times; its operators and host syncs.
    At the default cadence its cost per step is the median divided by ``replica_check_every``."""
    weights = compared_weights(global_named_parameters(model.chunks), [])
    group = torch.distributed.group.WORLD

    def check() -> None:
        assert not ReplicaCheck.start(1, None, weights, group).differed()

    check()
    seconds = [_timed(check, device) for _ in range(reps)]
    with OperatorCounter() as operators:
        check()
    with HostSyncCounter() as syncs:
        check()
    return {"params": len(weights), "median_s": statistics.median(seconds), "operators": operators.total,
            "host_syncs": syncs.total, "every": GradnanConfig().replica_check_every}


def checkpoint_cost(model: TinyGPT, reps: int, out_dir: str, device: torch.device) -> Dict[str, Any]:
    """A save of the model (``dist_checkpointing.save``, into a fresh directory each time) and the mark the
    kit takes at a save (``checkpoint_mark`` of what ``optimizer_tensors`` reads), interleaved ``reps``
    times; medians, and the mark's host reads."""
    from gradnan.patches.model import optimizer_tensors

    def mark() -> Dict[str, Any]:
        return checkpoint_mark(optimizer_tensors(model.optimizer, model.chunks))

    seconds: Dict[str, List[float]] = {"save": [], "mark": []}
    for rep in range(reps):
        save = partial(model.save, os.path.join(out_dir, f"checkpoints{rep}"))
        seconds["save"].append(_timed(save, device))
        seconds["mark"].append(_timed(mark, device))
    counter = HostSyncCounter()
    with counter:
        assert mark()["clean"]
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {"save_s": median["save"], "mark_s": median["mark"],
            "mark_vs_save": median["mark"] / median["save"], "mark_host_syncs": counter.total}


def scan_costs(model: TinyGPT, reps: int, device: torch.device) -> Dict[str, Any]:
    params = [p for p in model.chunk.parameters() if p.requires_grad]
    buffer = model.chunk.buffers[0].grad_data
    grads = [p.main_grad for p in params]
    bad = len(grads) // 2
    grads[bad].view(-1)[grads[bad].numel() // 3] = float("nan")
    copies = [g.clone() for g in grads]
    copy_target = torch.empty_like(buffer)
    checks = {
        "device copy of the grad buffer": lambda: copy_target.copy_(buffer),
        "floor: one check over the grad buffer": lambda: bool(finite_flag(buffer)),
        "gradnan scan (main_grad views)": lambda: find_nonfinite(grads),
        "gradnan scan (separate tensors)": lambda: find_nonfinite(copies),
        "recipe: isnan(g).any() per parameter": lambda: [i for i, g in enumerate(grads)
                                                         if torch.isnan(g).any()],
    }
    assert [i for i, _ in find_nonfinite(grads)] == [bad] == [i for i, _ in find_nonfinite(copies)]
    timed = checks
    if device.type == "cpu":  # no CPU shim on a GPU: time the scans without its per-call Python mode
        timed = {name: _without_torch_function(check) for name, check in checks.items()}
    seconds: Dict[str, List[float]] = {name: [] for name in checks}
    for _ in range(reps):
        for name, check in timed.items():
            seconds[name].append(_timed(check, device))
    result: Dict[str, Any] = {"params": len(grads),
                              "grad_buffer_bytes": buffer.numel() * buffer.element_size(), "checks": {}}
    floor = statistics.median(seconds["floor: one check over the grad buffer"])
    for name, check in checks.items():
        counter = HostSyncCounter()
        with counter:
            check()
        with PeakMemory(device) as peak:
            check()
        with OperatorCounter() as operators:
            check()
        median = statistics.median(seconds[name])
        result["checks"][name] = {"median_s": median, "vs_floor": median / floor, "host_syncs": counter.total,
                                  "operators": operators.total, "kernels": kernel_profile(check, device),
                                  "gb_per_s": result["grad_buffer_bytes"] / median / 1e9,
                                  "peak_extra_bytes": peak.bytes,
                                  "peak_extra_pct_of_grads": 100.0 * peak.bytes / result["grad_buffer_bytes"]}
    grads[bad].zero_()
    return result


def kernel_profile(check: Callable[[], Any], device: torch.device, top: int = 6) -> Dict[str, Any]:
    """On a GPU, what one call of ``check`` ran on the device (``torch.profiler``): kernels launched, their
    device time in all, and the ``top`` kernels by device time; nothing on a CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        check()
        _sync(device)
    kernels = [event for event in profiled.key_averages() if getattr(event, "device_time_total", 0) > 0]
    kernels.sort(key=lambda event: event.device_time_total, reverse=True)
    return {"launches": sum(event.count for event in kernels),
            "device_ms": sum(event.device_time_total for event in kernels) / 1e3,
            "top": [{"kernel": event.key[:90], "calls": event.count,
                     "device_ms": event.device_time_total / 1e3} for event in kernels[:top]]}


def incident_cost(job: TinyGPTJob, reps: int, out_dir: str, device: torch.device) -> Dict[str, Any]:
    """The failing step without and with the kit (defaults, a fresh installation and out dir each time),
    interleaved, on an fp16 copy of ``job``: an Inf out of the last layer's MLP skips the step, so the
    weights stay as they were for the next repetition. The extra is given in forward passes."""
    model = TinyGPT(job.with_(dtype="fp16"), 0)
    model.step()
    batch = next(model.batches[0])
    forward = [_timed(lambda: _forward(model, batch), device) for _ in range(reps + 1)][1:]
    seconds: Dict[str, List[float]] = {"without": [], "with": []}
    for rep in range(reps):
        for mode in ("without", "with"):
            gradnan.uninstall()
            if mode == "with":
                gradnan.install(out_dir=os.path.join(out_dir, f"incident{rep}"), log_level="CRITICAL")
            step = len(model.result.steps) + 1
            model.job = model.job.with_(injections=(
                Injection(0, step, f"decoder.layers.{job.num_layers - 1}.mlp", "inf", where="forward"),))
            seconds[mode].append(_timed(model.step, device))
    gradnan.uninstall()
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    one_forward = statistics.median(forward)
    return {"forward_s": one_forward, "failing_step_s": median,
            "extra_forward_passes": (median["with"] - median["without"]) / one_forward}


def incident_operators(job: TinyGPTJob, out_dir: str) -> Dict[str, Any]:
    """The failing step's operators (``OperatorCounter``: every operator dispatched, forward, backward and
    the kit's; on a GPU each is a launch or a view), without the kit and with it (defaults, installed as a
    user does, before the optimizer is built), each on a fresh model of ``job`` after one healthy step (the
    step without the kit applies the non-finite update). An Inf out of the last layer's MLP spreads to
    every gradient. The extra in forward passes of that model (a ``no_grad`` forward's operators), and the
    kit's operators by phase: the gradient scan (``offending_params``, ``largest_gradient``), the
    pre-reduction flags read at the norm, the state record (weights and optimizer state), the rerun of the
    step (its two forward passes included), the rest."""
    from gradnan.patches.model import destroy_model_parallel

    failing = job.with_(injections=(
        Injection(0, 2, f"decoder.layers.{job.num_layers - 1}.mlp", "inf", where="forward"),))
    counts: Dict[str, Any] = {}
    for mode in ("without", "with"):
        gradnan.uninstall()
        install = partial(gradnan.install, out_dir=os.path.join(out_dir, "operators"), log_level="CRITICAL")
        model = TinyGPT(failing, 0, install=install if mode == "with" else None)
        if mode == "without":
            with OperatorCounter() as forward:
                _forward(model, next(model.batches[0]))
            counts["forward"] = forward.total
        model.step()
        ops = OperatorCounter()
        with patch_scope() as patcher:
            for owner, name, label in _PHASES:
                patcher.wrap(owner, name, ops.phase(label))
            with ops:
                outcome = model.step()
        assert outcome.grad_norm is None or not math.isfinite(outcome.grad_norm)
        counts[mode] = ops.total
        if mode == "with":
            counts["by_phase"] = dict(ops.by_phase, other=ops.by_phase["other"] - counts["without"])
        del model
        destroy_model_parallel()
    gradnan.uninstall()
    counts["extra_forward_passes"] = (counts["with"] - counts["without"]) / counts["forward"]
    return counts


_PHASES = [(incident_module, "offending_params", "gradient scan"),
           (incident_module, "largest_gradient", "gradient scan"),
           (incident_module.Detections, "_flush_deferred", "pre-reduction flags"),
           (incident_module.Detections, "state", "state record"), (StepRerun, "incident", "rerun")]


def _forward(model: TinyGPT, batch: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        model.chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def _without_torch_function(check: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch._C.DisableTorchFunction():
            return check()

    return run


def _setup() -> torch.device:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if torch.cuda.is_available():
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    from gradnan.testing.cpu_shim import SHIM

    SHIM.activate()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    return torch.device("cpu")


def _table(results: Dict[str, Any]) -> str:
    lines = ["| size | params | step off (s) | mode | step / off: median [quartiles] | kit time / step |",
             "|---|---|---|---|---|---|"]
    for size, entry in results["sizes"].items():
        steps = entry["steps"]
        for mode in steps["median_ratio"]:
            low, _, high = steps["ratio_quartiles"][mode]
            share = steps["median_kit_share"].get(mode)
            lines.append(f"| {size} | {entry['model_params'] / 1e6:.1f}M | {steps['median_s']['off']:.3f} "
                         f"| {mode} | {steps['median_ratio'][mode]:.3f} [{low:.3f}, {high:.3f}] | "
                         f"{'-' if share is None else f'{100 * share:.2f}%'} |")
    lines += ["", "| size | run-up: defaults / runup_off step, median [quartiles] | kit time / step,"
              " difference | ring writes alone / step (buckets) |", "|---|---|---|---|"]
    for size, entry in results["sizes"].items():
        runup, write = entry["steps"]["runup_ratio"], entry["runup_write"]
        low, _, high = runup["quartiles"]
        share = write["median_s"] / entry["steps"]["median_s"]["off"]
        lines.append(f"| {size} | {runup['median']:.3f} [{low:.3f}, {high:.3f}] | "
                     f"{100 * runup['kit_share_difference']:+.2f} points | {100 * share:.3f}%"
                     f" ({write['median_s'] * 1e6:.0f} us, {write['buckets']}) |")
    lines += ["", "| size | replica check: median (ms) | operators | host syncs | parameters |"
              " every (steps) | per step at that cadence |", "|---|---|---|---|---|---|---|"]
    for size, entry in results["sizes"].items():
        check = entry["replica_check"]
        share = check["median_s"] / (check["every"] * entry["steps"]["median_s"]["off"])
        lines.append(f"| {size} | {check['median_s'] * 1e3:.3f} | {check['operators']:,} |"
                     f" {check['host_syncs']} | {check['params']} | {check['every']} | {100 * share:.4f}% |")
    lines += ["", "| size | check | median (ms) | GB/s | x floor | host syncs | operators | peak extra "
              "(% of grad bytes) |", "|---|---|---|---|---|---|---|---|"]
    for size, entry in results["sizes"].items():
        for name, check in entry["scan"]["checks"].items():
            lines.append(f"| {size} | {name} | {check['median_s'] * 1e3:.3f} | {check['gb_per_s']:.1f} | "
                         f"{check['vs_floor']:.2f} | {check['host_syncs']} | {check['operators']:,} | "
                         f"{check['peak_extra_pct_of_grads']:.3f} |")
    profiled = [(size, name, check["kernels"]) for size, entry in results["sizes"].items()
                for name, check in entry["scan"]["checks"].items() if check["kernels"]]
    if profiled:
        lines += ["", "| size | check | kernels launched | device time (ms) | its kernels by device time |",
                  "|---|---|---|---|---|"]
        for size, name, kernels in profiled:
            top = "; ".join(f"{kernel['kernel']} x{kernel['calls']} {kernel['device_ms']:.3f} ms"
                            for kernel in kernels["top"])
            lines.append(f"| {size} | {name} | {kernels['launches']} | {kernels['device_ms']:.3f} | {top} |")
    saves = {size: entry["checkpoint"] for size, entry in results["sizes"].items() if "checkpoint" in entry}
    if saves:
        lines += ["", "| size | checkpoint save, dist_checkpointing.save (s) | the kit's mark of it (s) |"
                  " mark / save | host reads of the mark |", "|---|---|---|---|---|"]
        for size, cost in saves.items():
            lines.append(f"| {size} | {cost['save_s']:.4f} | {cost['mark_s']:.4f} |"
                         f" {cost['mark_vs_save']:.3f} | {cost['mark_host_syncs']} |")
    incidents = {size: entry["incident"] for size, entry in results["sizes"].items() if "incident" in entry}
    if incidents:
        lines += ["", "| size | forward pass (s) | failing step without the kit (s) | with it (s) | "
                  "extra, in forward passes |", "|---|---|---|---|---|"]
        for size, cost in incidents.items():
            lines.append(f"| {size} | {cost['forward_s']:.4f} | {cost['failing_step_s']['without']:.4f} | "
                         f"{cost['failing_step_s']['with']:.4f} | {cost['extra_forward_passes']:.2f} |")
        lines += ["", "| size | dtype | operators: forward pass | failing step without the kit | with it | "
                  "extra, in forward passes | the kit's, by phase |", "|---|---|---|---|---|---|---|"]
        for size, cost in incidents.items():
            ops = cost["operators"]
            phases = ", ".join(f"{name} {count:,}" for name, count in sorted(ops["by_phase"].items()))
            lines.append(f"| {size} | {results['dtype']} | {ops['forward']:,} | {ops['without']:,} | "
                         f"{ops['with']:,} | {ops['extra_forward_passes']:.2f} | {phases} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1m,10m,50m")
    parser.add_argument("--rounds", type=int, default=0, help="step-time rounds per size (0: by size)")
    parser.add_argument("--scan-reps", type=int, default=15)
    parser.add_argument("--dtype", default=None, help="fp32 on CPU, bf16 on GPU by default")
    parser.add_argument("--json", default="benchmark-overhead.json")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="micro-batches per step (gradient accumulation): the checks run once a step")
    parser.add_argument("--checkpoint-reps", type=int, default=5, metavar="REPS",
                        help="checkpoint saves and marks timed, each (0: none)")
    parser.add_argument("--incident", type=int, default=0, metavar="REPS",
                        help="also time the failing step without and with the kit, REPS times each")
    args = parser.parse_args()
    device = _setup()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    default_rounds = {"1m": 21, "10m": 11, "50m": 7, "20layers": 5, "1b": 9}
    results: Dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "dtype": dtype, "micro_batches": args.micro_batches, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="gradnan-bench-") as out_dir:
        for size in args.sizes.split(","):
            job = TinyGPTJob(world_size=1, dtype=dtype, device=device.type, bucket_size=1_000_000,
                             micro_batches=args.micro_batches, **SIZES[size])
            model = TinyGPT(job, 0)
            model.step()
            entry = {"model_params": sum(p.numel() for p in model.chunk.parameters())}
            entry["steps"] = step_times(model, args.rounds or default_rounds[size], out_dir, device)
            print(f"{size}: steps {json.dumps(entry['steps'])}", flush=True)
            entry["runup_write"] = runup_write_cost(model, 200, device)
            entry["scan"] = scan_costs(model, args.scan_reps, device)
            print(f"{size}: scan {json.dumps(entry['scan'])}", flush=True)
            entry["replica_check"] = replica_check_cost(model, args.scan_reps, device)
            print(f"{size}: replica check {json.dumps(entry['replica_check'])}", flush=True)
            if args.checkpoint_reps:
                entry["checkpoint"] = checkpoint_cost(model, args.checkpoint_reps, out_dir, device)
            results["sizes"][size] = entry
            from gradnan.patches.model import destroy_model_parallel

            del model
            destroy_model_parallel()
            if args.incident:
                entry["incident"] = incident_cost(job, args.incident, out_dir, device)
                destroy_model_parallel()
                entry["incident"]["operators"] = incident_operators(job, out_dir)
            print(f"{size}: done", flush=True)
    with open(args.json, "w") as stream:
        json.dump(results, stream, indent=1)
    print(_table(results))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
