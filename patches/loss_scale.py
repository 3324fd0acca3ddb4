"""fp16 dynamic loss scaling: ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``.

With a grad scaler a step whose gradients overflow is skipped before any norm is computed (``found_inf``),
and dynamic loss scaling produces such steps on purpose. They are recorded as their own, quieter kind
(``loss_scale_overflow``), localized the same way, with the scale in use.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..events import Events
from .instrumentor import Instrumentor, SurfaceMissing
from .optimizer import optimizer_classes, own_methods
from .optimizer_params import leaf_optimizers, param_slots
from .undo_log import Patcher

_CHECK = "_unscale_main_grads_and_check_for_nan"


def _as_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0])
    return float(value)


class LossScaleInstrumentor(Instrumentor):
    name = "loss_scale"
    description = "fp16 loss-scale overflow check (_unscale_main_grads_and_check_for_nan)"
    without = "no loss_scale_overflow records: fp16 overflows are not localized"

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        def on_overflow(optimizer):
            target = runtime.stepping_optimizer() or optimizer
            leaves = leaf_optimizers(target)
            leaf = next((i for i, sub in enumerate(leaves) if sub is optimizer), 0)
            scaler = getattr(optimizer, "grad_scaler", None)
            slots, grads = param_slots(target, runtime.known_chunks())
            runtime.loss_scale_overflow(
                target, leaf, _as_float(getattr(scaler, "scale", None)),
                _as_float(getattr(scaler, "min_scale", None)), slots, grads,
            )

        def make_wrapper(original):
            def wrapper(self, *args, **kwargs):
                found_inf = original(self, *args, **kwargs)
                if found_inf and runtime.config.detect:
                    runtime.guarded("loss-scale overflow check", on_overflow, self)
                return found_inf

            return wrapper

        classes = list(own_methods(optimizer_classes(), _CHECK))
        if not classes:
            raise SurfaceMissing(f"no optimizer class defines {_CHECK}")
        for cls in classes:
            patcher.wrap(cls, _CHECK, make_wrapper)
