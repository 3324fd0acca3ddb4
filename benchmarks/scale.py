"""gradnan at real scale: the report and maps over thousands of ranks, maps of 50,000 tensors, the scans.

    python benchmarks/scale.py                        # 64, 512, 4096 ranks (about 3 minutes on 2 cores)
    python benchmarks/scale.py --ranks 64,512,4096,16384 --records-mb 200   # with the 16,384-rank target
    python benchmarks/scale.py --parts scan,locate --reps 9    # the scans only (under a minute)

1. ``runs``: ``gradnan report`` in a subprocess on synthetic run directories written with the kit's own
   writers (``gradnan.testing.synthetic``: TP=8, PP=8-16, the rest DP, 290 map entries a rank, one
   origin): CPU time (user + system) and peak RSS of that process (``os.wait4`` in a small launcher, so
   the figure is the command's own, not the benchmark's it was forked from), lines of text, whether
   the origin is the first rank it names, and the text of the largest; the same report with torch and
   megatron-core imported first (as the command ran while the package imported the training side), and
   the targets (at 16,384 ranks at most 3 s CPU and 300 MB; at 131,072 at most 10 s and 1 GB:
   ``--ranks 16384,131072 --parts runs --records-mb 0``, about 30 minutes on 2 cores, nearly all of it
   writing 131,072 ranks' files, 7.6 GB: ``--keep DIR`` keeps them for the next run); ``gradnan maps`` on
   the same
   directory as the report sends a user to it (the origin's whole map with ``--rank``; one parameter with
   ``--rank --id``), CPU time and peak RSS; then one rank whose records file holds ``--records-mb`` MB.
   Each run directory is deleted after it is measured.
2. ``map``: a map of 50,000 tensors: building the slots (``param_slots`` over a torch optimizer and a
   model named as an MoE model is, 100 layers) and ``maps.to_json`` + ``maps.write``, as the training side
   does at the first step; and ``param_slots`` again for the same optimizer, as at a later failing step.
3. ``scan``: the failing-path scan over separate tensors (``find_nonfinite``, one NaN; 50,000 of 1,000
   elements and 5,000 of 10,000) against the floor: one pass (a sum) over the same bytes as one flat
   tensor. ``locate``: over one large tensor against the same floor, in fp32, bf16, fp16 and fp64. Medians
   of ``--reps`` and their ratios, one thread (``torch.set_num_threads(1)``) for both sides.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from gradnan.formats import maps
from gradnan.patches.optimizer_params import param_slots
from gradnan.testing.synthetic import (
    TorchOptimizer,
    coords_of,
    many_tensor_model,
    origin_rank,
    stage_slots,
    write_long_records,
    write_run_dir,
)
from gradnan.training.scan import find_nonfinite, locate

# ``gradnan ARGS`` as the command ran before the offline side stopped importing the training side: torch and
# megatron-core loaded first, then the same CLI
WITH_TRAINING_SIDE = ("-c", "import sys, torch, megatron.core; from gradnan.cli import main;"
                            " sys.exit(main(sys.argv[1:]))")
# the report's targets, each for world sizes from its own up: issue 28 (5.9 s, 446 MB at commit bcdcb09);
# issue 39 (every rank's files with a run-up: 71 s and 6.2 GB at commit a6a1731)
REPORT_TARGETS = ({"ranks": 16384, "cpu_s": 3.0, "peak_mb": 300.0},
                  {"ranks": 131072, "cpu_s": 10.0, "peak_mb": 1000.0})


# Runs argv[2:] and writes its exit code, CPU time and peak RSS to the file argv[1]. A child's peak RSS on
# Linux counts the memory of the process it was forked from: forked from this small launcher, not from the
# benchmark (which holds torch and the synthetic files' writers), it is the command's own.
_MEASURE = ("import json, os, subprocess, sys\n"
            "process = subprocess.Popen(sys.argv[2:])\n"
            "_, status, usage = os.wait4(process.pid, 0)\n"
            "json.dump({'code': os.waitstatus_to_exitcode(status), 'cpu_s': usage.ru_utime + usage.ru_stime,"
            " 'peak_mb': usage.ru_maxrss / 1024}, open(sys.argv[1], 'w'))\n")


def measure_command(*args: str, preload: bool = False) -> Dict[str, float]:
    """``gradnan ARGS`` in its own process: CPU seconds, peak RSS (MB), lines of text. ``preload``: with
    torch and megatron-core imported first (``WITH_TRAINING_SIDE``)."""
    command = [sys.executable, *(WITH_TRAINING_SIDE if preload else ("-m", "gradnan")), *args]
    with tempfile.TemporaryFile() as output, tempfile.NamedTemporaryFile("r", suffix=".json") as figures:
        subprocess.run([sys.executable, "-c", _MEASURE, figures.name, *command], stdout=output,
                       stderr=subprocess.STDOUT, check=True)
        measured = json.load(figures)
        output.seek(0)
        text = output.read().decode()
    if measured["code"] != 0:
        raise SystemExit(f"gradnan {' '.join(args)} failed ({measured['code']}): {text[-500:]}")
    return {"cpu_s": measured["cpu_s"], "peak_mb": measured["peak_mb"], "lines": len(text.splitlines()),
            "text": text}


def measure_report(run_dir: Path) -> Dict[str, float]:
    return measure_command("report", str(run_dir))


def measure_maps(run_dir: Path, origin: int, world_size: int) -> Dict[str, float]:
    """``gradnan maps`` as the report sends a user to it: one rank's whole map, and one id on that rank."""
    param_id = stage_slots(coords_of(origin, world_size)["pp"])[-1].id
    rank = measure_command("maps", str(run_dir), "--rank", str(origin))
    one = measure_command("maps", str(run_dir), "--rank", str(origin), "--id", str(param_id))
    return {"maps_rank_cpu_s": rank["cpu_s"], "maps_rank_peak_mb": rank["peak_mb"],
            "maps_rank_lines": rank["lines"], "maps_id_cpu_s": one["cpu_s"],
            "maps_id_peak_mb": one["peak_mb"]}


