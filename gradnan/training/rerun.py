"""The failing step itself, run again in place: at the run's first incident, before the optimizer applies
anything, every rank runs the same step's forward pass again (the schedule's kept micro-batches, the RNG
state the step started with, no gradients) with every watched module traced, to name where a value first
went non-finite, and where it first grew out of line before that (``frames.first_growth``: a finite
value, e.g. 3.9e28 in bf16, that something downstream squares into NaN); a second pass captures the
non-finite origin's call into a bundle. Then whether it reproduced:
the same batch failing again is data or numerics, a clean rerun of a failing step a transient fault.

The ranks a grad norm (or an fp16 overflow flag) was reduced over see the same value and so enter
together: at least a whole model-parallel group (one data-parallel replica; the whole job with the
distributed optimizer). Every decision that follows is taken from values all-reduced over that group,
so no rank waits alone in a collective; a forward pass that needs ranks of other replicas runs again where
they are known to be here too: with expert parallelism, where the experts' part of the grad norm (reduced
over the expert tensor-model-pipeline group) was non-finite, the group's findings then reduced over it;
with context parallelism only where Megatron's own validation brought the whole job here. Training
is unchanged: the passes compute no gradient, and the RNG state (restored by the kept step) and the
model's buffers are put back as they were.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch

from ..config import GradnanConfig, RerunMode
from ..decision.replica import conclude, conclusion_of, own_failure_of
from ..events import MegatronRerun, ModuleHooking, ModuleHooks, NamedModules, PipelineTransfer, RerunnableStep
from ..formats.incident import Conclusion, RecordKind, RerunRole
from ..formats.observed import ReplicaObservation
from ..formats.rerun_record import loss_here_nonfinite
from ..formats.text import shell_word
from ..formats.wording import growth_log, samples_wording
from ..log import logger
from .capture import CaptureManager, ModuleCapture
from .clock import StepClock
from .error_guard import ErrorGuard
from .frames import Frame, FrameTracer
from .messages import when, where
from .rerun_pass import (
    NONE,
    MicroBatchCounter,
    PassResult,
    batch_tensors,
    buffers_of,
    first_nonfinite_element,
    largest,
    largest_magnitude,
    observation,
    reduction_finding,
    restore_buffers,
    seen_state,
)
from .writer import Writer


@dataclass(frozen=True)
class RerunOutcome:
    """What the rerun concluded for this rank's data-parallel replica, the same on each of its ranks: the
    conclusion, the global rank of its forward origin (None: no origin there) and the failing micro-batch."""

    conclusion: Conclusion
    origin_rank: Optional[int]
    micro_batch: Optional[int]


class StepRerun:
    """Keeps the latest training step (``step_kept``) while a rerun may still be wanted, and runs it again
    at the first incident (``incident``). One rerun per run: later incidents are that failure's aftermath."""

    def __init__(self, config: GradnanConfig, clock: StepClock, writer: Writer, captures: CaptureManager,
                 guard: ErrorGuard, named_modules: Callable[[], NamedModules], recording: Callable[[], bool],
                 hooking: ModuleHooking) -> None:
        self.config, self._clock, self._writer, self._captures = config, clock, writer, captures
        self._guard, self._named_modules, self._recording = guard, named_modules, recording
        self._hooking = hooking
        self._kept: Optional[RerunnableStep] = None
        self._groups: Optional[RerunnableStep] = None  # the step kept at the run's rerun: its groups
        self._loss_seen: Optional[Tuple[int, Optional[bool]]] = None  # (step, its loss_finite)
        self.done = False
        self.in_pass = False  # one of the rerun's own forward passes is running
        # while the traced pass runs: each activation received from the previous pipeline stage
        self._on_received: Optional[Callable[[torch.Tensor], None]] = None
        self.outcome: Optional[RerunOutcome] = None  # what the run's rerun concluded, once it ran

    def keeps_steps(self) -> bool:
        """Whether a rerun may still come: its passes are traced through module hooks."""
        return (self.config.rerun is RerunMode.AUTO and self.config.detect and not self.done
                and self._hooking.new is not None)

    def step_kept(self, kept: RerunnableStep) -> None:
        self._kept = kept

    def step_loss_finite(self) -> Optional[bool]:
        """Whether the kept step's losses were all finite on every rank of this model-parallel group (its
        last pipeline stage holds them): a MAX all-reduce over that group, which every rank of it enters
        together (an fp16 overflow flag is reduced over at least that group). Asked at an fp16 skip only,
        once per step; None where no step is kept (``rerun`` off, or after the run's rerun)."""
        step = self._clock.current()
        if self._loss_seen is not None and self._loss_seen[0] == step:
            return self._loss_seen[1]
        finite = None
        if self.keeps_steps() and self._kept is not None:
            own, _ = self._kept.original_losses()
            finite = not self._kept.all_reduce([0.0 if own is None or own else 1.0], "max", "model")[0]
        self._loss_seen = (step, finite)
        return finite

    def expected(self) -> bool:
        """Whether the next incident will be run again (so no later step needs to be watched for it)."""
        return (self.keeps_steps() and self._kept is not None
                and self._kept.cannot_rerun(frozenset()) is None)

    def incident(self, trigger: str, megatron: Optional[MegatronRerun] = None,
                 local_gradients: Optional[str] = None, at_norm: Optional[str] = None,
                 seen_by: FrozenSet[int] = frozenset()) -> Optional[Dict[str, Any]]:
        """The first incident: run the kept step again on every rank; this rank's ``rerun`` record.
        ``megatron``: what Megatron's own rerun of the step concluded, for the job and on this rank.
        ``local_gradients``: this rank's own gradients before the data-parallel collective, as the
        pre-reduction check saw them ("nonfinite", "overflow", "clean", "unchecked"; None: not known).
        ``at_norm``: this rank's gradients at the grad norm ("nonfinite", "overflow": all finite, their
        float32 sum of squares not, "finite"; None: not known). ``seen_by``: the global ranks known to meet
        this incident with this rank (those its grad norm was reduced over)."""
        # Megatron's result validation decides for every rank of the job; a grad norm only for the ranks
        # it was reduced over (at least this model-parallel group)
        here = None if megatron is not None else seen_by
        if not self.keeps_steps():
            self._vote_against(here)
            return None
        self.done = True
        kept, self._kept = self._kept, None
        self._groups = kept
        if kept is None:
            logger.info("step %d: no rerun of the failing step: it was not run by megatron-core's pipeline"
                        " schedules", self._clock.current())
            return None
        reason = kept.cannot_rerun(here)
        if not kept.all_reduce([0.0 if reason else 1.0], "min", kept.deciding_group(here))[0]:
            logger.info("step %d: no rerun of the failing step: %s", self._clock.current(),
                        reason or "not possible on another rank that runs the forward pass with this one (its"
                        " run's rerun came before, or it cannot)")
            return None
        return self._rerun(kept, trigger, megatron, local_gradients, at_norm)

    def _vote_against(self, seen_by: Optional[FrozenSet[int]]) -> None:
        """After this rank's rerun (or its incident without one), a later incident may bring in a group whose
        forward pass spans replicas (expert parallelism) on ranks that have had none yet: they decide
        together whether to run the step again, so this rank says no in that vote rather than leave them
        waiting in it."""
        if self.done and self._groups is not None and self._groups.deciding_group(seen_by) == "forward":
            self._groups.all_reduce([0.0], "min", "forward")

    def too_late(self, trigger: str) -> None:
        """The incident was seen after its step's update was applied: no rerun, now or later (said once)."""
        if self.keeps_steps():
            self.done, self._groups, self._kept = True, self._kept, None
            logger.info("step %d: no rerun of the failing step: its %s was read after the update (a grad norm"
                        " returned as a device tensor)", self._clock.current(), trigger)

    def _new_hooks(self) -> ModuleHooks:
        """A fresh set of module hooks: a rerun runs only where hooking is possible (``keeps_steps``)."""
        new = self._hooking.new
        if new is None:
            raise RuntimeError("no module hooking: the rerun cannot trace its passes")
        return new()

    def _watched(self) -> NamedModules:
        return self.config.watched(self._named_modules())

    @contextlib.contextmanager
    def _pass(self, kept: RerunnableStep, frames_so_far: Callable[[], int]) -> Iterator[MicroBatchCounter]:
        """Around one pass: micro-batches counted, ``in_pass`` set, and the model's buffers as they were
        afterwards."""
        counter = MicroBatchCounter(kept.chunks, frames_so_far, self._new_hooks())
        buffers = buffers_of(kept.chunks)
        self.in_pass = True
        try:
            yield counter
        finally:
            self.in_pass = False
            counter.remove()
            restore_buffers(buffers)

    def transfer(self, transfer: PipelineTransfer) -> None:
        """A pipeline transfer made by one of the rerun's passes: the traced pass notes what it received."""
        if self._on_received is not None and transfer.received_forward is not None and transfer.complete:
            self._on_received(transfer.received_forward)

    def _traced_pass(self, kept: RerunnableStep) -> PassResult:
        step = self._clock.current()
        tracer = FrameTracer(self._watched(), lambda: step, lambda: True, self._new_hooks()).attach()
        flags: List[Tuple[int, torch.Tensor, torch.Tensor]] = []
        received: List[Tuple[int, torch.Tensor]] = []
        self._on_received = lambda tensor: received.append(
            (tracer.frame_count(), largest_magnitude(tensor).float()))

        def on_reduction(partial: torch.Tensor) -> Callable[[torch.Tensor], None]:
            # read before the reduction, which may write its result into ``partial``; the reduction runs
            # inside its layer's call, which is the next frame to finish
            at, partial_largest = tracer.frame_count(), largest_magnitude(partial)
            return lambda reduced: flags.append((at, partial_largest, largest_magnitude(reduced)))

        try:
            with self._pass(kept, tracer.frame_count) as counter:
                losses = kept.forward(on_reduction)
                frames = tracer.read()
        finally:
            self._on_received = None
            tracer.detach()
        values = [value.float() for _, *pair in flags for value in pair] + [value for _, value in received]
        read = torch.isfinite(torch.stack(values)).tolist() if values else []
        reductions = [(at, bool(read[2 * n]), bool(read[2 * n + 1])) for n, (at, _, _) in enumerate(flags)]
        arrived = [(at, bool(finite)) for (at, _), finite in zip(received, read[2 * len(flags):])]
        return PassResult(frames, counter.of_frame, losses, reductions, arrived)

    def _rerun(self, kept: RerunnableStep, trigger: str, megatron: Optional[MegatronRerun],
               local_gradients: Optional[str], at_norm: Optional[str]) -> Optional[Dict[str, Any]]:
        seen = self._traced_pass(kept)
        # the origin is the earliest candidate among the ranks whose activations meet inside a layer (tensor
        # parallel, and with expert parallelism the ranks that exchange tokens with the experts): a later one
        # received the value; the growth likewise
        earliest, earliest_growth = kept.all_reduce([seen.key(seen.candidate), seen.key(seen.grown_frame)],
                                                    "min", "exchange")
        grew_in = seen.grew_in() if seen.key(seen.grown_frame) <= earliest_growth else None
        # the earliest call may end in a tensor-parallel reduction: whose partial sum was non-finite
        partial_bad, reduced_bad = seen.reduction_in(earliest)
        any_partial_bad, any_reduced_bad = kept.all_reduce([partial_bad, reduced_bad], "max", "tensor")
        reduction = reduction_finding(partial_bad, any_partial_bad, any_reduced_bad)
        module: Optional[Frame]
        # a stage whose received activation was already non-finite is a receiver of the previous stage's
        if (seen.candidate is not None and seen.key(seen.candidate) <= earliest and reduction != "received"
                and not seen.received_before(seen.candidate)):
            role, module = RerunRole.ORIGIN, seen.candidate
        elif reduction == "partial":  # its own partial sum was non-finite (from non-finite weights, say)
            role, module = RerunRole.ORIGIN, seen.first
        else:
            role, module = (RerunRole.RECEIVER if seen.first is not None else RerunRole.CLEAN), seen.first
        loss_finite, loss_micro_batch = kept.original_losses()
        loss_state = -1.0 if loss_finite is None else (0.0 if loss_finite else 1.0)
        found_mb = seen.micro_batch() if role is not RerunRole.CLEAN else None
        gradients = {"nonfinite": 1.0, "clean": 0.0}.get(local_gradients or "", -1.0)
        loss_again = -1.0 if seen.loss_finite is None else (0.0 if seen.loss_finite else 1.0)
        loss_here = _loss_here(loss_state, loss_again)  # this rank's own, before the group's all-reduce
        reproduced, original_loss, own_gradients, overflow, nonfinite, loss_again = kept.all_reduce(
            [0.0 if role is RerunRole.CLEAN else 1.0, loss_state, gradients,
             float("overflow" in (at_norm, local_gradients)),
             float("nonfinite" in (at_norm, local_gradients)), loss_again], "max", "forward")
        seen_here = observation(reproduced, original_loss, own_gradients, overflow, nonfinite, loss_again,
                                megatron)
        origin_rank = float(self._writer.coords()["global_rank"]) if role is RerunRole.ORIGIN else NONE
        again_mb = seen.loss_micro_batch if role is RerunRole.CLEAN else None
        *micro_batch, first_origin = kept.all_reduce([NONE if found_mb is None else found_mb,
                                                      NONE if again_mb is None else again_mb,
                                                      NONE if loss_micro_batch is None else loss_micro_batch,
                                                      origin_rank], "min", "forward")
        failing_mb = next((int(mb) for mb in micro_batch if mb != NONE), None)
        if failing_mb is None and seen_here.own_failure is not None and len(kept.micro_batches()) == 1:
            failing_mb = 0  # the step's only micro-batch is the failing one
        self.outcome = RerunOutcome(conclude(seen_here), None if first_origin == NONE else int(first_origin),
                                    failing_mb)
        bundle, nonfinite_at = (self._capture_pass(kept, seen, module if role is RerunRole.ORIGIN else None,
                                                   failing_mb) if reproduced else (None, None))
        batch = self.keep_batch(kept, failing_mb)
        if (role is RerunRole.CLEAN and batch is None and grew_in is None and not kept.leads_replica()
                and not loss_here_nonfinite(loss_here)):
            return None
        samples = None if failing_mb is None else kept.samples(failing_mb)
        return self._report(trigger, role, module, seen, failing_mb, seen_here, megatron, bundle, batch,
                            grew_in,
                            {"samples": samples, "nonfinite_at": nonfinite_at,
                             "loss_here": loss_here,
                             "reduction": reduction if role is not RerunRole.CLEAN else None,
                             "origin_rank": self.outcome.origin_rank})

    def _capture_pass(self, kept: RerunnableStep, seen: PassResult, origin: Optional[Frame],
                      micro_batch: Optional[int]) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """Every rank runs the pass again (its collectives need them all); the origin's rank captures the
        origin module's call of the failing micro-batch: the bundle written, and where its output first
        held a non-finite element."""
        capture = None
        named = dict(self._watched())
        if origin is not None and origin.module in named and self._recording():
            capture = ModuleCapture(origin.module, named[origin.module], "always", self._guard,
                                    self._new_hooks()).attach()
        try:
            with self._pass(kept, lambda: 0) as counter:
                if capture is not None:
                    capture.only_when = lambda: micro_batch is None or counter.current == micro_batch
                kept.forward()
        finally:
            if capture is not None:
                capture.detach()
        call = None if capture is None else capture.chosen_call()
        if call is None or capture is None or origin is None:
            return None, None
        element = first_nonfinite_element(call.outputs)
        frames = [frame.to_json()
                  for frame in seen.frames[:seen.frames.index(origin) + 1]][-self.config.max_frames:]
        written = self._captures.write_call(self._clock.current(), capture, call, {
            "trigger": "rerun", "forward_origin": origin.module, "micro_batch": micro_batch,
            "frames": frames, "grew_in": seen.grew_in(), "nonfinite_at": element})
        return (None if written is None else written.path), element

    def keep_batch(self, kept: RerunnableStep, micro_batch: Optional[int]) -> Optional[Dict[str, Any]]:
        """The failing micro-batch as this rank's data iterator gave it, where it gave one."""
        items = kept.micro_batches()
        if micro_batch is None or micro_batch >= len(items) or not self._recording():
            return None
        tensors, left_out = batch_tensors(items[micro_batch], self.config.max_batch_bytes)
        if not tensors:
            return None
        return self._writer.batch(self._clock.current(), micro_batch, tensors, left_out)

    def _report(self, trigger: str, role: RerunRole, frame: Optional[Frame], seen: PassResult,
                micro_batch: Optional[int], observed: ReplicaObservation,
                megatron: Optional[MegatronRerun], bundle: Optional[str],
                batch: Optional[Dict[str, Any]], grew_in: Optional[Dict[str, Any]],
                located: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """``located``: the optional ``samples``, ``nonfinite_at``, ``reduction`` and ``origin_rank`` fields,
        written where known."""
        if not self._recording():
            return None
        highs = [value[1] for name, value in zip(frame.names, frame.values)
                 if name.startswith("output") and value is not None] if frame is not None else []
        record = self._writer.record(RecordKind.RERUN, self._clock.current(), [], {
            "trigger": trigger, "megatron": megatron.here if megatron else None,
            "role": role.value, "observed": observed.to_json(),
            "micro_batch": micro_batch,
            "module": frame.module if frame is not None else None,
            "class": frame.cls if frame is not None else None,
            "call": frame.call if frame is not None else None,
            "output_abs_max": largest(highs),
            "frames_traced": len(seen.frames), "bundle": bundle, "batch": batch, "grew_in": grew_in,
            **{key: value for key, value in located.items() if value is not None}})
        self.log(record)
        return record

    @staticmethod
    def log(record: Dict[str, Any]) -> None:
        """A ``rerun`` record's log line: where the value grew and went non-finite, and the conclusion its
        observations reach (``decision.replica.conclude``, as the report's)."""
        verdict, role = conclusion_of(record), RerunRole(record["role"])
        explanation = verdict.explain(own_failure_of(record))
        tail = (f"; bundle: {record['bundle']} (replay it: gradnan replay {shell_word(record['bundle'])})"
                if record["bundle"] else "")
        grew_in = record.get("grew_in")
        if role is RerunRole.ORIGIN:
            path = (growth_log(grew_in, record["module"], record["class"]) if grew_in else
                    f"a forward value first went non-finite in {record['module']} ({record['class']})")
            logger.error("%s, run again in place: %s on %s, micro-batch %s; %s%s", when(record), path,
                         where(record), record["micro_batch"], explanation, tail)
        elif grew_in:
            logger.error("%s, run again in place: %s on %s, micro-batch %s", when(record),
                         growth_log(grew_in, None, None), where(record), grew_in["micro_batch"])
        if record.get("samples") and role is RerunRole.ORIGIN:
            logger.error("%s, the failing micro-batch in the data: %s", when(record),
                         samples_wording(record["samples"], record["micro_batch"]))
        if role is RerunRole.RECEIVER:
            logger.info("%s, run again in place: non-finite values reached %s on %s from another rank (a"
                        " receiver, not the origin)", when(record), record["module"], where(record))
        elif verdict is not Conclusion.REPRODUCIBLE:
            logger.log(logging.WARNING if verdict in (Conclusion.TRANSIENT, Conclusion.NORM_OVERFLOW)
                       else logging.INFO,
                       "%s, run again in place on this rank's model-parallel group (%s): %s", when(record),
                       where(record), explanation)


def _loss_here(loss: float, loss_again: float) -> Optional[Dict[str, str]]:
    """This rank's own losses, before the all-reduce that makes ``observed`` its group's (1 non-finite, 0
    finite, -1 none here): where the group spans several data-parallel replicas (expert parallelism), only
    these say whose loss it was. None on a rank that computes no loss."""
    if loss < 0 and loss_again < 0:
        return None
    return {"loss": seen_state(loss).value, "loss_again": seen_state(loss_again).value}
