"""The two big untrusted inputs of issue 25, timed: a records file followed by millions of junk lines
(``gradnan report``), and a map of a million rows (``gradnan maps --id``).

    python benchmarks/hostile_inputs.py                   # 50 M junk lines, a 1.16 M-row map
    python benchmarks/hostile_inputs.py --junk 5000000 --rows 200000

Each command runs in a process of its own (``python -m gradnan``); its wall time and peak resident memory
(``ru_maxrss`` of the child) are printed. The problem list stays at ``read.MAX_PROBLEMS`` entries whatever
the junk, and ``maps --id`` holds one chunk of the table, so memory stays flat as the inputs grow; time
grows with them (each line and row is still read and checked). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

from gradnan.formats import maps
from gradnan.formats.layout import rank_tag

COORDS = {"global_rank": 0, "world_size": 1, "tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "dp": 0,
          "dp_size": 1, "host": "node-0", "device": "cuda:0"}
RUN = {"id": None, "attempt": "0", "started": 1.7e9, "rendezvous": None}


def _record() -> bytes:
    return json.dumps({"schema": "gradnan.record", "version": 1, "kind": "pre_reduction", "step": 1,
                       "time": 1.7e9, "rank": COORDS, "run": RUN, "params_total": 1,
                       "params": [{"id": 0, "name": "decoder.weight", "nan": 1, "inf": 0,
                                   "abs_max_finite": 0.5}]}).encode() + b"\n"


def junk_run(run_dir: Path, lines: int) -> None:
    path = run_dir / "records" / f"{rank_tag(COORDS)}.jsonl"
    path.parent.mkdir(parents=True)
    block = b"junk line\n" * 100_000
    with path.open("wb") as stream:
        stream.write(_record())
        for _ in range(lines // 100_000):
            stream.write(block)
        stream.write(b"junk line\n" * (lines % 100_000))


def big_map(run_dir: Path, rows: int) -> None:
    row = ["torch.bfloat16", 8, 0, 1.0, None, False, 0, None, "torch.float32"]
    document = {**maps.SCHEMA.header(), "written_at": 1.7e9, "rank": COORDS, "versions": {}, "run": RUN,
                "optimizer_index": 0, "optimizer_class": "DistributedOptimizer", "params_count": rows,
                "param_columns": list(maps.COLUMNS),
                "params": [[i, f"decoder.layers.{i}.mlp.weight", [4, 2], *row, i] for i in range(rows)]}
    maps.write(run_dir / "maps" / f"{rank_tag(COORDS)}.json", document)


def timed(argv: List[str]) -> Tuple[float, float, int]:
    """Wall seconds, the child's own peak resident memory in MiB (``wait4``), and its exit code."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "gradnan", *argv], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, child.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junk", type=int, default=50_000_000, help="junk lines after one record")
    parser.add_argument("--rows", type=int, default=1_160_000, help="rows of the map")
    parser.add_argument("--make", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:  # in a process of its own: a child forked from a parent that built it inherits its peak
        kind, where = args.make
        (junk_run if kind == "junk" else big_map)(Path(where), args.junk if kind == "junk" else args.rows)
        return
    with tempfile.TemporaryDirectory(prefix="gradnan-hostile-") as scratch:
        junk, table = Path(scratch) / "junk", Path(scratch) / "map"
        for kind, where in (("junk", junk), ("map", table)):
            subprocess.run([sys.executable, __file__, "--junk", str(args.junk), "--rows", str(args.rows),
                            "--make", kind, str(where)], check=True)
        wall, peak, code = timed(["report", str(junk)])
        print(f"report, 1 record + {args.junk:,} junk lines: {wall:.1f} s, peak {peak:.0f} MiB (exit {code})")
        wall, peak, code = timed(["maps", str(table), "--id", "5"])
        print(f"maps --id 5, {args.rows:,} rows: {wall:.1f} s, peak {peak:.0f} MiB (exit {code})")


if __name__ == "__main__":
    main()
