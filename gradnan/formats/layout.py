"""The run directory: where every rank's files go, how ranks are named, and how launches are told apart.

    <out_dir>/maps/<rank tag>[_opt<k>][.<launch tag>].json      one parameter map per optimizer
    <out_dir>/records/<rank tag>.jsonl                          append-only JSON lines
    <out_dir>/bundles/<rank tag>/<when>_<module>[_<k>]/         capture bundles (manifest.json, tensors.pt)
    <out_dir>/batches/<rank tag>/<when>_mb<M>.pt                the failing micro-batch the rerun kept
    <out_dir>/runup/<rank tag>_<when>.json                      the gradient buckets' run-up at an incident
    <out_dir>/selftest/<time>.json                              self-test results

``<when>`` is ``iter<NNNNNNN>`` (Megatron-LM's iteration, where its loop runs) or ``step<NNNNNNN>``.

A launch never writes over another launch's map: where the name is taken (a restart, or another job
writing into the same out_dir), its map gets its launch tag (``launch_tag``) as well. Records are only
ever appended, each naming its launch.

The rank tag starts with the global rank (unique per process) and carries the tp/pp/dp coordinates,
plus cp/ep where their sizes are above 1: ``rank00003_tp1_pp0_dp1``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .text import untrusted

MAPS_DIR = "maps"
RECORDS_DIR = "records"
BUNDLES_DIR = "bundles"
BATCHES_DIR = "batches"
SELFTEST_DIR = "selftest"
RUNUP_DIR = "runup"
MANIFEST = "manifest.json"
TENSORS = "tensors.pt"

AXES = ("tp", "pp", "dp", "cp", "ep")


def peers_key(coords: Mapping[str, Any], across: str) -> Tuple[Any, ...]:
    """What the ranks of one group along ``across`` share (``"dp"``: data-parallel peers; ``"tp"``: a
    tensor-parallel group): every coordinate but that one."""
    return tuple(coords.get(axis) for axis in AXES if axis != across)


def shown_axes(coords: Mapping[str, Any]) -> List[str]:
    """The parallel axes worth naming for a rank: tp, pp and dp always, cp and ep where used (size > 1),
    in ``AXES`` order (spelt out: it is asked of each of 131,072 ranks)."""
    axes = ["tp", "pp", "dp"]
    if (coords.get("cp_size") or 1) > 1:
        axes.append("cp")
    if (coords.get("ep_size") or 1) > 1:
        axes.append("ep")
    return axes


def rank_label(coords: Mapping[str, Any], place: str = "", axes: Optional[Sequence[str]] = None) -> str:
    """ "rank 3 (tp1 pp0 dp1)"; ``place="inside"`` adds ", host device" in the brackets, ``"after"``
    adds " on host device" after them. ``axes``: the axes to name (default: ``shown_axes``)."""
    axes = " ".join(f"{axis}{coords.get(axis)}" for axis in (shown_axes(coords) if axes is None else axes))
    machine = host_device(coords)
    if place == "inside":
        return f"rank {coords['global_rank']} ({axes}, {machine})"
    return f"rank {coords['global_rank']} ({axes})" + (f" on {machine}" if place == "after" else "")


def host_device(coords: Mapping[str, Any]) -> str:
    """ "node-7 cuda:3": where a rank ran, as a text shows values from a file (``untrusted``)."""
    return f"{untrusted(coords.get('host'))} {untrusted(coords.get('device'))}"


def rank_tag(coords: Mapping[str, Any]) -> str:
    parts = [f"rank{int(coords['global_rank']):05d}"]
    for axis in shown_axes(coords):
        value = coords.get(axis)
        parts.append(f"{axis}{value if value is not None else 'x'}")
    return "_".join(parts)


def map_path(out_dir: str, coords: Mapping[str, Any], optimizer_index: int, launch: str = "") -> Path:
    """``launch``: this launch's tag (``launch_tag``), where another launch's map already has the name."""
    suffix = (f"_opt{optimizer_index}" if optimizer_index else "") + (f".{launch}" if launch else "")
    return Path(out_dir) / MAPS_DIR / f"{rank_tag(coords)}{suffix}.json"


def launch_tag(run: Mapping[str, Any], coords: Mapping[str, Any]) -> str:
    """A name part no other launch's process has: its start time (milliseconds) and process id."""
    return f"launch{int(run['started'] * 1000)}-{coords.get('pid') or 0}"


def records_path(out_dir: str, coords: Mapping[str, Any]) -> Path:
    return Path(out_dir) / RECORDS_DIR / f"{rank_tag(coords)}.jsonl"


