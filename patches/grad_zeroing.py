"""Gradient zeroing: ``DistributedDataParallel.zero_grad_buffer``, at the start of every training step.

The last moment the previous step's gradients can still be read. A grad norm that Megatron returned as a
device tensor and that has not reached the host yet is read here (``Events.gradients_zeroing``), so that a
non-finite one is localized on the gradients that produced it.
"""

from __future__ import annotations

from ..events import Events
from .instrumentor import Instrumentor
from .undo_log import Patcher


class GradZeroingInstrumentor(Instrumentor):
    name = "grad_zeroing"
    description = "gradient zeroing (DistributedDataParallel.zero_grad_buffer)"
    without = ("a grad norm returned as a device tensor (core 0.18+ with Transformer Engine) is read at the"
               " next step, after its gradients were zeroed")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

        def make_wrapper(original):
            def wrapper(self, *args, **kwargs):
                runtime.guarded("gradient zeroing", runtime.gradients_zeroing)
                return original(self, *args, **kwargs)

            return wrapper

        patcher.wrap(DistributedDataParallel, "zero_grad_buffer", make_wrapper)
