"""Megatron-Bridge's training loop (``megatron.bridge.training``): the iteration of the step in progress,
and Bridge's own TensorBoard and W&B writers.

Bridge counts its iterations in the ``GlobalState`` it hands to ``train.train_step`` (``train_state.step``:
the iterations completed; its log prints one more), never in a module global, and leaves Megatron-LM's
arguments unset. ``train()`` reads ``train_step`` from its module once, before its loop, so the wrap is
in place from the first step: gradnan is installed before the optimizer is built, which Bridge's setup
does before ``train()``. gradnan never imports Bridge: where its module is not imported yet (``-m
gradnan.run`` installs before the script imports anything), it is wrapped as it is imported.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Optional

from ..events import Events
from ..formats.schema import is_int
from .instrumentor import Instrumentor
from .undo_log import Patcher

BRIDGE_TRAIN = "megatron.bridge.training.train"


class _InStep:
    """The ``GlobalState`` of the ``train_step`` in progress (process-wide, as Megatron-LM's arguments are:
    a record written from another thread of the process still names the iteration)."""

    state: Any = None


_in_step = _InStep()


def _completed(state: Any) -> Optional[int]:
    """``state.train_state.step`` where it is an integer: the iterations Bridge completed."""
    step = getattr(getattr(state, "train_state", None), "step", None)
    return step if is_int(step) else None


def bridge_iteration() -> Optional[int]:
    """The iteration Megatron-Bridge's log prints for the step in progress (``train_state.step + 1`` while
    its ``train_step`` runs, the number its ``train.iterations_to_skip`` takes); None outside one."""
    completed = _completed(_in_step.state)
    return None if completed is None else completed + 1


def bridge_logger(kind: str) -> Optional[Any]:
    """Bridge's own ``tensorboard`` writer or ``wandb`` run while its ``train_step`` runs, only where Bridge
    has already made it (on the last rank, at its first log): its ``GlobalState`` property would make one,
    so the attribute behind it is read."""
    return getattr(_in_step.state, f"_{kind}_logger", None)


def bridge_saved_iteration(state: Any) -> Optional[int]:
    """The iteration a Bridge save is labelled with (it saves after counting the step)."""
    return _completed(state)


class BridgeLoopInstrumentor(Instrumentor):
    name = "bridge_loop"
    description = "Megatron-Bridge's train_step (its iteration), where Megatron-Bridge runs"
    without = ("under Megatron-Bridge the records carry no iteration, and the report gives no option that"
               " needs one")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        def wrap_train_step(module: ModuleType) -> None:
            def make_wrapper(original):
                signature = inspect.signature(original)

                def wrapper(*args, **kwargs):
                    state = signature.bind_partial(*args, **kwargs).arguments.get("global_state")
                    outer, _in_step.state = _in_step.state, state
                    try:
                        return original(*args, **kwargs)
                    finally:
                        _in_step.state = outer

                return wrapper

            patcher.wrap(module, "train_step", make_wrapper)

        patcher.after_import(BRIDGE_TRAIN, wrap_train_step)
