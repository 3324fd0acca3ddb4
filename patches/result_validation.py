"""Megatron's own result validation: ``RerunStateMachine.should_checkpoint_and_exit``, which Megatron-LM's
``train_step`` calls after its forward-backward loop and before the optimizer's step, and
``RerunStateMachine.validate_result``, which Megatron-LM's loss_func calls on every loss.

Under ``--rerun-mode validate_results`` (Megatron-LM's default) a NaN loss or gradient makes Megatron run
the step again in place, then checkpoint and exit before the optimizer is reached: gradnan's own incident
(at the grad norm) would never come. Here, when Megatron has just rerun a step, gradnan runs its rerun of
the same step (``Events.megatron_reran``) with Megatron's conclusion: "reproducible" (Megatron will ask
for another GPU) or "transient" (Megatron's rerun was finite), for the job (every rank calls this with the
same state) and on this rank (its own comparison, where its own validation failed).

The schedule's loss computation (``forward_step_calc_loss``) is wrapped here for every mode: the loss it
returns, the one backward runs from, goes to the kept step (``schedules.loss_used``), beside what the loss
function reported for logging.

Under ``--rerun-mode disabled`` a rejected result raises RuntimeError from ``validate_result`` at once.
Where that happens while the schedule computes a loss (``schedules.forward_step_calc_loss``, which calls
the user's loss_func), gradnan is told the loss that was rejected (``Events.loss_rejected``) and lets the
exception go on unchanged; the schedule wrapper (``schedules``) then runs the incident before it reaches
the user. The rejection function is never called here (it would add a host sync): Megatron's own call
decides. Megatron DDP's ``check_for_nan_in_grad`` also raises from ``validate_result``, outside the loss
computation: the pre-reduction check (``grad_sync``) has written its record by then.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..events import Events, MegatronRerun
from .instrumentor import Instrumentor
from .schedules import loss_used
from .undo_log import Patcher

_CONCLUSIONS = {"WILL_RERUN_FROM_CHECKPOINT": "reproducible", "RERUNNING_IN_PLACE": "transient"}
_LOSS_COMPUTATION = "forward_step_calc_loss"


class _InLoss(threading.local):
    """How deep this thread is in the schedule's loss computation (the user's loss_func), and which
    micro-batch's loss it computes: the losses the schedule stored before this one (``forward_data_store``),
    the same on every tensor-parallel rank, whether its data iterator yields or not (Megatron-LM gives
    one only to tensor-parallel rank 0)."""

    depth = 0
    micro_batch: Optional[int] = None


def _arguments(original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A call's arguments by name, however they were passed (``args`` with ``self`` for a method)."""
    return dict(inspect.signature(original).bind_partial(*args, **kwargs).arguments)


def _store(original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[list]:
    """The list ``forward_step_calc_loss`` appends each micro-batch's reported loss to: its length is the
    micro-batch whose loss it computes."""
    stored = _arguments(original, args, kwargs).get("forward_data_store")
    return stored if isinstance(stored, list) else None


def _as_number(result: Any) -> float:
    """The rejected result as a number (a host read, on the failing path only)."""
    if isinstance(result, torch.Tensor):
        return float(result.detach().float().reshape(-1)[0])
    return float(result)


def _own_conclusion(machine: Any) -> Optional[str]:
    """This rank's own word where its own validation failed in the failing pass: its rerun of that call
    reproduced (Megatron then asks this rank for a checkpoint) or not. None where this rank's results were
    all accepted: the job's word speaks for it. Each rank's state machine compares only its own results,
    so pipeline stages may conclude differently."""
    if getattr(machine, "failed_validation_call", None) is None:
        return None
    return "reproducible" if getattr(machine, "checkpoint_requested", False) else "transient"


class ResultValidationInstrumentor(Instrumentor):
    name = "result_validation"
    description = "result validation (RerunStateMachine.should_checkpoint_and_exit, validate_result)"
    without = ("no rerun of a step that Megatron's validate_results mode ran again before exiting; no record"
               " of a loss Megatron's check rejected in disabled mode")

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        from megatron.core.rerun_state_machine import RerunStateMachine

        def make_wrapper(original):
            def wrapper(self, *args, **kwargs):
                conclusion = _CONCLUSIONS.get(getattr(self.state, "name", ""))
                if conclusion is not None:
                    runtime.guarded("rerun", runtime.megatron_reran,
                                    MegatronRerun(conclusion, _own_conclusion(self) or conclusion))
                return original(self, *args, **kwargs)

            return wrapper

        patcher.wrap(RerunStateMachine, "should_checkpoint_and_exit", make_wrapper)
        self._wrap_loss_check(patcher, runtime)

    @staticmethod
    def _wrap_loss_check(patcher: Patcher, runtime: Events) -> None:
        """A result rejected in disabled mode while the schedule computes a loss: told to the runtime
        before Megatron's RuntimeError leaves ``validate_result``. Without ``forward_step_calc_loss``
        (megatron-core before 0.13) no rejection is known to be a loss: nothing is told."""
        from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
        if not hasattr(schedules, _LOSS_COMPUTATION):
            return
        in_loss = _InLoss()

        def loss_wrapper(original):
            def wrapper(*args, **kwargs):
                stored = runtime.guarded("rerun", _store, original, args, kwargs)
                in_loss.micro_batch = None if stored is None else len(stored)
                in_loss.depth += 1
                try:
                    result = original(*args, **kwargs)
                finally:
                    in_loss.depth -= 1
                if stored is not None and len(stored) > (in_loss.micro_batch or 0):  # the loss was computed
                    runtime.guarded("rerun", loss_used, result[0])
                return result

            return wrapper

        def tell(original, machine, args, kwargs):
            arguments = _arguments(original, (machine, *args), kwargs)
            runtime.loss_rejected(str(arguments.get("message", "")), _as_number(arguments.get("result")),
                                  in_loss.micro_batch)

        def validate_wrapper(original):
            def wrapper(self, *args, **kwargs):
                try:
                    return original(self, *args, **kwargs)
                except RuntimeError:
                    if in_loss.depth and getattr(self, "mode", None) == RerunMode.DISABLED:
                        runtime.guarded("rerun", tell, original, self, args, kwargs)
                    raise

            return wrapper

        patcher.wrap(schedules, _LOSS_COMPUTATION, loss_wrapper)
        patcher.wrap(RerunStateMachine, "validate_result", validate_wrapper)
