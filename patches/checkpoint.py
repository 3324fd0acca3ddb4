"""Checkpoint saves: megatron-core's ``dist_checkpointing.save`` (every distributed checkpoint of
Megatron-LM, ``torch_dist`` its default format, and of loops of one's own), Megatron-LM's
``save_checkpoint``, in ``megatron.training.checkpointing`` and the training loop's binding of it (every
format: ``--ckpt-format torch`` saves bypass ``dist_checkpointing.save``), and Megatron-Bridge's
``save_checkpoint``; each in its module, now or as it is imported (gradnan never imports Megatron-LM or
Bridge: ``-m gradnan.run`` installs before the script imports them).

Once a save has returned, the runtime marks it (``Events.checkpoint_saved``): one mark per save, by the
outermost of the nested calls (``save_checkpoint`` calls ``dist_checkpointing.save``). Its iteration is
``save_checkpoint``'s argument, else the ``iter_NNNNNNN`` directory Megatron-LM names a checkpoint by,
else unknown. The save itself goes on unchanged, with its arguments and its result.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from ..events import Events
from .bridge import bridge_saved_iteration
from .instrumentor import Instrumentor
from .reentrancy_guard import Outermost
from .result_validation import _arguments
from .undo_log import Patcher

_DIST_SAVE = ("megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.serialization")
_LM_SAVE = ("megatron.training.checkpointing", "megatron.training.training")
_BRIDGE_SAVE = "megatron.bridge.training.checkpointing"  # DefaultCheckpointManager.save looks it up there
_ITERATION_DIR = re.compile(r"iter_(\d+)")

Labelled = Tuple[Optional[int], Optional[str]]  # (the iteration a save is labelled with, its path)


def _dist_save_label(original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Labelled:
    """``dist_checkpointing.save``'s directory, and the iteration its name gives (Megatron-LM's)."""
    directory = _arguments(original, args, kwargs).get("checkpoint_dir")
    path = os.fspath(directory) if isinstance(directory, (str, os.PathLike)) else None
    named = _ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(path))) if path else None
    return (int(named.group(1)) if named else None), path


def _lm_save_label(original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Labelled:
    """Megatron-LM's ``save_checkpoint(iteration, ...)``: its iteration, and its ``--save`` directory."""
    iteration = _arguments(original, args, kwargs).get("iteration")
    save_dir = getattr(getattr(sys.modules.get("megatron.training.global_vars"), "_GLOBAL_ARGS", None),
                       "save", None)
    return (iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None,
            save_dir if isinstance(save_dir, str) else None)


def _bridge_save_label(original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
                       ) -> Labelled:
    """Megatron-Bridge's ``save_checkpoint(state, ...)``: ``state.train_state.step``, ``checkpoint.save``."""
    state = _arguments(original, args, kwargs).get("state")
    save_dir = getattr(getattr(getattr(state, "cfg", None), "checkpoint", None), "save", None)
    return bridge_saved_iteration(state), save_dir if isinstance(save_dir, str) else None


class CheckpointInstrumentor(Instrumentor):
    name = "checkpoint"
    description = ("checkpoint saves (dist_checkpointing.save, Megatron-LM's and Megatron-Bridge's"
                   " save_checkpoint)")
    without = ("no checkpoint marks: the report's restart advice names no checkpoint known clean, and"
               " gradnan checkpoints lists none")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        outermost = Outermost()

        def marking(label: Callable[..., Labelled]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def make_wrapper(original):
                def wrapper(*args, **kwargs):
                    with outermost.enter() as first:
                        result = original(*args, **kwargs)
                        if first:
                            runtime.guarded("checkpoint", runtime.checkpoint_saved,
                                            *label(original, args, kwargs))
                        return result

                return wrapper

            return make_wrapper

        for module_name in _DIST_SAVE:
            patcher.wrap(importlib.import_module(module_name), "save", marking(_dist_save_label))

        def saving(label: Callable[..., Labelled]) -> Callable[[ModuleType], None]:
            def wrap_save(module: ModuleType) -> None:
                if hasattr(module, "save_checkpoint"):
                    patcher.wrap(module, "save_checkpoint", marking(label))

            return wrap_save

        for module_name in _LM_SAVE:
            patcher.after_import(module_name, saving(_lm_save_label))
        patcher.after_import(_BRIDGE_SAVE, saving(_bridge_save_label))
