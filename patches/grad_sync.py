"""The data-parallel gradient sync: ``_ParamAndGradBucketGroup.start_grad_sync`` (core 0.9+).

Wrapped so each rank's LOCAL gradients are checked before the reduce-scatter / all-reduce (and before
Megatron's own ``check_grads`` can raise): one fused statistic per bucket (``bucket.grad_data`` is
contiguous), its largest magnitude, read in one pass (and kept on the device for the run-up,
``training.runup``): NaN or Inf where the bucket holds one, and, where all
are finite, whether the largest squares past float32's range, overflowing the grad norm (exploding
gradients; what makes Megatron's own bucket check find Inf from finite gradients). Covers dense and expert
bucket groups, ``overlap_grad_reduce`` on and off (the sync is started from the backward hooks or from
``finish_grad_sync``), and gradient accumulation (the sync runs once, after the last micro-batch).

Modes (``GradnanConfig.pre_reduction``):
- ``sync``: read the maxima at once (one host read per bucket group); on a bad bucket scan its parameters'
  ``main_grad`` and write the record before the collective runs.
- ``auto`` (default): ``sync`` where Megatron's ``check_for_nan_in_grad`` is on (it reads every bucket
  norm on the host anyway), otherwise keep the maxima on the device and read them only when the grad
  norm turns out non-finite: healthy steps pay the flag kernels and no host sync.
- ``off``.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..config.values import PreReduction
from ..events import Events
from ..formats.maps import ParamSlot
from .instrumentor import Instrumentor, SurfaceMissing
from .model import global_named_parameters
from .undo_log import Patcher

_MODULE = "megatron.core.distributed.param_and_grad_buffer"
_GROUP_CLASS = "_ParamAndGradBucketGroup"


def _names(chunks: Sequence[torch.nn.Module]) -> Dict[int, Tuple[str, int]]:
    """id(parameter) -> (global name, registration order)."""
    return {id(param): (name, order) for order, (name, param) in enumerate(global_named_parameters(chunks))}


def _unnamed(param: torch.nn.Parameter) -> Tuple[str, int]:
    return f"<unnamed {tuple(param.shape)}>", -1


def _local_grads(bucket: Any) -> List[torch.Tensor]:
    """Where a bucket's local gradients are as its sync starts: its contiguous buffer, and from core 0.19
    the fp32 ``main_grad`` of each parameter accumulated locally in fp32
    (``param_name_patterns_for_fp32_local_accumulation``), which ``start_grad_sync`` itself copies into the
    buffer, after this check."""
    extra = getattr(bucket, "params_with_extra_main_grads", ())
    return [bucket.grad_data, *(param.main_grad for param in extra)]


def _bucket_contents(group: Any, chunks: Sequence[torch.nn.Module]) -> List[dict]:
    """Every bucket of the group with the global names of its parameters (the run-up file's ``buckets``)."""
    names = _names(chunks)
    return [{"bucket": index, "numel": int(bucket.grad_data.numel()),
             "params": [names.get(id(param), _unnamed(param))[0] for param in bucket.params_list]}
            for index, bucket in enumerate(group.buckets)]


def _bucket_params(group: Any, bad_buckets: Sequence[int], chunks: Sequence[torch.nn.Module],
                   ids_by_name: dict) -> Tuple[List[ParamSlot], List[torch.Tensor], List[dict]]:
    """Slots and local gradients of the parameters in the given buckets, in backward order."""
    names = _names(chunks)
    slots, grads, buckets = [], [], []
    for bucket_index in bad_buckets:
        bucket = group.buckets[bucket_index]
        buckets.append({"bucket": bucket_index, "numel": int(bucket.grad_data.numel())})
        for param in bucket.params_list:
            name, order = names.get(id(param), _unnamed(param))
            slots.append(ParamSlot(
                id=ids_by_name.get(name, -1), name=name, shape=tuple(param.shape), dtype=str(param.dtype),
                numel=param.numel(), group=-1, wd_mult=None, lr_mult=None,
                is_expert=not getattr(param, "allreduce", True), optimizer=-1, shard=None,
                main_dtype=str(param.main_grad.dtype), order=order))
            grads.append(param.main_grad)
    return slots, grads, buckets


class GradSyncInstrumentor(Instrumentor):
    name = "grad_sync"
    description = "data-parallel gradient sync (_ParamAndGradBucketGroup.start_grad_sync)"
    without = ("no pre-reduction check: records say \"unchecked\" and the report cannot tell the origin from"
               " the ranks that only received the value")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        group_class = getattr(importlib.import_module(_MODULE), _GROUP_CLASS, None)
        if group_class is None:
            raise SurfaceMissing(f"{_MODULE} has no {_GROUP_CLASS}")

        def describe(group, bad_buckets):
            return _bucket_params(group, bad_buckets, runtime.known_chunks(), runtime.ids_by_name())

        def contents(group):
            return _bucket_contents(group, runtime.known_chunks())

        def check(group):
            mode = runtime.config.pre_reduction
            if mode is PreReduction.OFF or not runtime.first_sync_of_step(group):
                return
            maxima = runtime.bucket_maxima([_local_grads(bucket) for bucket in group.buckets])
            runtime.keep_runup(group, maxima, contents)
            megatron_checks = bool(getattr(group.ddp_config, "check_for_nan_in_grad", False))
            if mode is PreReduction.SYNC or megatron_checks:
                runtime.pre_reduction_flags(group, maxima, describe, mode="sync")
            else:
                runtime.defer_pre_reduction_flags(group, maxima, describe)

        def make_wrapper(original):
            def wrapper(self, *args, **kwargs):
                runtime.guarded("pre-reduction check", check, self)
                return original(self, *args, **kwargs)

            return wrapper

        patcher.wrap(group_class, "start_grad_sync", make_wrapper)