def names_the_origin(text: str, origin: int) -> bool:
    """The line after ``Origin (...):`` is the origin rank's."""
    lines = text.splitlines()
    return any(line.startswith("Origin (") and lines[number + 1].startswith(f"  rank {origin} (")
               for number, line in enumerate(lines[:-1]))


WRITTEN = "written"  # in a kept run directory (--keep): every rank's files are there


def report_at(root: Path, world_size: int, keep: bool = False) -> Dict[str, float]:
    """``keep``: the run directory stays under ``root`` and is measured as it is where an earlier run with
    ``--keep`` wrote it whole (131,072 ranks' files take most of half an hour to write)."""
    run_dir = root / f"ranks{world_size}"
    started = time.perf_counter()
    origin = origin_rank(world_size)
    if not (keep and (run_dir / WRITTEN).exists()):
        shutil.rmtree(run_dir, ignore_errors=True)
        write_run_dir(run_dir, world_size)
        (run_dir / WRITTEN).touch()
    written = time.perf_counter() - started
    try:
        figures = measure_report(run_dir)
        loaded = measure_command("report", str(run_dir), preload=True)
        return {"ranks": world_size, "write_s": written, **figures,
                "with_torch_cpu_s": loaded["cpu_s"], "with_torch_peak_mb": loaded["peak_mb"],
                "origin_named": names_the_origin(figures["text"], origin),
                **measure_maps(run_dir, origin, world_size)}
    finally:
        if not keep:
            shutil.rmtree(run_dir)


def report_long_records(root: Path, megabytes: int) -> Dict[str, float]:
    run_dir = root / "long_records"
    count = write_long_records(run_dir, megabytes << 20)
    try:
        return {"records": count, "megabytes": megabytes, **measure_report(run_dir)}
    finally:
        shutil.rmtree(run_dir)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def map_figures(count: int, reps: int, out_dir: Path) -> Dict[str, float]:
    """The first step's work (slots built for a new optimizer, the map written), and a later failing
    step's (the slots of the same optimizer again, with its current gradients)."""
    model = many_tensor_model(count, 4)
    builds = []
    for _ in range(reps):
        optimizer = TorchOptimizer(model)
        started = time.perf_counter()
        slots, _ = param_slots(optimizer)
        builds.append(time.perf_counter() - started)
    again = median_seconds(lambda: param_slots(optimizer), reps)
    coords = {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0}
    path = out_dir / "map.json"
    write = median_seconds(lambda: maps.write(path, maps.to_json(coords, {}, {}, 0, "FP32Optimizer", slots)),
                           reps)
    build = statistics.median(builds)
    return {"tensors": count, "build_s": build, "write_s": write, "first_step_s": build + write,
            "later_steps_s": again, "file_mb": path.stat().st_size / 1e6}


