"""The pipeline's links: megatron-core's point-to-point transfer between adjacent pipeline stages
(``p2p_communication``'s ``_communicate``: a method of ``P2PCommunicator`` from core 0.14 on, a module
function before). Every ``send_*``/``recv_*`` of the schedules goes through it.

What a stage sends and what it receives, in both directions (activations forward, their gradients
backward), is handed to the runtime (``Events.pipeline_transfer``), which folds each tensor's largest
magnitude into a device flag per direction: no host sync, no collective. Arguments and results pass
through unchanged. A stage's received activation reaches the model through ``set_input_tensor``, not as a
forward argument, so without this a NaN delivered by the link looks made by the receiving stage.
"""

from __future__ import annotations

import importlib

from ..events import Events, PipelineTransfer
from .instrumentor import Instrumentor, SurfaceMissing
from .undo_log import Patcher


def communicate_owner() -> object:
    """Where ``_communicate`` lives in the installed megatron-core."""
    module = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    communicator = getattr(module, "P2PCommunicator", None)
    if communicator is not None and "_communicate" in vars(communicator):
        return communicator
    if hasattr(module, "_communicate"):
        return module
    raise SurfaceMissing("megatron.core.pipeline_parallel.p2p_communication has no _communicate")


class PipelineLinksInstrumentor(Instrumentor):
    name = "pipeline_links"
    description = "pipeline point-to-point transfers (p2p_communication._communicate)"
    without = ("a non-finite activation or gradient received from another pipeline stage is not told from one"
               " the receiving stage made")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        owner = communicate_owner()

        def make_wrapper(original):
            def wrapper(*args, **kwargs):
                received = original(*args, **kwargs)
                # keyword-only in every release; the received tensors are whole once the call waited on
                # its requests (``wait_on_reqs``, False only with the interleaved schedule's overlap)
                transfer = PipelineTransfer(kwargs.get("tensor_send_next"), kwargs.get("tensor_send_prev"),
                                            received[0], received[1], kwargs.get("wait_on_reqs", True))
                runtime.guarded("pipeline links", runtime.pipeline_transfer, transfer)
                return received

            return wrapper

        patcher.wrap(owner, "_communicate", make_wrapper)
