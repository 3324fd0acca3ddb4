"""What the op digests cost at capture, measured side by side in one run.

    python benchmarks/capture_digests.py                     # CPU, or the GPU where CUDA is there
    python benchmarks/capture_digests.py --hidden 1024 --tokens 4096 --rounds 9

One transformer MLP call (Linear, GELU, Linear, bf16) timed, round by round and interleaved: plain, under
the capture's recorder without digests (``OpRecorder(digests=False)``: the capture as it was before
``gradnan.trace`` v3), and with them (one host copy and a BLAKE2b of every op's outputs). Prints the
medians and the median of the per-round ratios (digests / without). Capture runs only once armed, on the
failing path: this is the cost of recording one call, not a cost of healthy steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from gradnan.training.recorder import OpRecorder


def _timed(call: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(args.hidden, 4 * args.hidden), torch.nn.GELU(),
                              torch.nn.Linear(4 * args.hidden, args.hidden)).to(device, torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def recorded(digests: bool) -> None:
        recorder = OpRecorder(digests=digests)
        recorder.mark_inputs([x], "args")
        recorder.mark_inputs(dict(mlp.named_parameters()), "param")
        with recorder:
            out = mlp(x)
        recorder.result(out)

    modes: Dict[str, Callable[[], None]] = {"plain": lambda: mlp(x), "recorded": lambda: recorded(False),
                                            "recorded_digests": lambda: recorded(True)}
    for call in modes.values():
        call()  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, call in modes.items():
            times[name].append(_timed(call, device))
    ratios = [with_digests / without for with_digests, without
              in zip(times["recorded_digests"], times["recorded"])]
    print(f"device {device}, MLP {args.hidden} -> {4 * args.hidden} -> {args.hidden}, {args.tokens} tokens,"
          f" bf16, {args.rounds} rounds")
    print("| mode | median ms |\n|---|---|")
    for name, values in times.items():
        print(f"| {name} | {1000 * statistics.median(values):.2f} |")
    print(f"digests / recorded without, median of per-round ratios: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