def scan_figures(count: int, numel: int, reps: int) -> Dict[str, float]:
    tensors = [torch.randn(numel) for _ in range(count)]
    tensors[count // 2][numel // 3] = float("nan")
    flat = torch.randn(count * numel)
    found = find_nonfinite(tensors)
    assert [index for index, _ in found] == [count // 2], found
    scan = median_seconds(lambda: find_nonfinite(tensors), reps)
    floor = median_seconds(lambda: bool(torch.isfinite(flat.sum())), reps)
    return {"tensors": count, "elements": count * numel, "scan_s": scan, "floor_s": floor,
            "ratio": scan / floor}


def locate_figures(numel: int, dtype: torch.dtype, reps: int) -> Dict[str, float]:
    tensor = torch.randn(numel).to(dtype)
    tensor[numel // 2] = float("nan")
    assert locate(tensor).nan == 1
    found = median_seconds(lambda: locate(tensor), reps)
    floor = median_seconds(lambda: bool(torch.isfinite(tensor.sum())), reps)
    return {"dtype": str(dtype), "elements": numel, "locate_s": found, "floor_s": floor,
            "ratio": found / floor}


def table(rows: List[Dict[str, float]]) -> str:
    keys = [key for key in rows[0] if key != "text"]
    cells = [[f"{row[key]:.3g}" if isinstance(row[key], float) else str(row[key]) for key in keys]
             for row in rows]
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + ["| " + " | ".join(c) + " |"
                                                                                  for c in cells])


def target_lines(reports: List[Dict[str, float]]) -> str:
    """The report's target (``REPORT_TARGETS``: the largest at most its size) for each world size with one,
    beside the same report with the training side loaded, measured in the same run."""
    lines = []
    for row in reports:
        targets = [target for target in REPORT_TARGETS if row["ranks"] >= target["ranks"]]
        if targets:
            target = targets[-1]
            met = row["cpu_s"] <= target["cpu_s"] and row["peak_mb"] <= target["peak_mb"]
            lines.append(f"\n{row['ranks']} ranks: gradnan report {row['cpu_s']:.2f} s CPU,"
                         f" {row['peak_mb']:.0f} MB (target at most {target['cpu_s']:.0f} s"
                         f" and {target['peak_mb']:.0f} MB: {'met' if met else 'NOT met'});"
                         " with torch and megatron-core loaded:"
                         f" {row['with_torch_cpu_s']:.2f} s, {row['with_torch_peak_mb']:.0f} MB"
                         f" ({row['with_torch_cpu_s'] / row['cpu_s']:.2f}x the CPU time)")
    return "\n".join(lines)


PARTS = ("runs", "map", "scan", "locate")


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="which of %(default)s to measure")
    parser.add_argument("--ranks", default="64,512,4096", help="world sizes, comma-separated")
    parser.add_argument("--records-mb", type=int, default=200,
                        help="size of the one long records file (0: skip)")
    parser.add_argument("--tensors", type=int, default=50_000, help="tensors in the map")
    parser.add_argument("--scan-shapes", default="50000x1000,5000x10000",
                        help="separate tensors x elements of each, comma-separated (default: %(default)s)")
    parser.add_argument("--locate-numel", type=int, default=100_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the run directories here and keep them; one an earlier --keep run wrote"
                             " whole is measured as it is (delete the folder when done)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        parser.error(f"--parts: choose from {','.join(PARTS)}")
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="gradnan_scale_"))
    try:
        if "runs" in parts:
            print("## gradnan report and gradnan maps over synthetic run directories\n")
            reports = [report_at(args.keep or root, int(size), keep=args.keep is not None)
                       for size in args.ranks.split(",")]
            print(table(reports), flush=True)
            print(target_lines(reports), flush=True)
            print(f"\nThe text at {reports[-1]['ranks']} ranks:\n\n{reports[-1]['text']}", flush=True)
            if args.records_mb:
                print("\n## one rank's long records file\n")
                print(table([report_long_records(root, args.records_mb)]), flush=True)
        if "map" in parts:
            print(f"\n## a map of {args.tensors} tensors (medians of {args.reps})\n")
            print(table([map_figures(args.tensors, args.reps, root)]), flush=True)
        if "scan" in parts:
            print("\n## failing-path scan over separate tensors vs one pass over the same bytes"
                  f" (medians of {args.reps})\n")
            shapes = [shape.split("x") for shape in args.scan_shapes.split(",")]
            print(table([scan_figures(int(count), int(numel), args.reps) for count, numel in shapes]),
                  flush=True)
        if "locate" in parts:
            print(f"\n## locate over one large tensor vs one pass over it (medians of {args.reps})\n")
            print(table([locate_figures(args.locate_numel, dtype, args.reps)
                         for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
