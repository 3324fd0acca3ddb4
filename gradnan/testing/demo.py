"""``gradnan demo``: the main job on an embedded default.

A tiny Megatron-Core GPT trains on CPU in 2 gloo processes (tensor parallel 2, bf16), gradnan installed.
At step 2, layer 1's query/key/value weight shard on rank 1 is scaled up so that its attention scores
overflow bf16, the most common real incident (an outlier batch or a diverging weight does the same): the
loss goes NaN and every gradient with it. gradnan runs the failing step again in place, names the
attention module on rank 1 (rank 0 only received the Inf through the tensor-parallel all-reduce),
captures it into a bundle whose replay names the overflowing operator, and keeps the micro-batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ..config.sources import resolve_config
from ..errors import UsageError
from ..formats.layout import MAPS_DIR, RECORDS_DIR
from ..offline.incident.analysis import analyze
from ..offline.incident.read import read_run
from ..offline.incident.report import format_text
from .toy import launch
from .toy_job import Injection, JobFailed, TinyGPTJob

DEMO_PARAM = "decoder.layers.1.self_attention.linear_qkv.weight"
DEMO_MODULE = "decoder.layers.1.self_attention.core_attention"
DEMO_RANK = 1
DEMO_STEP = 2


def demo_settings(out_dir: Path) -> Dict[str, Any]:
    """gradnan's settings in the demo's job."""
    return {"out_dir": str(out_dir), "log_level": "WARNING"}


def demo_job(out_dir: Path) -> TinyGPTJob:
    return TinyGPTJob(
        world_size=2, tp=2, dtype="bf16", steps=3, quiet=True,
        injections=(Injection(DEMO_RANK, DEMO_STEP, DEMO_PARAM, "1e20", where="scale_to"),),
        gradnan=demo_settings(out_dir),
    )


def run_demo(out_dir: Path) -> str:
    out_dir = Path(out_dir).resolve()
    resolve_config(**demo_settings(out_dir))  # a bad GRADNAN_* variable fails here, in one line
    if (out_dir / MAPS_DIR).exists() or (out_dir / RECORDS_DIR).exists():
        raise UsageError(f"{out_dir}: already holds a gradnan run; pass another --out or remove it")
    print(f"Training a tiny Megatron-Core GPT on CPU: 2 processes, TP=2, bf16, 3 steps.\n"
          f"At step {DEMO_STEP}, scaling {DEMO_PARAM} on rank {DEMO_RANK} up so that layer 1's attention"
          f" overflows bf16.\n", flush=True)
    try:
        launch(demo_job(out_dir))
    except JobFailed as failure:
        where, reason = next(iter(failure.errors.items()), ("a process", "it died without saying why"))
        raise UsageError(f"the demo's training failed in {where}: {reason}") from None
    report = format_text(analyze(read_run(out_dir)))
    return (f"\n{report}\n\nMaps:    {out_dir / MAPS_DIR}\nRecords: {out_dir / RECORDS_DIR}\n"
            f"Again as JSON: gradnan report {out_dir} --json")
