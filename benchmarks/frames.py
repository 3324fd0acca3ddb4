"""Frame tracing on a healthy step: gradnan's device-side frames against Hugging Face's per-tensor host syncs.

    python benchmarks/frames.py              # two GPTs (hidden 256 x 4 layers, 512 x 8),
                                             # about 3 minutes on 2 cores
    python benchmarks/frames.py --quick      # the small GPT only, a few rounds: about 30 seconds
    python benchmarks/frames.py --rounds 15 --sizes medium

Real megatron-core, one process (CPU with the shim in fp32, or a real GPU in bf16 when CUDA is there), the
harness of ``overhead.py`` (``gradnan.testing.toy.TinyGPT``: Megatron DDP and ``get_megatron_optimizer``'s
Adam). On the same model, one full training step (forward, backward, optimizer step) is timed in three ways,
interleaved round by round in a rotating order so that drift falls on all of them alike:

- ``off``: no tracing;
- ``gradnan``: ``gradnan.training.frames.FrameTracer`` in detect mode over every module
  (``global_named_modules``), as ``Runtime`` runs it: an ``aminmax`` of |x| per floating tensor left on the
  device, weights measured once per step, then ``read()`` (one host copy) and ``FrameBuffer.add`` once per
  step;
- ``hf``: ``HfStyleOverflowDebugger``, a re-implementation of
  ``transformers.debug_utils.DebugUnderflowOverflow`` (a forward hook on every module; per weight, input and
  output tensor an ``abs().min()``/``abs().max()`` formatted into a string and
  ``isnan(x).any().item()``/``isinf(x).any().item()``: four host reads each).

Prints medians with quartiles, the median per-round ratio to ``off``, the extra time over ``off`` and hf's
extra over gradnan's, host syncs per step (``gradnan.testing.measure.HostSyncCounter``), frames and tensors
measured per step. On CPU both wall-clock and process CPU time are reported, with one intra-op thread by
default (``--threads``): on a small machine shared with other work, multi-threaded step times swing tenfold,
while one thread's CPU time barely moves. On CPU no host read waits, so there the difference is the work
itself (HF's seven passes and three full-size temporaries per tensor, its weights re-read at every call,
against gradnan's two passes and one temporary); on a GPU each of HF's host syncs also stalls the stream.
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gradnan.patches.model import destroy_model_parallel, global_named_modules, unwrap_model
from gradnan.patches.module_hooks import ModuleHooks
from gradnan.testing.gloo import free_port
from gradnan.testing.measure import HostSyncCounter
from gradnan.testing.toy import TinyGPT
from gradnan.testing.toy_job import TinyGPTJob
from gradnan.training.frames import FrameBuffer, FrameTracer

try:  # python benchmarks/frames.py: the script's folder is on sys.path
    from overhead import _quartiles, _setup, _sync
except ImportError:  # python -m benchmarks.frames
    from benchmarks.overhead import _quartiles, _setup, _sync

SIZES = {
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4),
    "medium": dict(hidden_size=512, num_layers=8, num_heads=8),
}
DEFAULT_ROUNDS = {"tiny": 21, "medium": 13}
QUICK_ROUNDS = 5


# -- (c) Hugging Face's approach ------------------------------------------------------------------------


def get_abs_min_max(var: torch.Tensor, ctx: str) -> str:
    """As transformers' ``get_abs_min_max``: two host reads (``Tensor.__format__`` calls ``item()``).
    One departure: ``abs`` has no bool kernel, so a bool tensor (Megatron's attention mask, passed
    positionally to ``GPTModel``) is read as uint8, where the original would raise."""
    abs_var = var.to(torch.uint8) if var.dtype == torch.bool else var.abs()
    return f"{abs_var.min():8.2e} {abs_var.max():8.2e} {ctx}"


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """As transformers' ``detect_overflow``: two host reads."""
    detected = False
    if torch.isnan(var).any().item():
        detected = True
        print(f"{ctx} has nans")
    if torch.isinf(var).any().item():
        detected = True
        print(f"{ctx} has infs")
    return detected


