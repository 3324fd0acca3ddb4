"""Module hooks: what capture, frame tracing and the rerun change on the model's module instances (its
Megatron layers, attention and MLP blocks, the DDP-wrapped chunks): a ``forward`` swapped on the instance,
forward hooks and pre-hooks, gradient hooks on parameters.

Each owner (a capture, a frame tracer, a rerun pass) gets its own ``ModuleHooks``, an undo log:
``remove()`` puts every module back as it was. Nothing is hooked at ``install()``: the instrumentor hands
the runtime the means to hook (``Events.module_hooking``) and takes it back at ``uninstall()``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..events import Events
from .instrumentor import Instrumentor
from .undo_log import Patcher


class ModuleHooks:
    """One owner's changes to the model's modules (``gradnan.events.ModuleHooks``)."""

    def __init__(self) -> None:
        self._changes = Patcher()

    def replace_forward(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        """Calls of ``module`` go to ``forward`` (set on the instance; the class is untouched)."""
        self._changes.set(module, "forward", forward)

    def after_forward(self, module: torch.nn.Module, hook: Callable[..., Any]) -> None:
        """``hook(module, args, kwargs, output)`` after every call of ``module``."""
        self._changes.registered(module.register_forward_hook(hook, with_kwargs=True))

    def before_forward(self, module: torch.nn.Module, hook: Callable[..., Any]) -> None:
        """``hook(module, args)`` before every call of ``module``."""
        self._changes.registered(module.register_forward_pre_hook(hook))

    def on_gradient(self, param: torch.nn.Parameter, hook: Callable[[torch.Tensor], Any]) -> None:
        """``hook(grad)`` each time a gradient for ``param`` is computed."""
        self._changes.registered(param.register_hook(hook))

    def remove(self) -> None:
        self._changes.undo()


class ModuleHooksInstrumentor(Instrumentor):
    name = "module_hooks"
    description = "module hooks (instance forward swaps and hooks for capture, frame tracing and the rerun)"
    without = "no capture, no frame tracing and no in-place rerun: all three hook the model's modules"

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        patcher.set(runtime.module_hooking, "new", ModuleHooks)
