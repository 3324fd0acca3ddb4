"""Why the exact counts reduce in two stages (issue 53): ``torch.segment_reduce`` over one 4M-element slice,
as one segment and cut into pieces, beside a plain reduction of the slice. On CUDA each segment is reduced
by one thread, serially; an ``[n, 3]`` input is slower still. On a CPU none of this shows.

    python benchmarks/segment_reduce.py            # the CUDA device where there is one, else the CPU

Prints the median of ``--reps`` timed calls (after one untimed call) of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict

import torch

from gradnan.training.scan import SERIAL_ELEMENTS, _pieces, _segmented


def _median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    def synchronized() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(reps):
        synchronized()
        start = time.perf_counter()
        fn()
        synchronized()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    values = torch.randn(args.elements, device=device)
    values[args.elements // 3] = float("nan")
    kinds = torch.stack([torch.isnan(values), torch.isposinf(values), torch.isneginf(values)], dim=1).float()
    one = torch.tensor([args.elements], device=device)
    pieces = _pieces([args.elements], device)
    cases: Dict[str, Callable[[], object]] = {
        "plain sum of the slice": values.sum,
        "segment_reduce, one segment, [n, 3] (before issue 53)": lambda: torch.segment_reduce(
            kinds, "sum", lengths=one),
        "segment_reduce, one segment, 1-D": lambda: torch.segment_reduce(values, "sum", lengths=one),
        f"two stages, pieces of {SERIAL_ELEMENTS}, 1-D (scan._segmented)": lambda: _segmented(
            values, "sum", pieces),
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.elements:,} elements, median of {args.reps}")
    for label, fn in cases.items():
        print(f"  {label}: {_median_ms(fn, device, args.reps):.3f} ms")


if __name__ == "__main__":
    main()
