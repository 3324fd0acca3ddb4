"""Map the parameters a Megatron optimizer steps back to the model parameters they stand for.

- ``FP32Optimizer``: the optimizer's parameters are the model parameters.
- ``Float16OptimizerWithFloat16Params``: ``float16_groups[i][j]`` (model) <-> ``fp32_from_float16_groups[i][j]``
  (fp32 main copy); ``fp32_from_fp32_groups`` are model parameters.
- ``DistributedOptimizer``: ``model_float16_groups`` <-> ``shard_fp32_from_float16_groups`` and
  ``model_fp32_groups`` <-> ``shard_fp32_groups``, each shard the ``[start, end)`` slice of the flattened
  model parameter given by ``_get_model_param_range_map(param)["param"]``.
- ``ChainedOptimizer``: the concatenation of its ``chained_optimizers``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...formats.maps import ParamSlot
from .model import global_named_parameters

_Pairing = Dict[int, Tuple[torch.nn.Parameter, Optional[Tuple[int, int]]]]


def leaf_optimizers(optimizer: Any) -> List[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for sub in chained for leaf in leaf_optimizers(sub)]


def _pairs(model_groups: Sequence[Sequence[Any]], main_groups: Sequence[Sequence[Any]]):
    for model_group, main_group in zip(model_groups, main_groups):
        yield from zip(model_group, main_group)


def _pairing(leaf: Any) -> _Pairing:
    """id(optimizer-side parameter) -> (model parameter, shard range or None)."""
    pairing: _Pairing = {}
    if hasattr(leaf, "shard_fp32_from_float16_groups") and hasattr(leaf, "model_float16_groups"):
        for model_groups, shard_groups in (
            (leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
            (leaf.model_fp32_groups, leaf.shard_fp32_groups),
        ):
            for model_param, shard in _pairs(model_groups, shard_groups):
                if shard is not None:
                    param_range = leaf._get_model_param_range_map(model_param)["param"]
                    pairing[id(shard)] = (model_param, (int(param_range.start), int(param_range.end)))
    elif hasattr(leaf, "fp32_from_float16_groups") and hasattr(leaf, "float16_groups"):
        for model_param, main_param in _pairs(leaf.float16_groups, leaf.fp32_from_float16_groups):
            pairing[id(main_param)] = (model_param, None)
    return pairing


def _model_chunks(optimizer: Any, fallback: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    chunks = list(getattr(optimizer, "model_chunks", None) or [])
    for leaf in leaf_optimizers(optimizer):
        chunks += [c for c in getattr(leaf, "model_chunks", None) or [] if all(c is not k for k in chunks)]
    return chunks or list(fallback)


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    if param.grad is not None:
        return param.grad
    return getattr(param, "decoupled_grad", None)


def param_slots(
    optimizer: Any, fallback_chunks: Sequence[torch.nn.Module] = ()
) -> Tuple[List[ParamSlot], List[Optional[torch.Tensor]]]:
    """The optimizer's parameters in ``get_parameters()`` order, as slots, with their current gradients."""
    named = global_named_parameters(_model_chunks(optimizer, fallback_chunks))
    names = {id(param): (name, order) for order, (name, param) in enumerate(named)}
    slots: List[ParamSlot] = []
    grads: List[Optional[torch.Tensor]] = []
    group_offset = 0
    for leaf_index, leaf in enumerate(leaf_optimizers(optimizer)):
        inner = getattr(leaf, "optimizer", None)
        groups = getattr(inner, "param_groups", None) or []
        pairing = _pairing(leaf)
        for group_index, group in enumerate(groups):
            for opt_param in group["params"]:
                model_param, shard = pairing.get(id(opt_param), (opt_param, None))
                slot_id = len(slots)
                name, order = names.get(id(model_param), (f"<unnamed #{slot_id}>", -1))
                slots.append(
                    ParamSlot(
                        id=slot_id,
                        name=name,
                        shape=tuple(model_param.shape),
                        dtype=str(model_param.dtype),
                        numel=model_param.numel(),
                        group=group_offset + group_index,
                        wd_mult=group.get("wd_mult"),
                        lr_mult=group.get("lr_mult"),
                        is_expert=bool(
                            group.get("is_expert_parallel", not getattr(model_param, "allreduce", True))
                        ),
                        optimizer=leaf_index,
                        shard=shard,
                        main_dtype=str(opt_param.dtype),
                        order=order,
                    )
                )
                grads.append(_grad(opt_param))
        group_offset += len(groups)
    return slots, grads


def owned_start(optimizer: Any, param: torch.nn.Parameter) -> int:
    """First flat index of ``param`` that this rank's optimizer steps (inside its distributed-optimizer
    shard; 0 for the other optimizers, which step whole parameters)."""
    for leaf in leaf_optimizers(optimizer):
        if param in getattr(leaf, "model_param_gbuf_map", {}):
            param_range = leaf._get_model_param_range_map(param)["param"]
            if param_range.end <= param_range.start:
                raise ValueError("this rank's distributed-optimizer shard holds none of the parameter")
            return int(param_range.start)
    return 0
