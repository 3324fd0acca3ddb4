"""The Megatron optimizer: its construction, its ``step()`` and every path that computes the grad norm.

Since core 0.12 ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` whose ``step()`` calls
``get_grad_norm()`` and ``clip_grad_by_total_norm_fp32``; ``clip_grad_norm`` is called by the older
single-optimizer ``step()``. Both are wrapped on ``MegatronOptimizer`` and on every subclass that overrides
them, behind one re-entrancy guard, so nested calls (a chained optimizer delegating to its only member) give
one check. A finite norm costs one float comparison; only a non-finite one triggers the scan. A norm returned
as a device tensor (core 0.18+ with Transformer Engine) is read when it reaches the host, never by waiting for
the device on a healthy step (``gradnan.training.norms``).
"""

from __future__ import annotations

import importlib
import math
from functools import partial
from typing import Any, FrozenSet, Iterator, List, Set

import torch

from ..events import Events
from .instrumentor import Instrumentor, SurfaceMissing
from .optimizer_params import param_slots
from .reentrancy_guard import Outermost
from .undo_log import Patcher

_OPTIMIZER_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
)
_NORM_METHODS = ("get_grad_norm", "clip_grad_norm")


def optimizer_classes() -> List[type]:
    """``MegatronOptimizer`` and all its subclasses defined so far (after importing Megatron's modules)."""
    for module_name in _OPTIMIZER_MODULES:
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
    base = importlib.import_module(_OPTIMIZER_MODULES[0]).MegatronOptimizer

    def walk(cls: type) -> Iterator[type]:
        yield cls
        subclasses: List[type] = cls.__subclasses__()
        for sub in subclasses:
            yield from walk(sub)

    return list(dict.fromkeys(walk(base)))


def own_methods(classes: List[type], method: str) -> Iterator[type]:
    return (cls for cls in classes if method in vars(cls))


class OptimizerInstrumentor(Instrumentor):
    name = "optimizer"
    description = "optimizer (ChainedOptimizer.__init__, step, get_grad_norm, clip_grad_norm)"
    without = "no maps, no step count and no grad-norm check: nothing useful is recorded"

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        classes = optimizer_classes()
        build_guard, step_guard, norm_guard = Outermost(), Outermost(), Outermost()

        def slots_of(optimizer):
            return lambda: param_slots(optimizer, runtime.known_chunks())[0]

        def make_init_wrapper(original):
            def wrapper(self, *args, **kwargs):
                with build_guard.enter() as outermost:
                    original(self, *args, **kwargs)
                if outermost:
                    runtime.guarded("optimizer build", runtime.optimizer_built, self, slots_of(self))

            return wrapper

        def make_step_wrapper(original):
            def wrapper(self, *args, **kwargs):
                with step_guard.enter() as outermost:
                    if not outermost:
                        return original(self, *args, **kwargs)
                    runtime.guarded("optimizer step", runtime.begin_step, self, slots_of(self))
                    result = None
                    try:
                        result = original(self, *args, **kwargs)
                        return result
                    finally:
                        runtime.guarded("optimizer step", runtime.end_step, self, _skipped(result))

            return wrapper

        seen_by: Set[int] = set()  # the ranks known to see this norm non-finite (``reduced_over``)

        def on_nonfinite_norm(target, norm, ranks=frozenset()):
            slots, grads = param_slots(target, runtime.known_chunks())
            runtime.nonfinite_grad_norm(target, norm, slots, grads, ranks)

        def check_norm(optimizer, norm):
            target = runtime.stepping_optimizer() or optimizer
            if isinstance(norm, torch.Tensor):
                runtime.grad_norm_tensor(norm, partial(on_nonfinite_norm, target))
                return
            if norm is not None:  # read as a number: the host has just waited for the device
                runtime.host_waited()
            if not is_finite_number(norm):
                on_nonfinite_norm(target, norm, frozenset(seen_by | reduced_over(optimizer)))

        def make_norm_wrapper(original):
            def wrapper(self, *args, **kwargs):
                with norm_guard.enter() as outermost:
                    if outermost:
                        seen_by.clear()
                    norm = original(self, *args, **kwargs)
                if not outermost and not isinstance(norm, torch.Tensor) and not is_finite_number(norm):
                    # a chained optimizer's member: every rank its norm was reduced over sees it too
                    seen_by.update(runtime.guarded("grad-norm check", reduced_over, self) or ())
                if outermost and runtime.config.detect:
                    runtime.guarded("grad-norm check", check_norm, self, norm)
                return norm

            return wrapper

        chained = [cls for cls in classes if cls.__name__ == "ChainedOptimizer"]
        if not chained:
            raise SurfaceMissing("megatron.core.optimizer has no ChainedOptimizer")
        patcher.wrap(chained[0], "__init__", make_init_wrapper)
        for cls in own_methods(classes, "step"):
            patcher.wrap(cls, "step", make_step_wrapper)
        for method in _NORM_METHODS:
            for cls in own_methods(classes, method):
                patcher.wrap(cls, method, make_norm_wrapper)


def _skipped(step_result: Any) -> Any:
    """Megatron's ``step()`` returns ``(update_successful, grad_norm, num_zeros)``; None if unknown."""
    if isinstance(step_result, tuple) and step_result and isinstance(step_result[0], bool):
        return not step_result[0]
    return None


def reduced_over(optimizer: Any) -> FrozenSet[int]:
    """The global ranks Megatron reduced ``optimizer``'s grad norm over (its grad-stats group: the
    model-parallel group, the expert tensor-model-pipeline group for expert parameters, the distributed
    optimizer's instance): each of them computed the same norm, so where it is non-finite each of them
    meets this incident too. Empty for a chained optimizer whose members reduce over different groups
    (each member then names its own)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    shared = getattr(optimizer, "grads_states_parallel_group_is_shared", None)  # core 0.13+
    if chained is not None and len(chained) != 1 and not (shared is not None and shared()):
        return frozenset()
    member = chained[0] if chained else optimizer
    group = member.get_grad_stats_parallel_group()
    return frozenset(torch.distributed.get_process_group_ranks(group) if group is not None
                     else range(torch.distributed.get_world_size()))


def is_finite_number(value: Any) -> bool:
    """True for a finite Python/NumPy number; None counts as finite (no norm). A tensor norm is read
    without a host sync instead (``runtime.grad_norm_tensor``)."""
    return value is None or math.isfinite(float(value))
