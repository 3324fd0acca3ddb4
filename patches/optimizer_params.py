"""Map the parameters a Megatron optimizer steps back to the model parameters they stand for.

- ``FP32Optimizer``: the optimizer's parameters are the model parameters.
- ``Float16OptimizerWithFloat16Params``: ``float16_groups[i][j]`` (model) <->
  ``fp32_from_float16_groups[i][j]`` (fp32 main copy); ``fp32_from_fp32_groups`` are model parameters.
- ``DistributedOptimizer``: ``model_float16_groups`` <-> ``shard_fp32_from_float16_groups`` and
  ``model_fp32_groups`` <-> ``shard_fp32_groups``, each shard the ``[start, end)`` slice of the flattened
  model parameter given by ``_get_model_param_range_map(param)["param"]``.
- ``ChainedOptimizer``: the concatenation of its ``chained_optimizers``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..events import ParamTensors, StepState
from ..formats.maps import ParamSlot
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


def _stepped(optimizer: Any) -> List[Tuple[int, int, Dict[str, Any], torch.Tensor, _Pairing]]:
    """``(leaf index, group index across the chain, group, optimizer-side parameter, leaf pairing)`` in
    ``get_parameters()`` order."""
    stepped = []
    group_offset = 0
    for leaf_index, leaf in enumerate(leaf_optimizers(optimizer)):
        groups = getattr(getattr(leaf, "optimizer", None), "param_groups", None) or []
        pairing = _pairing(leaf)
        for group_index, group in enumerate(groups):
            stepped += [(leaf_index, group_offset + group_index, group, opt_param, pairing)
                        for opt_param in group["params"]]
        group_offset += len(groups)
    return stepped


def _build_slots(stepped, chunks: Sequence[torch.nn.Module]) -> List[ParamSlot]:
    names = {id(param): (name, order) for order, (name, param) in enumerate(global_named_parameters(chunks))}
    dtype_names: Dict[torch.dtype, str] = {}
    slots: List[ParamSlot] = []
    for slot_id, (leaf_index, group_index, group, opt_param, pairing) in enumerate(stepped):
        model_param, shard = pairing.get(id(opt_param), (opt_param, None))
        name, order = names.get(id(model_param), (f"<unnamed #{slot_id}>", -1))
        slots.append(ParamSlot(
            id=slot_id, name=name, shape=tuple(model_param.shape),
            dtype=dtype_names.setdefault(model_param.dtype, str(model_param.dtype)),
            numel=model_param.numel(),
            group=group_index, wd_mult=group.get("wd_mult"), lr_mult=group.get("lr_mult"),
            is_expert=bool(group.get("is_expert_parallel", not getattr(model_param, "allreduce", True))),
            optimizer=leaf_index, shard=shard,
            main_dtype=dtype_names.setdefault(opt_param.dtype, str(opt_param.dtype)), order=order))
    return slots


_BUILT: "weakref.WeakKeyDictionary[Any, Tuple[tuple, List[ParamSlot]]]" = weakref.WeakKeyDictionary()


def param_slots(
    optimizer: Any, fallback_chunks: Sequence[torch.nn.Module] = ()
) -> Tuple[List[ParamSlot], List[Optional[torch.Tensor]]]:
    """The optimizer's parameters in ``get_parameters()`` order, as slots, with their current gradients.

    The slots are built once per optimizer (50,000 parameters take a second) and again only if its
    parameters or model chunks change; the gradients are read at every call."""
    stepped = _stepped(optimizer)
    chunks = _model_chunks(optimizer, fallback_chunks)
    key = (tuple(id(entry[3]) for entry in stepped), tuple(id(chunk) for chunk in chunks))
    built = _BUILT.get(optimizer)
    if built is None or built[0] != key:
        built = _BUILT[optimizer] = (key, _build_slots(stepped, chunks))
    return built[1], [_grad(entry[3]) for entry in stepped]


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


def param_tensors(optimizer: Any, fallback_chunks: Sequence[torch.nn.Module] = ()) -> StepState:
    """Every model parameter by global name; the optimizer's slots (as ``param_slots``) with each one's
    model parameter, the copy the optimizer steps where that is a separate tensor, and the torch
    optimizer's state of that copy (the tensors of its shape: ``exp_avg``, ``exp_avg_sq``; a scalar
    ``step`` is left out). Nothing is read from the device."""
    slots, _ = param_slots(optimizer, fallback_chunks)
    leaves = leaf_optimizers(optimizer)
    stepped = []
    for leaf_index, _, _, opt_param, pairing in _stepped(optimizer):
        model_param, _ = pairing.get(id(opt_param), (opt_param, None))
        state = getattr(getattr(leaves[leaf_index], "optimizer", None), "state", None) or {}
        own = state.get(opt_param, {}) if hasattr(state, "get") else {}
        stepped.append(ParamTensors(
            model=model_param, main=None if opt_param is model_param else opt_param,
            state={name: value for name, value in own.items()
                   if isinstance(value, torch.Tensor) and value.shape == opt_param.shape
                   and value.is_floating_point()}))
    weights = global_named_parameters(_model_chunks(optimizer, fallback_chunks))
    return StepState(weights, slots, stepped)