class HfStyleOverflowDebugger:
    """``DebugUnderflowOverflow(model)`` in detection mode, hook for hook: a forward hook (positional
    inputs only) on every module of ``model``; each call becomes a frame of text lines, one per weight
    (``recurse=False``), input and output tensor; the last ``max_frames_to_save`` frames are kept in a deque.
    ``remove()`` takes the hooks off again (the original has no way to)."""

    def __init__(self, model: torch.nn.Module, max_frames_to_save: int = 21) -> None:
        self.model = model
        self.trace_batch_nums: List[int] = []
        self.frames: Any = collections.deque([], max_frames_to_save)
        self.frame: List[str] = []
        self.batch_number = 0
        self.total_calls = 0
        self.tensors_analysed = 0  # not in the original: what the benchmark reports
        self.detected_overflow = False
        self.prefix = "                 "
        self.module_names = {m: name for name, m in self.model.named_modules()}
        self._handles: List[Any] = []
        self.register_forward_hook()

    def register_forward_hook(self) -> None:
        self._handles += [module.register_forward_hook(self.forward_hook) for module in self.model.modules()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def save_frame(self, frame: Optional[str] = None) -> None:
        if frame is not None:
            self.expand_frame(frame)
        self.frames.append("\n".join(self.frame))
        self.frame = []

    def expand_frame(self, line: str) -> None:
        self.frame.append(line)

    def trace_frames(self) -> None:
        print("\n".join(self.frames))
        self.frames = []

    def reset_saved_frames(self) -> None:
        self.frames = []

    def dump_saved_frames(self) -> None:
        print(f"\nDetected inf/nan during batch_number={self.batch_number}")
        print(f"Last {len(self.frames)} forward frames:")
        print(f"{'abs min':8} {'abs max':8} metadata")
        print("\n".join(self.frames))
        print("\n\n")
        self.frames = []

    def analyse_variable(self, var: Any, ctx: str) -> None:
        if torch.is_tensor(var):
            self.tensors_analysed += 1
            self.expand_frame(get_abs_min_max(var, ctx))
            if detect_overflow(var, ctx):
                self.detected_overflow = True
        elif var is None:
            self.expand_frame(f"{'None':>17} {ctx}")
        else:
            self.expand_frame(f"{'not a tensor':>17} {ctx}")

    def batch_start_frame(self) -> None:
        self.expand_frame(f"\n\n{self.prefix} *** Starting batch number={self.batch_number} ***")
        self.expand_frame(f"{'abs min':8} {'abs max':8} metadata")

    def create_frame(self, module: torch.nn.Module, input: Any, output: Any) -> None:
        self.expand_frame(f"{self.prefix} {self.module_names[module]} {module.__class__.__name__}")
        for name, p in module.named_parameters(recurse=False):
            self.analyse_variable(p, name)
        if isinstance(input, tuple):
            for i, x in enumerate(input):
                self.analyse_variable(x, f"input[{i}]")
        else:
            self.analyse_variable(input, "input")
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    for j, y in enumerate(x):
                        self.analyse_variable(y, f"output[{i}][{j}]")
                else:
                    self.analyse_variable(x, f"output[{i}]")
        else:
            self.analyse_variable(output, "output")
        self.save_frame()

    def forward_hook(self, module: torch.nn.Module, input: Any, output: Any) -> None:
        last_frame_of_batch = False
        trace_mode = self.batch_number in self.trace_batch_nums
        if trace_mode:
            self.reset_saved_frames()
        if self.total_calls == 0:
            self.batch_start_frame()
        self.total_calls += 1
        if module == self.model:
            self.batch_number += 1
            last_frame_of_batch = True
        self.create_frame(module, input, output)
        if trace_mode:
            self.trace_frames()
        if last_frame_of_batch:
            self.batch_start_frame()
        if self.detected_overflow and not trace_mode:
            self.dump_saved_frames()
            raise ValueError("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running"
                             " further. Please scroll up above this traceback to see the activation values"
                             " prior to this event.")


# -- the three variants -----------------------------------------------------------------------------------


class Variant:
    """``attach()`` before a step, ``end_step()`` after it (inside the timed region), ``detach()`` after."""

    name = "off"

    def attach(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def detach(self) -> None:
        pass

    def counts(self) -> Tuple[int, int]:
        """(frames, tensors measured) of the last step."""
        return 0, 0


class GradnanFrames(Variant):
    """What ``Runtime`` does with ``frames="detect"``: the tracer over every module, ``read()`` once per
    step (``Runtime.flush_step``, run as the optimizer step begins), the frames into the detect ring."""

    name = "gradnan"

    def __init__(self, modules: Sequence[Tuple[str, torch.nn.Module]], max_frames: int = 21) -> None:
        self.step = 1
        self.tracer = FrameTracer(modules, lambda: self.step, lambda: True, ModuleHooks())
        self.buffer = FrameBuffer(max_frames)
        self._counts = (0, 0)

    def attach(self) -> None:
        self.tracer.attach()

    def end_step(self) -> None:
        frames = self.tracer.read()
        if self.buffer.add(frames) is not None:
            raise RuntimeError("gradnan frames: a healthy step went non-finite")
        self.step += 1
        self._counts = (len(frames), len({i for frame in frames for i in frame.stats if i is not None}))

    def detach(self) -> None:
        self.tracer.detach()

    def counts(self) -> Tuple[int, int]:
        return self._counts


class HfStyle(Variant):
    name = "hf"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.debugger: Optional[HfStyleOverflowDebugger] = None
        self._counts = (0, 0)
        self._start = (0, 0)

    def attach(self) -> None:
        if self.debugger is None:  # the frames deque and batch count live on across steps, as in the original
            self.debugger = HfStyleOverflowDebugger(self.model)
        else:
            self.debugger.register_forward_hook()
        self._start = (self.debugger.total_calls, self.debugger.tensors_analysed)

    def end_step(self) -> None:
        debugger = self.debugger
        self._counts = (debugger.total_calls - self._start[0], debugger.tensors_analysed - self._start[1])

    def detach(self) -> None:
        self.debugger.remove()

    def counts(self) -> Tuple[int, int]:
        return self._counts


# -- measuring ----------------------------------------------------------------------------------------------


def _one_step(model: TinyGPT, variant: Variant) -> None:
    model.step()
    variant.end_step()


def _timed_step(model: TinyGPT, variant: Variant, device: torch.device) -> Tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step; the CPU time is what the step itself computed,
    whatever else the machine runs (with one intra-op thread it barely moves)."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    _one_step(model, variant)
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _summary(mine: List[float], base: List[float]) -> Dict[str, Any]:
    ratios = [t / b for t, b in zip(mine, base)]
    return {"median_s": statistics.median(mine), "quartiles_s": _quartiles(mine),
            "ratio": statistics.median(ratios), "ratio_quartiles": _quartiles(ratios),
            "extra_s": statistics.median([t - b for t, b in zip(mine, base)])}


def measure(model: TinyGPT, variants: List[Variant], rounds: int, device: torch.device) -> Dict[str, Any]:
    wall: Dict[str, List[float]] = {v.name: [] for v in variants}
    cpu: Dict[str, List[float]] = {v.name: [] for v in variants}
    for round_index in range(rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.attach()
            try:
                seconds, cpu_seconds = _timed_step(model, variant, device)
            finally:
                variant.detach()
            wall[variant.name].append(seconds)
            cpu[variant.name].append(cpu_seconds)
    result: Dict[str, Any] = {}
    for variant in variants:  # one more step each, its host syncs counted (on CPU nothing waits; the count is
        variant.attach()      # what a GPU would wait for)
        try:
            with HostSyncCounter() as counter:
                _one_step(model, variant)
        finally:
            variant.detach()
        frames, tensors = variant.counts()
        result[variant.name] = {"wall": _summary(wall[variant.name], wall["off"]),
                                "cpu": _summary(cpu[variant.name], cpu["off"]),
                                "host_syncs": counter.total, "frames": frames, "tensors": tensors}
    return result


# -- report -------------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _cells(row: Dict[str, Any]) -> str:
    low, _, high = row["quartiles_s"]
    rlow, _, rhigh = row["ratio_quartiles"]
    return (f"{_ms(row['median_s'])} [{_ms(low)}, {_ms(high)}] | {row['ratio']:.3f} "
            f"[{rlow:.3f}, {rhigh:.3f}] | {_ms(row['extra_s'])}")


def _versus(entry: Dict[str, Any], clock: str) -> str:
    ours, theirs = entry["variants"]["gradnan"][clock], entry["variants"]["hf"][clock]
    verdict = (f"{theirs['extra_s'] / ours['extra_s']:.1f}x" if ours["extra_s"] > 0
               else "n/a (gradnan's extra <= 0: within noise)")
    return (f"{clock}: hf extra / gradnan extra = {_ms(theirs['extra_s'])} / {_ms(ours['extra_s'])} ms "
            f"= {verdict}, hf step / gradnan step = {theirs['median_s'] / ours['median_s']:.3f}")


def table(results: Dict[str, Any], with_cpu: bool) -> str:
    clocks = ["wall", "cpu"] if with_cpu else ["wall"]
    head = "| size | params | variant |"
    for clock in clocks:
        head += f" {clock} ms: median [q1, q3] | {clock} / off: median [q1, q3] | {clock} extra ms |"
    head += " host syncs / step (extra) | frames / step | tensors measured / step |"
    lines = [head, "|" + "---|" * (3 + 3 * len(clocks) + 3)]
    for size, entry in results.items():
        off = entry["variants"]["off"]
        for name, row in entry["variants"].items():
            lines.append(f"| {size} | {entry['params'] / 1e6:.1f}M | {name} | "
                         + " | ".join(_cells(row[clock]) for clock in clocks)
                         + f" | {row['host_syncs']} ({row['host_syncs'] - off['host_syncs']:+d}) "
                         f"| {row['frames']} | {row['tensors']} |")
    lines.append("")
    for size, entry in results.items():
        lines.append(f"{size} ({entry['rounds']} rounds): "
                     + "; ".join(_versus(entry, clock) for clock in clocks))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds per size (0: by size)")
    parser.add_argument("--quick", action="store_true", help=f"tiny only, {QUICK_ROUNDS} rounds (about 30 s)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="fp32 on CPU, bf16 on GPU by default")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (0: one per core). One by default: on a small shared"
                             " machine, other processes make multi-threaded step times swing tenfold")
    parser.add_argument("--show-warnings", action="store_true",
                        help="megatron's UserWarnings (TE/Apex missing, ...)")
    args = parser.parse_args()
    sizes = (args.sizes or ("tiny" if args.quick else ",".join(SIZES))).split(",")
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; known: {list(SIZES)}")
    began = time.perf_counter()
    if not args.show_warnings:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = _setup()
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    device_name = (torch.cuda.get_device_name(0) if device.type == "cuda"
                   else f"cpu ({platform.processor() or '?'})")
    print(f"device: {device_name}, threads {torch.get_num_threads()}, torch {torch.__version__}, "
          f"dtype {dtype}, seq {args.seq_length}, micro batch {args.micro_batch_size}", flush=True)
    results: Dict[str, Any] = {}
    for size in sizes:
        job = TinyGPTJob(world_size=1, dtype=dtype, vocab_size=1024, seq_length=args.seq_length,
                         micro_batch_size=args.micro_batch_size, bucket_size=1_000_000, **SIZES[size])
        model = TinyGPT(job, 0)
        model.step()  # warm-up, untimed
        variants = [Variant(), GradnanFrames(global_named_modules([model.chunk])),
                    HfStyle(unwrap_model(model.chunk))]  # the same modules: GPTModel and all below it
        for variant in variants[1:]:  # and once each with its hooks on
            variant.attach()
            _one_step(model, variant)
            variant.detach()
        rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS[size])
        started = time.perf_counter()
        results[size] = {"params": sum(p.numel() for p in model.chunk.parameters()), "rounds": rounds,
                         "variants": measure(model, variants, rounds, device)}
        destroy_model_parallel()
        print(f"{size}: {rounds} rounds in {time.perf_counter() - started:.0f} s", flush=True)
    print()
    print(table(results, with_cpu=device.type == "cpu"))
    print("\nextra: median over rounds of (variant step - off step) within one round; cpu: the process's"
          " CPU time (time.process_time); host syncs: one step counted with"
          " gradnan.testing.measure.HostSyncCounter (a GPU waits at"
          f" each); frames: module calls traced; total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
