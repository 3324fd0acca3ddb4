"""The Megatron patch layer, installed as ``gradnan.patches``: one instrumentor per patched surface
(``instrument()``/``uninstrument()``), and ``model`` for what is read without patching. The only code that
imports Megatron or knows its private names."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ..errors import ConfigError
from .bridge import BridgeLoopInstrumentor
from .checkpoint import CheckpointInstrumentor
from .grad_sync import GradSyncInstrumentor
from .grad_zeroing import GradZeroingInstrumentor
from .instrumentor import Instrumentor, SurfaceMissing
from .loss_scale import LossScaleInstrumentor
from .module_hooks import ModuleHooksInstrumentor
from .optimizer import OptimizerInstrumentor
from .p2p import PipelineLinksInstrumentor
from .param_groups import ParamGroupsInstrumentor
from .result_validation import ResultValidationInstrumentor
from .schedules import ScheduleInstrumentor

__all__ = ["Instrumentor", "SurfaceMissing", "all_instrumentors", "split_disabled"]


def all_instrumentors() -> List[Instrumentor]:
    return [ParamGroupsInstrumentor(), OptimizerInstrumentor(), LossScaleInstrumentor(),
            GradSyncInstrumentor(), GradZeroingInstrumentor(), ScheduleInstrumentor(),
            ResultValidationInstrumentor(), ModuleHooksInstrumentor(), PipelineLinksInstrumentor(),
            CheckpointInstrumentor(), BridgeLoopInstrumentor()]


def split_disabled(instrumentors: List[Instrumentor],
                   disabled: Sequence[str]) -> Tuple[List[Instrumentor], List[Instrumentor]]:
    """The instrumentors to apply and those ``disabled_patches`` turns off, by name; a name that is no
    patch's is a ``ConfigError`` listing the valid ones (a typo must not leave a patch on)."""
    names = [instrumentor.name for instrumentor in instrumentors]
    unknown = [name for name in disabled if name not in names]
    if unknown:
        raise ConfigError(f"gradnan config field 'disabled_patches' names no patch: {', '.join(unknown)}"
                          f" (valid: {', '.join(names)})")
    return ([instrumentor for instrumentor in instrumentors if instrumentor.name not in disabled],
            [instrumentor for instrumentor in instrumentors if instrumentor.name in disabled])
