"""The runtime: the entry points the Megatron adapter calls (``events.Events``), routed to the parts that
do the work. The step clock counts, the recording window says whether anything is recorded, the
detections localize and log, capture watches modules, the forward watch traces frames and probes, the
writer puts files on disk. An internal error goes through the guard (logged once, training goes on,
unless ``strict``); the only exceptions raised into training on purpose are ``gradnan.errors``'s
``NonFiniteGradientError`` and ``AbortRequested``, when asked for.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial, reduce
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from ..config import GradnanConfig
from ..errors import INTENDED_STOPS
from ..events import (
    DescribeBuckets,
    DescribeContents,
    Grads,
    MegatronRerun,
    ModelFacts,
    ModuleHooking,
    NamedModules,
    PipelineTransfer,
    RerunnableStep,
)
from ..formats.incident import RecordKind
from ..formats.maps import ParamSlot
from ..log import logger
from .board import IncidentBoard
from .capture import CaptureManager
from .clock import StepClock
from .error_guard import ErrorGuard
from .forward import ForwardWatch
from .health import DeviceHealth
from .incidents import Detections
from .links import PipelineLinks
from .norms import DeviceScalar, PendingNorms
from .rates import LearningRates
from .replicas import Divergence, ReplicaCheck, compared_weights
from .rerun import StepRerun
from .scan import abs_max
from .stops import abort_if_asked, stop_if_asked
from .weights import checkpoint_mark, finite_flag
from .window import RecordingWindow
from .writer import Writer, Written


class Runtime:
    def __init__(self, config: GradnanConfig, facts: ModelFacts) -> None:
        self.config, self._facts = config, facts
        self.guarded = ErrorGuard(config.strict)
        self.clock = StepClock(facts.iteration)
        self.writer = Writer(config, facts)
        self.window = RecordingWindow(config, self.clock, lambda: int(self.writer.coords()["global_rank"]))
        self.module_hooking = ModuleHooking()
        self.captures = CaptureManager(config, self.clock, self.window, self.writer, self.guarded, facts,
                                       self.named_modules, self.module_hooking)
        self.rerun = StepRerun(config, self.clock, self.writer, self.captures, self.guarded,
                               self.named_modules, self.window.recording, self.module_hooking)
        self.health = DeviceHealth()
        self.links = PipelineLinks(self.clock.current)
        self.detections = Detections(config, self.clock, self.writer, self.captures, self.rerun.expected,
                                     self.health, self.links.read)
        self.forward = ForwardWatch(config, self.clock, self.window, self.writer, self.named_modules,
                                    self.module_hooking)
        self.norms = PendingNorms()
        self.rates = LearningRates()
        self.replicas = ReplicaCheck(config.replica_check_every if config.detect else 0, facts.replica_group)
        self.board = IncidentBoard(config, self.clock, self.writer, facts)
        self._lock = threading.Lock()
        self._chunks: List["weakref.ref[torch.nn.Module]"] = []
        self._ids_by_name: Dict[str, int] = {}
        # (the micro-batch, Megatron's message, the loss)
        self._rejected_loss: Optional[Tuple[Optional[int], str, float]] = None
        self._optimizer: Optional["weakref.ref[Any]"] = None  # the latest built: its state at an incident
        self._state_read = False  # the weights and optimizer state are read at the run's first incident
        self._launch_weights: Optional[torch.Tensor] = None  # were they finite at the launch's first step
        self._incident_step: Optional[int] = None  # the step of this launch's first incident
        self._saves = 0  # checkpoint saves this launch has made (every rank saves together)

    def close(self) -> None:
        """Write what this step measured so far, then remove every hook this runtime put on the model."""
        self.flush_at_end()
        self.captures.close()
        self.forward.close()
        self.guarded("trackers", self.board.close)

    # -- the model ----------------------------------------------------------------------------------

    def register_chunks(self, chunks: Sequence[torch.nn.Module]) -> None:
        """The model chunks an optimizer is built over (or a custom loop's model)."""
        with self._lock:
            live = [ref for ref in self._chunks if ref() is not None]
            known = {id(ref()) for ref in live}
            self._chunks = live + [weakref.ref(chunk) for chunk in chunks if id(chunk) not in known]
        self.forward.model_changed()

    def known_chunks(self) -> List[torch.nn.Module]:
        return [chunk for chunk in (ref() for ref in self._chunks) if chunk is not None]

    def named_modules(self) -> NamedModules:
        return self._facts.named_modules(self.known_chunks())

    def ids_by_name(self) -> Dict[str, int]:
        """Global parameter name -> id in the first optimizer's map."""
        return self._ids_by_name

    # -- the optimizer --------------------------------------------------------------------------------

    def stepping_optimizer(self) -> Optional[Any]:
        return self.clock.stepping()

    def optimizer_built(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None:
        state, new = self.detections.optimizer(optimizer)
        if not new:
            return
        self._optimizer = weakref.ref(optimizer)
        self.clock.add(optimizer)
        self.writer.remember_coords()
        if self.config.detect:
            coords = self.writer.coords()
            self.guarded("device health", self.health.start, str(coords.get("device")),
                         int(coords.get("local_rank") or 0))
        if self.config.maps:
            built = slots()
            state.map_file = self.writer.write_map(state.index, type(optimizer).__name__, built)
            if state.index == 0:
                self._ids_by_name = {slot.name: slot.id for slot in built}
        self.captures.start()
        self.forward.start()

    def begin_step(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None:
        self.norms.settle(wait=True)  # the last step's norm, if nothing zeroed the gradients in between
        self.optimizer_built(optimizer, slots)
        self.clock.begin(optimizer)
        self.guarded("learning rate", self.rates.keep, self.clock.current(optimizer), optimizer)
        if self.replicas.due(self.clock.current(optimizer)):
            self.guarded("replica check", self._check_replicas, optimizer)
        if self.clock.current(optimizer) == 1 and self.config.detect and self._launch_weights is None:
            self._launch_weights = self.guarded("state", self._weights_flag, optimizer)
        self.guarded("frames", self.forward.flush)  # every forward of this step is done

    def end_step(self, optimizer: Any, skipped: Optional[bool]) -> None:
        """``skipped``: the step applied no update (fp16 overflow). The step's bookkeeping waits for its grad
        norm when that is still on its way from the device (``norms``)."""
        finished, step = self.clock.filter_step(), self.clock.current(optimizer)
        self.clock.end(optimizer)
        self.norms.then(partial(self._finish_step, optimizer, skipped, step, finished))

    def _finish_step(self, optimizer: Any, skipped: Optional[bool], step: int, finished: int) -> None:
        self.detections.step_ended(optimizer, skipped)
        self.captures.end_step(step, finished + 1)
        if not self.clock.counts_loop:
            abort_if_asked(self.config, finished)

    def grad_norm_tensor(self, norm: torch.Tensor, on_nonfinite: Callable[[float], None]) -> None:
        """A grad norm given as a tensor: read once it is on the host, without waiting for the device."""
        self.norms.settle(wait=True)
        self.norms.add(DeviceScalar(norm), on_nonfinite)

    def gradients_zeroing(self) -> None:
        """The gradients are about to be zeroed for the next step: the last norm must be read now."""
        self.norms.settle(wait=True)

    def nonfinite_grad_norm(self, optimizer: Any, norm: float, slots: Sequence[ParamSlot],
                            grads: Grads, seen_by: FrozenSet[int] = frozenset()) -> None:
        record = (self.detections.nonfinite_grad_norm(optimizer, norm, slots, grads)
                  if self.window.recording() else None)
        self._incident("nonfinite_grad_norm", record, record=record, seen_by=seen_by)

    def loss_scale_overflow(self, optimizer: Any, leaf: int, scale: Optional[float],
                            min_scale: Optional[float], slots: Sequence[ParamSlot], grads: Grads) -> None:
        loss_finite = self.guarded("rerun", self.rerun.step_loss_finite)
        incident = self.detections.overflow_is_incident(optimizer, scale, min_scale, loss_finite)
        stop = (self.detections.loss_scale_overflow(optimizer, leaf, scale, min_scale, slots, grads,
                                                    loss_finite)
                if self.window.recording() else None)
        if incident:
            self._incident("loss_scale_overflow", stop)

    def megatron_reran(self, conclusion: MegatronRerun) -> None:
        """Megatron's result validation has just run the step again."""
        if self.window.recording():
            self.detections.own_gradients()
        self._incident("megatron_validation", None, conclusion)

    def loss_rejected(self, message: str, loss: float, micro_batch: Optional[int]) -> None:
        """Megatron's loss check rejected this rank's loss (of ``micro_batch`` in the step, None: not known)
        in ``--rerun-mode disabled`` and is about to raise. While steps are kept, the schedule wrapper runs
        the incident once the exception leaves the schedule (``schedule_raised``); otherwise it is recorded
        now, without its micro-batch."""
        self._rejected_loss = (micro_batch, message, loss)
        if not self.keeps_steps():
            self.schedule_raised(None)

    def schedule_raised(self, kept: Optional[RerunnableStep]) -> None:
        """The step's schedule raised. After a rejected loss: the step's forward pass run again where every
        rank of the model-parallel group raised with this one (the micro-batches up to the rejected one), else
        the failing micro-batch kept alone; then the ``nonfinite_loss`` record, and the incident in the
        trackers (TensorBoard, W&B) as at a non-finite norm. Megatron's exception then goes on unchanged."""
        rejected, self._rejected_loss = self._rejected_loss, None
        if rejected is None:
            return
        self._first_incident()
        micro_batch, message, loss = rejected
        self._read_state_once()  # the loss check ends the step before any gradient: the weights now
        skipped = ("the step was not kept (rerun off, after the run's rerun, or a loop outside"
                   " megatron-core's schedules)" if kept is None else kept.not_raised_together())
        batch = None
        if kept is not None and skipped is None and micro_batch is not None:
            kept.ended_early(micro_batch)
            self.rerun.step_kept(kept)
            rerun = self.guarded("rerun", self.rerun.incident, RecordKind.NONFINITE_LOSS.value)
            batch = rerun.get("batch") if rerun else None
        elif kept is not None:
            batch = self.guarded("rerun", self.rerun.keep_batch, kept, micro_batch)
        if self.window.recording():
            record = self.detections.nonfinite_loss(micro_batch, message, loss, batch, skipped)
            self.guarded("trackers", self.board.incident, self.rerun.outcome, record,
                         self.detections.last_pre_reduction)

    def _incident(self, trigger: str, stop: Optional[Written], megatron: Optional[MegatronRerun] = None,
                  record: Optional[Dict[str, Any]] = None, seen_by: FrozenSet[int] = frozenset()) -> None:
        """Every rank, recording or not, joins the rerun of the failing step (its passes are collective);
        the run's first incident goes to TensorBoard and W&B where a tracker is and this rank records
        (``record``: its record of it); then the run stops if asked to. ``seen_by``: the global ranks
        known to meet this incident with this rank (the grad norm's reduction group). A norm read after its
        step (one Megatron returned as a device tensor) comes after the update: that step can no longer be
        run again as it was."""
        self._first_incident()
        self._read_state_once()
        if megatron is not None or self.clock.stepping() is not None:
            self.guarded("rerun", self.rerun.incident, trigger, megatron, self.detections.last_pre_reduction,
                         self.detections.last_at_norm, seen_by)
        else:
            self.rerun.too_late(trigger)
        if self.window.recording():
            self.guarded("trackers", self.board.incident, self.rerun.outcome, record,
                         self.detections.last_pre_reduction)
        if stop is not None:
            stop_if_asked(self.config, stop)

    def host_waited(self) -> None:
        """Inside the optimizer step, before the update, the host has just waited for the device (a grad norm
        read as a number): a replica check started at this step's beginning is read now."""
        optimizer = self.clock.stepping()
        if optimizer is not None:
            self.guarded("replica check", self._replica_divergence, optimizer,
                         self.replicas.host_waited(partial(self._weights_compared, optimizer)))

    def _check_replicas(self, optimizer: Any) -> None:
        """On every data-parallel peer at once (a collective): the last check's result if still pending,
        then this step's."""
        found = self.replicas.at_step(self.clock.current(optimizer), self._facts.iteration(),
                                      partial(self._weights_compared, optimizer))
        self._replica_divergence(optimizer, found)

    def _weights_compared(self, optimizer: Any) -> List[Tuple[str, torch.Tensor]]:
        held = self._facts.optimizer_tensors(optimizer, self.known_chunks())
        return compared_weights(held.weights, [slot.name for slot in held.slots if slot.is_expert])

    def _replica_divergence(self, optimizer: Any, found: Optional[Divergence]) -> None:
        """Its record, written by each rank whose weights differ (every peer's where no majority agrees)."""
        mine = found is not None and self.writer.coords()["global_rank"] in found.ranks
        if found is not None and mine and self.window.recording():
            self.detections.replica_divergence(found, self.clock.current(optimizer))

    def _first_incident(self) -> None:
        if self._incident_step is None:
            self._incident_step = self.clock.current()

    # -- checkpoints ----------------------------------------------------------------------------------

    def checkpoint_saved(self, iteration: Optional[int], path: Optional[str]) -> None:
        """A checkpoint save has just returned (``iteration``: the one it is labelled with, where the saver
        names it; ``path``: where it went): its mark, on a recording rank once an optimizer is built. A save
        after this launch's first incident says so (``after_incident``): Megatron's exit save under
        ``validate_results`` is labelled with the iteration before the failing one but holds what the
        failing step found."""
        self._saves += 1
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None or not self.config.detect or not self.window.recording():
            return
        fields = checkpoint_mark(self._facts.optimizer_tensors(optimizer, self.known_chunks()))
        record = self.writer.record(RecordKind.CHECKPOINT, self.clock.current(), [], {
            "saved_iteration": iteration, "checkpoint": path, "save": self._saves,
            "after_incident": self._incident_step, **fields})
        if not fields["clean"]:
            first, more = fields["nonfinite"][0], fields["nonfinite_total"] - 1
            logger.error("the checkpoint saved%s holds non-finite values on this rank: %s (%s)%s; do not"
                         " restart from it; record: %s",
                         "" if iteration is None else f" at iteration {iteration}", first["name"],
                         first["tensor"], f" and {more} more" if more else "", record.path)

    def _weights_flag(self, optimizer: Any) -> Optional[torch.Tensor]:
        """Once, at the launch's first step: a device flag, read only at an incident, that says whether the
        weights the launch began with were finite (one fused pass over them, no host sync)."""
        return finite_flag(self._facts.optimizer_tensors(optimizer, self.known_chunks()).weights)

    def _read_state_once(self) -> None:
        """At the run's first incident of any kind, on a recording rank: the weights and optimizer state."""
        if not self._state_read and self.window.recording():
            self._state_read = True
            self.guarded("state", self._read_state)

    def _read_state(self) -> None:
        """The weights and optimizer state of the stepping optimizer (else the latest built) as the failing
        step found them: no collective, no update applied yet."""
        optimizer = self.clock.stepping() or (self._optimizer() if self._optimizer is not None else None)
        if optimizer is not None and self.config.detect:
            held = self._facts.optimizer_tensors(optimizer, self.known_chunks())
            if held.weights or held.slots:
                self.detections.state(held, self.ids_by_name(), self._launch_weights, self.rates.to_json())

    # -- the step's schedule (its forward pass may be run again) ------------------------------------

    def keeps_steps(self) -> bool:
        return self.rerun.keeps_steps()

    def step_kept(self, kept: RerunnableStep) -> None:
        self.rerun.step_kept(kept)

    # -- the pipeline's point-to-point transfers ------------------------------------------------------

    def pipeline_transfer(self, transfer: PipelineTransfer) -> None:
        """A transfer between pipeline stages: the step's (kept on the device), or the rerun's own."""
        if self.rerun.in_pass:
            self.rerun.transfer(transfer)
        elif self.config.detect and self.window.recording():
            self.links.observe(transfer)

    # -- the data-parallel gradient sync ------------------------------------------------------------

    def first_sync_of_step(self, group: Any) -> bool:
        return self.window.recording() and self.detections.first_sync_of_step(group)

    def pre_reduction_flags(self, group: Any, maxima: torch.Tensor, describe: DescribeBuckets,
                            mode: str) -> bool:
        return self.detections.pre_reduction_flags(group, maxima, describe, mode)

    def defer_pre_reduction_flags(self, group: Any, maxima: torch.Tensor, describe: DescribeBuckets) -> None:
        self.detections.defer_pre_reduction_flags(group, maxima, describe)

    def keep_runup(self, group: Any, maxima: torch.Tensor, contents: DescribeContents) -> None:
        self.detections.keep_runup(group, maxima, contents)

    @staticmethod
    def bucket_maxima(buckets: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([reduce(torch.maximum, map(abs_max, grads)) for grads in buckets])

    # -- the user's controls -------------------------------------------------------------------------

    def start_model(self, chunks: Sequence[torch.nn.Module]) -> None:
        """A loop whose optimizer is not Megatron's names its model: frames, probes and capture know it."""
        self.register_chunks(chunks)
        self.guarded("frames", self.forward.start)

    def set_recording(self, on: bool) -> None:
        if not on:
            self.guarded("frames", self.forward.flush)  # the window's last step is written before it closes
        self.window.open = on

    def advance_step(self) -> None:
        """A custom loop finished a step (after the optimizer's step): write what it measured, then count
        the next one; from then on the loop's count names records and drives the step filters."""
        finished = self.clock.loop_step()
        self.forward.flush()
        self.clock.advance_loop()
        abort_if_asked(self.config, finished)

    def probe(self, tensor: torch.Tensor, label: str) -> None:
        """A ``gradnan.check`` call; none is recorded from the rerun's own passes (a diagnostic, not a
        training step: the step's probes were recorded when it ran)."""
        if not self.rerun.in_pass:
            self.forward.probe(tensor, label)

    def flush_at_end(self) -> None:
        """The step's frames and probes when the run ends (uninstall, interpreter exit): nothing to stop."""
        try:
            self.guarded("end of run", self.norms.settle, True)
            self.guarded("end of run", self.forward.flush)
        except INTENDED_STOPS:
            pass
