"""``gradnan demo``: the main job on an embedded default.

A tiny Megatron-Core GPT trains on CPU in 2 gloo processes (tensor parallel 2, bf16), gradnan installed.
At step 2 a NaN is injected into one element of ``decoder.layers.1.mlp.linear_fc1.weight``'s gradient on
rank 1, as a bad card would produce it during backward. gradnan names the rank and the parameter.
"""

from __future__ import annotations

from pathlib import Path

from ..config import resolve_config
from ..errors import UsageError
from ..formats.layout import MAPS_DIR, RECORDS_DIR
from ..offline.read import read_run
from ..offline.report import build_report, format_text
from .toy import Injection, JobFailed, TinyGPTJob, launch

DEMO_PARAM = "decoder.layers.1.mlp.linear_fc1.weight"
DEMO_RANK = 1
DEMO_STEP = 2


def demo_job(out_dir: Path) -> TinyGPTJob:
    return TinyGPTJob(
        world_size=2, tp=2, dtype="bf16", steps=3, quiet=True,
        injections=(Injection(DEMO_RANK, DEMO_STEP, DEMO_PARAM, "nan", where="backward", index=37),),
        gradnan={"out_dir": str(out_dir), "log_level": "WARNING"},
    )


def run_demo(out_dir: Path) -> str:
    out_dir = Path(out_dir).resolve()
    resolve_config(**demo_job(out_dir).gradnan)  # a bad GRADNAN_* variable fails here, in one line
    if (out_dir / MAPS_DIR).exists() or (out_dir / RECORDS_DIR).exists():
        raise UsageError(f"{out_dir}: already holds a gradnan run; pass another --out or remove it")
    print(f"Training a tiny Megatron-Core GPT on CPU: 2 processes, TP=2, bf16, 3 steps.\n"
          f"Injecting a NaN into {DEMO_PARAM}'s gradient on rank {DEMO_RANK} at step {DEMO_STEP}.\n",
          flush=True)
    try:
        launch(demo_job(out_dir))
    except JobFailed as failure:
        where, reason = next(iter(failure.errors.items()), ("a process", "it died without saying why"))
        raise UsageError(f"the demo's training failed in {where}: {reason}") from None
    report = format_text(build_report(read_run(out_dir)))
    return (f"\n{report}\n\nMaps:    {out_dir / MAPS_DIR}\nRecords: {out_dir / RECORDS_DIR}\n"
            f"Again as JSON: gradnan report {out_dir} --json")
