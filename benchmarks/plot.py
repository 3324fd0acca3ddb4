"""Time to draw ``gradnan report --plot`` at real scale (target: under 5 s at 16,384 ranks, issue 30).

    python benchmarks/plot.py                       # 8, 4096, 16384 ranks, PNG and SVG, into a temp dir
    python benchmarks/plot.py --ranks 4096 --out docs/incident-example.png   # the picture in docs/cli.md

The run directories are ``gradnan.testing.synthetic``'s (TP=8, PP=8-16, the rest DP, one origin), built in
memory as ``read_run`` reads them; the time is ``plot_incident`` alone (layout, drawing, writing the file),
the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gradnan.commandline import printable
from gradnan.offline.incident.analysis import analyze
from gradnan.offline.incident.plot import plot_incident
from gradnan.testing.synthetic import run_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,4096,16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write one picture here (the last --ranks)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.ranks.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="gradnan_plot_"))
    print("| ranks | format | draw_s (median) |\n|---|---|---|")
    for size in sizes:
        report = analyze(run_files(size))
        for suffix in ("png", "svg"):
            path = folder / f"incident_{size}.{suffix}"
            times = []
            for _ in range(args.reps):
                started = time.perf_counter()
                plot_incident(report, path, printable)
                times.append(time.perf_counter() - started)
            print(f"| {size} | {suffix} | {statistics.median(times):.2f} |", flush=True)
    if args.out:
        plot_incident(analyze(run_files(sizes[-1])), args.out, printable)
    print(f"\npictures: {folder}")


if __name__ == "__main__":
    main()
