"""Synthetic run directories at real scale, written with the kit's own writers (``gradnan.formats``).

A job of ``world_size`` ranks laid out TP=8, PP=8 (16 from 2,048 ranks), the rest DP; every rank has a
map of ``LAYERS_PER_STAGE`` transformer layers (12 parameters each, 2 more on the first stage). At
``STEP`` one rank (``origin``) finds a NaN in its own gradients before the data-parallel collective; its
DP peers (same TP/PP position) hold the NaN after it; every other rank only sees the non-finite norm. Every
rank writes its run-up: two buckets, the stage's last three parameters and the rest, steady, but on the
origin the first grew tenfold a step over the last ``GROWTH_STEPS`` steps before it.
For the scale benchmark (``benchmarks/scale.py``) and the report's one-screen test; ``many_tensor_model``
and ``TorchOptimizer`` give the training side's slot building 50,000 parameters without a distributed job.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch

from ..formats import maps, records, runup
from ..formats.layout import map_path, records_path, runup_path
from ..formats.maps import ParamSlot
from ..formats.safe_write import append_json_line, write_json_atomic
from ..offline.incident.read import RunFiles

TP = 8
STEP = 12
GROWTH_STEPS = 4
LAYERS_PER_STAGE = 24
LAYER_PARAMS = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
                "mlp.linear_fc2.bias")
RUN = {"id": "synthetic", "attempt": "0", "started": 1.7e9}
VERSIONS = {"gradnan": "synthetic", "torch": "synthetic", "megatron_core": "synthetic"}


def pipeline_size(world_size: int) -> int:
    return 16 if world_size >= 2048 else 8 if world_size >= 64 else 2


def tensor_size(world_size: int) -> int:
    """TP=8, and 2 in a job of fewer than 64 ranks (8 ranks: TP2 x PP2 x DP2)."""
    return TP if world_size >= 64 else 2


def coords_of(rank: int, world_size: int) -> Dict[str, Any]:
    """Megatron's default order: tp fastest, then dp, then pp."""
    tp_size, pp_size = tensor_size(world_size), pipeline_size(world_size)
    dp_size = max(1, world_size // (tp_size * pp_size))
    return {"global_rank": rank, "tp": rank % tp_size, "dp": rank // tp_size % dp_size,
            "pp": rank // (tp_size * dp_size),
            "tp_size": tp_size, "pp_size": pp_size, "dp_size": dp_size, "cp": 0, "cp_size": 1, "ep": 0,
            "ep_size": 1, "world_size": world_size, "host": f"node{rank // 8:05d}",
            "device": f"cuda:{rank % 8}", "local_rank": rank % 8, "pid": 1000 + rank}


@functools.lru_cache(maxsize=None)
def stage_slots(pp: int) -> Tuple[ParamSlot, ...]:
    """The parameters one pipeline stage steps, in registration order (optimizer order the same); the same
    for every rank of the stage (built once)."""
    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"] if pp == 0 else []
    first = pp * LAYERS_PER_STAGE
    names += [f"decoder.layers.{first + layer}.{param}" for layer in range(LAYERS_PER_STAGE)
              for param in LAYER_PARAMS]
    return tuple(ParamSlot(id=index, name=name, shape=(512, 64), dtype="torch.bfloat16", numel=512 * 64,
                           group=0, wd_mult=1.0, lr_mult=1.0, is_expert=False, optimizer=0, shard=None,
                           main_dtype="torch.float32", order=index) for index, name in enumerate(names))


def _offender(slot: ParamSlot, nan: int) -> Dict[str, Any]:
    return {"id": slot.id, "name": slot.name, "kind": "nan", "nan": nan, "inf": 0, "pos_inf": 0, "neg_inf": 0,
            "first_bad_flat": 5, "first_bad_index": [0, 5], "abs_max_finite": 0.5, "near_limit": False,
            "numel": slot.numel, "shard": None, "is_expert": False, "order": slot.order}


def origin_rank(world_size: int) -> int:
    """A rank in the middle of the job: tp3 (tp1 under TP2), a middle DP replica, the last pipeline stage."""
    coords = coords_of(0, world_size)
    tp_size = coords["tp_size"]
    return ((coords["pp_size"] - 1) * tp_size * coords["dp_size"] + coords["dp_size"] // 2 * tp_size
            + min(3, tp_size - 1))


def rank_records(rank: int, world_size: int, origin: int, map_file: Path) -> List[Dict[str, Any]]:
    """One rank's records at ``STEP``, as the training side writes them."""
    coords, origin_coords = coords_of(rank, world_size), coords_of(origin, world_size)
    bad = [_offender(slot, 1) for slot in reversed(stage_slots(coords["pp"])[-3:])]
    same_position = (coords["tp"], coords["pp"]) == (origin_coords["tp"], origin_coords["pp"])
    written = []
    if rank == origin:
        written.append(records.to_json("pre_reduction", STEP, STEP, coords, RUN, bad, len(bad), {
            "mode": "deferred", "bucket_group": 0, "buckets": [{"bucket": 0, "numel": 1 << 20}],
            "order": "backward", "micro_batch": None}))
    held = [dict(entry, nan=entry["nan"] * coords["dp_size"]) for entry in bad] if same_position else []
    written.append(records.to_json("nonfinite_grad_norm", STEP, STEP, coords, RUN, held, len(held), {
        "optimizer_index": 0, "map": str(map_file),
        "pre_reduction": "nonfinite" if rank == origin else "clean", "grad_norm": "nan"}))
    return written


@functools.lru_cache(maxsize=None)
def _stage_buckets(pp: int) -> Tuple[Dict[str, Any], ...]:
    names = [slot.name for slot in stage_slots(pp)]
    return ({"bucket": 0, "numel": 3 * 512 * 64, "params": names[-3:]},
            {"bucket": 1, "numel": (len(names) - 3) * 512 * 64, "params": names[:-3]})


def rank_runup(rank: int, world_size: int, origin: int) -> Dict[str, Any]:
    """One rank's run-up at ``STEP``, as the training side writes it."""
    coords = coords_of(rank, world_size)
    steady = [0.5 + 0.01 * ((rank + step) % 7) for step in range(1, STEP + 1)]
    culprit: List[Union[float, str]] = list(steady)
    if rank == origin:
        culprit[-GROWTH_STEPS - 1:] = [steady[0] * 10.0 ** k for k in range(1, GROWTH_STEPS + 1)] + ["nan"]
    group = {"bucket_group": 0, "steps": list(range(1, STEP + 1)),
             "buckets": list(_stage_buckets(coords["pp"])),
             "values": [[first, other] for first, other in zip(culprit, steady)]}
    return runup.to_json(coords, RUN, STEP, STEP, [group])


def write_rank(out_dir: Path, rank: int, world_size: int, origin: int) -> None:
    """One rank's map, its records and its run-up at ``STEP``, as the training side writes them."""
    coords = coords_of(rank, world_size)
    path = map_path(str(out_dir), coords, 0)
    slots = stage_slots(coords["pp"])
    maps.write(path, maps.to_json(coords, VERSIONS, RUN, 0, "DistributedOptimizer", slots))
    for record in rank_records(rank, world_size, origin, path):
        append_json_line(records_path(str(out_dir), coords), record)
    write_json_atomic(runup_path(str(out_dir), coords, STEP, STEP), rank_runup(rank, world_size, origin),
                      indent=None)


def write_run_dir(out_dir: Path, world_size: int) -> int:
    """Every rank's files; returns the origin's global rank."""
    origin = origin_rank(world_size)
    for rank in range(world_size):
        write_rank(Path(out_dir), rank, world_size, origin)
    return origin


def run_files(world_size: int, run_dir: Path = Path("synthetic")) -> RunFiles:
    """The run directory ``write_run_dir`` writes as ``RunFiles``, built in memory (16,384 ranks in
    seconds, not the minute their files take): each map without its table, but the origin's whole (the
    report looks up its parameters' dtypes), and every run-up whole (as read with ``params=True``)."""
    origin = origin_rank(world_size)
    files = RunFiles(Path(run_dir))
    for rank in range(world_size):
        coords = coords_of(rank, world_size)
        path = map_path(str(run_dir), coords, 0)
        slots = stage_slots(coords["pp"])
        whole = rank == origin
        document = maps.to_json(coords, VERSIONS, RUN, 0, "DistributedOptimizer", slots if whole else ())
        files.maps[path] = {**maps.from_json(document, str(path), params=whole), "params_count": len(slots)}
        files.records[records_path(str(run_dir), coords)] = rank_records(rank, world_size, origin, path)
        files.runups[runup_path(str(run_dir), coords, STEP, STEP)] = rank_runup(rank, world_size, origin)
    return files


def write_long_records(out_dir: Path, target_bytes: int, params_per_record: int = 64) -> int:
    """One rank whose records file grew to ``target_bytes``: a non-finite norm at every step from 1 on,
    each with ``params_per_record`` offenders. Returns the number of records."""
    coords = coords_of(0, 64)
    slots = stage_slots(0)
    maps.write(map_path(str(out_dir), coords, 0),
               maps.to_json(coords, VERSIONS, RUN, 0, "DistributedOptimizer", slots))
    target = records_path(str(out_dir), coords)
    bad = [_offender(slot, 3) for slot in reversed(slots[-params_per_record:])]
    step = 0
    while not target.exists() or target.stat().st_size < target_bytes:
        step += 1
        append_json_line(target, records.to_json("nonfinite_grad_norm", step, step, coords, RUN, bad,
                                                 len(slots), {"optimizer_index": 0, "map": None,
                                                              "pre_reduction": "nonfinite",
                                                              "grad_norm": "nan"}))
    return step


class TorchOptimizer:
    """Megatron's ``FP32Optimizer`` as ``param_slots`` sees it: a torch optimizer and the model chunks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.model_chunks = [model]


def many_tensor_model(count: int, numel: int, layers: int = 100) -> torch.nn.Module:
    """``count`` parameters as an MoE model names them: ``decoder.layers.<i>.mlp.experts.<e>.w<k>``, each
    layer with its global ``layer_number`` (as Megatron's ``TransformerLayer``, so names are rewritten)."""
    model, per_layer = torch.nn.Module(), count // layers
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList()
    for layer in range(layers):
        block = torch.nn.Module()
        # Module.__setattr__ takes any value; torch's stub types it with Tensor | Module only
        block.layer_number = layer + 1  # type: ignore[assignment]
        block.mlp = torch.nn.Module()
        block.mlp.experts = torch.nn.ModuleList()
        for _ in range(per_layer // 2):
            expert = torch.nn.Module()
            expert.w1, expert.w2 = (torch.nn.Parameter(torch.zeros(numel)),
                                    torch.nn.Parameter(torch.zeros(numel)))
            block.mlp.experts.append(expert)
        model.decoder.layers.append(block)
    return model
