"""The Megatron patch layer, installed as ``gradnan.patches``: one instrumentor per patched surface
(``instrument()``/``uninstrument()``), and ``model`` for what is read without patching. The only code that
imports Megatron or knows its private names."""

from __future__ import annotations

from typing import List

from .instrumentor import Instrumentor, SurfaceMissing
from .grad_sync import GradSyncInstrumentor
from .grad_zeroing import GradZeroingInstrumentor
from .loss_scale import LossScaleInstrumentor
from .module_hooks import ModuleHooksInstrumentor
from .optimizer import OptimizerInstrumentor
from .param_groups import ParamGroupsInstrumentor
from .result_validation import ResultValidationInstrumentor
from .schedules import ScheduleInstrumentor

__all__ = ["Instrumentor", "SurfaceMissing", "all_instrumentors"]


def all_instrumentors() -> List[Instrumentor]:
    return [ParamGroupsInstrumentor(), OptimizerInstrumentor(), LossScaleInstrumentor(),
            GradSyncInstrumentor(), GradZeroingInstrumentor(), ScheduleInstrumentor(),
            ResultValidationInstrumentor(), ModuleHooksInstrumentor()]
