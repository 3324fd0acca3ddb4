"""The param-group builder: learn which model chunks the optimizer is built over.

The builder's signature changed in almost every release (``get_param_groups(modules, ...)``,
``_get_param_groups(model_chunks, no_weight_decay_cond, ...)``, ``_get_param_groups(model_chunks, config,
config_overrides)``) but its first argument has always been the model chunks; that is all we take.
The wrapper adds no collective and changes no argument. ``optimizer/muon.py`` imports the builder by
name, so that binding is patched too.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..events import Events
from .instrumentor import Instrumentor, SurfaceMissing
from .undo_log import Patcher

_BINDINGS = ("megatron.core.optimizer", "megatron.core.optimizer.muon")
_BUILDER = "_get_param_groups"


def _model_chunks(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("model_chunks", kwargs.get("modules"))


class ParamGroupsInstrumentor(Instrumentor):
    name = "param_groups"
    description = "param-group builder (_get_param_groups)"
    without = ("the model is not seen: a non-distributed optimizer's parameters are named <unnamed #ID>,"
               " and frame tracing, capture and the rerun find no module unless Installation.start(model=...)"
               " names it")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        modules = []
        for module_name in _BINDINGS:  # import all first: a late import would bind our wrapper
            try:
                modules.append(importlib.import_module(module_name))
            except ImportError:
                continue
        for module in modules:
            if not hasattr(module, _BUILDER):
                continue

            def make_wrapper(original):
                def wrapper(*args, **kwargs):
                    chunks = _model_chunks(args, kwargs)
                    if chunks is not None:
                        runtime.guarded("param-group builder", runtime.register_chunks, list(chunks))
                    return original(*args, **kwargs)

                return wrapper

            patcher.wrap(module, _BUILDER, make_wrapper)
        if not len(patcher):
            raise SurfaceMissing(f"no {_BUILDER} in {', '.join(_BINDINGS)}")
