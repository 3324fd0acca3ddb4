"""One instrumentor per patched Megatron surface; the only code that knows Megatron's private names."""

from __future__ import annotations

from typing import List

from ._patcher import Instrumentor, SurfaceMissing
from .grad_sync import GradSyncInstrumentor
from .loss_scale import LossScaleInstrumentor
from .optimizer import OptimizerInstrumentor
from .param_groups import ParamGroupsInstrumentor

__all__ = ["Instrumentor", "SurfaceMissing", "all_instrumentors"]


def all_instrumentors() -> List[Instrumentor]:
    return [ParamGroupsInstrumentor(), OptimizerInstrumentor(), LossScaleInstrumentor(),
            GradSyncInstrumentor()]