def step_label(step: int, iteration: Optional[int]) -> str:
    """The step as the user's own log counts it: Megatron-LM's iteration where its loop runs."""
    return f"iteration {iteration}" if iteration is not None else f"step {step}"


def _when(step: int, iteration: Optional[int]) -> str:
    """A file name's step part: Megatron-LM's iteration where its loop runs, as its log counts."""
    return f"iter{iteration:07d}" if iteration is not None else f"step{step:07d}"


def bundle_dir(out_dir: str, coords: Mapping[str, Any], step: int, module_path: str,
               iteration: Optional[int] = None) -> Path:
    """A new, unused directory name for this rank, step and module (a suffix keeps earlier bundles). Named
    by Megatron-LM's ``iteration`` where its loop runs, as its log and the step filters count."""
    parent = Path(out_dir) / BUNDLES_DIR / rank_tag(coords)
    stem = f"{_when(step, iteration)}_{re.sub(r'[^A-Za-z0-9_.-]', '_', module_path) or 'model'}"
    candidate, suffix = parent / stem, 1
    while candidate.exists():
        suffix += 1
        candidate = parent / f"{stem}_{suffix}"
    return candidate


def batch_path(out_dir: str, coords: Mapping[str, Any], step: int, micro_batch: int,
               iteration: Optional[int] = None) -> Path:
    """Where the rerun keeps the failing micro-batch's tensors (``torch.save`` of a dict of tensors)."""
    return Path(out_dir) / BATCHES_DIR / rank_tag(coords) / f"{_when(step, iteration)}_mb{micro_batch}.pt"


def runup_path(out_dir: str, coords: Mapping[str, Any], step: int, iteration: Optional[int] = None,
               launch: str = "") -> Path:
    """Where a rank writes the run-up of its gradient buckets at an incident step. ``launch``: this launch's
    tag (``launch_tag``), where another launch's run-up already has the name."""
    suffix = f".{launch}" if launch else ""
    return Path(out_dir) / RUNUP_DIR / f"{rank_tag(coords)}_{_when(step, iteration)}{suffix}.json"


def run_identity(run_id: str, environ: Mapping[str, str], started: float) -> Dict[str, Any]:
    """Names this launch in every record: all ranks of one launch agree on ``id``, ``attempt`` and
    ``rendezvous`` without talking to each other (launcher variables; two jobs running at once cannot
    share a rendezvous address and port); ``started`` tells launches apart otherwise."""
    launcher_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if launcher_id in ("", "none"):
        launcher_id = environ.get("SLURM_JOB_ID", "")
    counts = [environ.get(name, "") for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
    attempt = ".".join(count for count in counts if count.isdigit()) or "0"  # requeue.restart under both
    address, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    return {"id": run_id or launcher_id or None, "attempt": attempt, "started": started,
            "rendezvous": f"{address}:{port}" if address and port else None}


def rank_ranges(ranks: Sequence[int], max_chars: int = 72) -> str:
    """ "0-482, 484-4095" or "3-251 every 8, 300": runs of three or more at a constant step written as one
    range (a job's data-parallel peers are one range), cut to ``max_chars`` with the count of all."""
    ranks = sorted(set(ranks))
    parts, start = [], 0
    while start < len(ranks):
        end, step = start, ranks[start + 1] - ranks[start] if start + 1 < len(ranks) else 1
        while end + 1 < len(ranks) and ranks[end + 1] - ranks[end] == step:
            end += 1
        if end - start >= 2:
            parts.append(f"{ranks[start]}-{ranks[end]}" + (f" every {step}" if step > 1 else ""))
        else:
            end = start
            parts.append(str(ranks[start]))
        start = end + 1
    text = ""
    for position, part in enumerate(parts):
        if len(text) + len(part) > max_chars:
            return f"{text}... ({len(ranks)} in all)"
        text += part + (", " if position + 1 < len(parts) else "")
    return text


VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # a row per token
ROW_OUTLIER = 1e4  # a row whose largest magnitude is this many times the rows' median: no trained row is
MAX_VOCABULARY = 2**31  # rows of a vocabulary shard: far above any tokenizer's


def vocabulary_token(tp: Any, rows: int, row: int) -> int:
    """The token a row of a vocabulary weight holds: ``row`` of tensor-parallel rank ``tp``'s shard of
    ``rows`` rows (Megatron splits the padded vocabulary evenly over the tensor-parallel ranks)."""
    return (tp if isinstance(tp, int) else 0) * rows + row
