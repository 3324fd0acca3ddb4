"""Megatron's own result validation: ``RerunStateMachine.should_checkpoint_and_exit``, which Megatron-LM's
``train_step`` calls after its forward-backward loop and before the optimizer's step.

Under ``--rerun-mode validate_results`` (Megatron-LM's default) a NaN loss or gradient makes Megatron run
the step again in place, then checkpoint and exit before the optimizer is reached: gradnan's own incident
(at the grad norm) would never come. Here, when Megatron has just rerun a step, gradnan runs its rerun of
the same step (``Events.megatron_reran``) with Megatron's conclusion: "reproducible" (Megatron will ask
for another GPU) or "transient" (Megatron's rerun was finite). Every rank calls this with the same state.
"""

from __future__ import annotations

from ..training.events import Events
from .instrumentor import Instrumentor
from .undo_log import Patcher

_CONCLUSIONS = {"WILL_RERUN_FROM_CHECKPOINT": "reproducible", "RERUNNING_IN_PLACE": "transient"}


class ResultValidationInstrumentor(Instrumentor):
    name = "result_validation"
    description = "result validation (RerunStateMachine.should_checkpoint_and_exit)"
    without = "no rerun of a step that Megatron's validate_results mode ran again before exiting"

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        from megatron.core.rerun_state_machine import RerunStateMachine

        def make_wrapper(original):
            def wrapper(self, *args, **kwargs):
                conclusion = _CONCLUSIONS.get(getattr(self.state, "name", ""))
                if conclusion is not None:
                    runtime.guarded("rerun", runtime.megatron_reran, conclusion)
                return original(self, *args, **kwargs)

            return wrapper

        patcher.wrap(RerunStateMachine, "should_checkpoint_and_exit", make_wrapper)
