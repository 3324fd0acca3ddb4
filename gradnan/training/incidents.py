"""What a detection does: a non-finite grad norm, an fp16 loss-scale overflow, a bad bucket before the
data-parallel collective. Each one becomes a record (localized by ``offenders.offending_params``), a log line
whose level follows how serious and how repeated it is, and a hint to capture."""

from __future__ import annotations

import logging
import math
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import GradnanConfig
from ..events import DescribeBuckets, DescribeContents, Grads, StepState
from ..formats.incident import RecordKind
from ..formats.maps import ParamSlot
from ..formats.records import FLOAT32_SQUARE_LIMIT, FORWARD_SHARE
from ..formats.schema import json_float, nonfinite_counts
from ..formats.wording import describe_largest
from ..log import logger
from .capture import CaptureManager
from .clock import StepClock
from .health import DeviceHealth
from .messages import describe_params, is_power_of_two, when, where
from .offenders import largest_gradient, offending_params
from .replicas import Divergence
from .runup import RunUp
from .weights import state_fields
from .writer import Writer, Written

MAX_RUNUP_FILES = 16  # run-up files a rank writes at most (one per incident step; a run of bad steps: one)


class OptimizerState:
    """What the detections remember of one (outermost) optimizer."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.map_file: Optional[str] = None
        self.consecutive_skips = 0
        # an update has been applied: the loss scale is no longer coming down from its start
        self.warmed_up = False
        self.scale_collapse_reported = False
        self.last_nonfinite_step: Optional[int] = None
        self.consecutive_nonfinite = 0


class Detections:
    def __init__(self, config: GradnanConfig, clock: StepClock, writer: Writer, captures: CaptureManager,
                 rerun_expected: Callable[[], bool], health: DeviceHealth,
                 links: Callable[[], Optional[Dict[str, Any]]]) -> None:
        """``rerun_expected()``: the failing step will be run again in place (``rerun``), which finds a
        forward origin better than watching later steps. ``health``: the device's health, read into the
        records of an incident (never of a routine fp16 overflow); ``links()`` likewise, the pipeline's
        transfers of the step as this stage saw them (``links.PipelineLinks.read``)."""
        self.config, self._clock, self._writer, self._captures = config, clock, writer, captures
        self._health, self._links = health, links
        self._rerun_expected = rerun_expected
        self._lock = threading.Lock()
        self._optimizers: "weakref.WeakKeyDictionary[Any, OptimizerState]" = weakref.WeakKeyDictionary()
        self._optimizers_seen = 0  # never reused: a collected optimizer's index (its map file) stays its own
        self._synced: set = set()
        self._deferred: List[Tuple[Any, torch.Tensor, DescribeBuckets]] = []
        self._pre_reduction_checked = False
        self._pre_reduction_found = False
        self._pre_reduction_overflow = False
        self._pre_reduction_logged = False
        self._bucket_group_index: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.runup = RunUp(config.runup_steps)
        self._runup_step: Optional[int] = None  # the last incident step that asked for the run-up
        self._runup_path: Optional[str] = None  # and where it was written (None: not)
        self._runup_files = 0
        self.last_pre_reduction: Optional[str] = None  # this step's: were this rank's own gradients bad?
        # this step's, at the grad norm: "nonfinite", "overflow" (every gradient finite, the rank's own
        # float32 sum of squares not) or "finite"; None: no non-finite norm was recorded
        self.last_at_norm: Optional[str] = None

    def optimizer(self, optimizer: Any) -> Tuple[OptimizerState, bool]:
        """The state of ``optimizer``, and whether it was seen for the first time."""
        with self._lock:
            state = self._optimizers.get(optimizer)
            if state is not None:
                return state, False
            state = self._optimizers[optimizer] = OptimizerState(self._optimizers_seen)
            self._optimizers_seen += 1
            return state, True

    def step_ended(self, optimizer: Any, skipped: Optional[bool]) -> None:
        """``skipped``: the step applied no update (fp16 overflow); counts consecutive skips."""
        with self._lock:
            self._deferred = []
            self._pre_reduction_checked = self._pre_reduction_found = self._pre_reduction_overflow = False
        self.last_pre_reduction = self.last_at_norm = None
        state, _ = self.optimizer(optimizer)
        if skipped is not None:
            state.consecutive_skips = state.consecutive_skips + 1 if skipped else 0
            if not skipped:
                state.warmed_up = True
                state.scale_collapse_reported = False

    # -- pre-reduction (data-parallel bucket) checks -------------------------------------------------

    def first_sync_of_step(self, group: Any) -> bool:
        """True once per bucket group per step (Megatron may start a group's sync twice)."""
        step = self._clock.current()
        with self._lock:
            key = (id(group), step)
            if key in self._synced:
                return False
            self._synced = {k for k in self._synced if k[1] == step} | {key}
            self._pre_reduction_checked = True
            return True

    def bucket_group_index(self, group: Any) -> int:
        """A bucket group's number in this rank's records and run-up: the order of their first sync."""
        with self._lock:
            return self._bucket_group_index.setdefault(group, len(self._bucket_group_index))

    def keep_runup(self, group: Any, maxima: torch.Tensor, contents: DescribeContents) -> None:
        """This step's bucket abs maxima of ``group`` into its run-up ring (on the device, no host read)."""
        self.runup.write(group, self.bucket_group_index(group), self._clock.current(), maxima, contents)

    def _runup_file(self, step: int) -> Optional[str]:
        """Write the run-up at an incident ``step``, once for the step (every record of it names the same
        file); not for the step right after one that asked (a run of non-finite steps has one run-up, its
        first's), and at most ``MAX_RUNUP_FILES`` per rank. Its path, or None."""
        with self._lock:
            if step == self._runup_step:
                return self._runup_path
            consecutive = self._runup_step == step - 1
            self._runup_step, self._runup_path = step, None
            if consecutive or self._runup_files >= MAX_RUNUP_FILES:
                return None
        groups = self.runup.to_json()
        if not groups:
            return None
        path = self._writer.runup(step, groups)
        with self._lock:
            self._runup_path = path
            self._runup_files += path is not None
        return path

    def defer_pre_reduction_flags(self, group: Any, maxima: torch.Tensor, describe: DescribeBuckets) -> None:
        """Keep a bucket group's on-device abs maxima until a non-finite norm asks for them (no host sync)."""
        with self._lock:
            self._deferred.append((group, maxima, describe))

    def pre_reduction_flags(self, group: Any, maxima: torch.Tensor, describe: DescribeBuckets, mode: str,
                            level: int = logging.ERROR) -> bool:
        """Read a bucket group's abs maxima (one per bucket, as it was before the collective); record a bucket
        that held a non-finite gradient, or else one whose largest gradient squares past float32's range (the
        grad norm, and Megatron's own bucket check, overflow from finite gradients). True if one did. Logged
        at ERROR whether it is read at once (``pre_reduction="sync"``, or Megatron's own check is on) or at
        the non-finite norm, DEBUG only under a routine fp16 overflow."""
        read = maxima.tolist()
        bad = [index for index, value in enumerate(read) if not math.isfinite(value)]
        if bad:
            slots, grads, buckets = describe(group, bad)
            found = offending_params(slots, grads)
            if found:
                self._pre_reduction_record(group, found, buckets, mode, level, None)
                return True
        huge = [index for index, value in enumerate(read) if FLOAT32_SQUARE_LIMIT <= value < math.inf]
        if not huge:
            return False
        slots, grads, buckets = describe(group, huge)
        largest = largest_gradient(slots, grads)
        if largest is None:
            return False
        # deferred, the bucket holds the reduced gradient now: its magnitude before the collective is the one
        # read with the flag (its sign where the reduced value still has one: a peer's NaN may have come in)
        sign = largest["value"] if isinstance(largest["value"], (int, float)) else 1.0
        largest.update(value=json_float(math.copysign(max(read[i] for i in huge), sign)), overflows=True)
        self._pre_reduction_record(group, [], buckets, mode, level, largest)
        return True

    def _pre_reduction_record(self, group: Any, found: List[Dict[str, Any]], buckets: List[dict], mode: str,
                              level: int, largest: Optional[Dict[str, Any]]) -> None:
        """Write and log a pre-reduction record: non-finite gradients (``found``), or a norm overflow from
        finite ones (``largest``: the largest gradient before the collective)."""
        step = self._clock.current()
        extra = {"mode": mode, "bucket_group": self.bucket_group_index(group), "buckets": buckets,
                 "order": "backward", "micro_batch": None,
                 "runup": self._runup_file(step) if level > logging.DEBUG else None}
        if largest is not None:
            extra.update(norm_overflow=True, largest_grad=largest)
        record = self._writer.record(RecordKind.PRE_REDUCTION, step, found,
                                     self._with_health(extra, step, level >= logging.ERROR))
        with self._lock:
            if largest is None:
                self._pre_reduction_found = True
            else:
                self._pre_reduction_overflow = True
            first, self._pre_reduction_logged = not self._pre_reduction_logged, True
        if largest is None:
            logger.log(level if first else logging.DEBUG,
                       "%s: this rank's own gradients on %s are non-finite BEFORE the data-parallel"
                       " collective: %s; this data-parallel replica produced them, they did not come through"
                       " that collective (which rank of the replica, and where: gradnan report); record: %s",
                       when(record), where(record), describe_params(record), record.path)
        else:
            logger.log(level if first else logging.DEBUG,
                       "%s: every gradient on %s is finite BEFORE the data-parallel collective, but its"
                       " largest, %s, squares past float32's range: the grad norm overflows (exploding"
                       " gradients), produced in this data-parallel replica; record: %s", when(record),
                       where(record), describe_largest(largest), record.path)

    def _flush_deferred(self, level: int) -> str:
        """Read the deferred bucket abs maxima of this step: "nonfinite", "overflow" (all finite, one squares
        past float32's range), "clean" or "unchecked"."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
            checked = self._pre_reduction_checked
        bad = [self.pre_reduction_flags(group, flags, describe, mode="deferred", level=level)
               for group, flags, describe in deferred]
        if self._pre_reduction_found:
            return "nonfinite"
        if any(bad) or self._pre_reduction_overflow:
            return "overflow"
        return "clean" if checked else "unchecked"

    def own_gradients(self) -> str:
        """This step's pre-reduction finding: "nonfinite", "overflow", "clean" or "unchecked" (reads and
        records the deferred bucket abs maxima, as a detection does)."""
        self.last_pre_reduction = self._flush_deferred(logging.ERROR)
        return self.last_pre_reduction

    # -- the optimizer's findings ----------------------------------------------------------------------

    def _with_health(self, extra: Dict[str, Any], step: int, incident: bool) -> Dict[str, Any]:
        """``extra`` and, at an incident where NVML reports on this rank's device, its ``device_health``
        (read once for the record's ``step``)."""
        health = self._health.at(step) if incident else None
        return extra if health is None else {**extra, "device_health": health}

    def _record(self, optimizer: Any, kind: RecordKind, slots: Sequence[ParamSlot], grads: Grads,
                extra: Dict[str, Any], incident: bool = True) -> Written:
        """``incident``: not a routine fp16 skip; its run-up is written (``_runup_file``)."""
        # an fp16 overflow is routine until it repeats: its pre-reduction finding is logged quietly
        pre_reduction = self._flush_deferred(logging.ERROR if kind == RecordKind.NONFINITE_GRAD_NORM
                                             else logging.DEBUG)
        self.last_pre_reduction = pre_reduction
        state, _ = self.optimizer(optimizer)
        found = offending_params(slots, grads)
        if kind == RecordKind.NONFINITE_GRAD_NORM:
            # every gradient here finite: the largest says whether this rank's own norm overflowed
            extra = {**extra, "largest_grad": None if found else largest_gradient(slots, grads)}
        step = self._clock.current(optimizer)
        links = self._links() if incident else None
        if links is not None:
            extra = {**extra, "pipeline_links": links}
        return self._writer.record(kind, step, found, self._with_health({
            "optimizer_index": state.index, "map": state.map_file, "pre_reduction": pre_reduction,
            "runup": self._runup_file(step) if incident else None, **extra}, step, incident))

    def nonfinite_grad_norm(self, optimizer: Any, norm: float, slots: Sequence[ParamSlot],
                            grads: Grads) -> Written:
        """Record and log it; the record, on which to stop if asked."""
        record = self._record(optimizer, RecordKind.NONFINITE_GRAD_NORM, slots, grads,
                              {"grad_norm": json_float(norm)})
        state, _ = self.optimizer(optimizer)
        consecutive = state.last_nonfinite_step == record["step"] - 1
        state.consecutive_nonfinite = state.consecutive_nonfinite + 1 if consecutive else 1
        state.last_nonfinite_step = record["step"]
        count = state.consecutive_nonfinite
        largest = record["largest_grad"]
        self.last_at_norm = at_norm(record)
        if count > 1:
            logger.log(logging.WARNING if is_power_of_two(count) else logging.DEBUG,
                       "%s: grad norm non-finite for %d consecutive steps on %s; %s",
                       when(record), count, where(record), describe_params(record))
        elif record["params"]:
            logger.error("%s: grad norm is %s; %s on %s; record: %s. Without a loss scaler"
                         " Megatron applies this update: the weights become non-finite.",
                         when(record), record["grad_norm"], describe_params(record), where(record),
                         record.path)
        elif largest is not None and largest["overflows"]:
            logger.error("%s: grad norm is %s: the grad norm overflowed although every gradient is finite"
                         " (exploding gradients); on %s the largest gradient, %s, squares past float32's"
                         " range; %s; record: %s", when(record), record["grad_norm"], where(record),
                         describe_largest(largest), _overflow_source(record["pre_reduction"]), record.path)
        else:
            logger.warning("%s: grad norm is %s; the gradients on %s are finite and their own sum of squares"
                           " too (largest: %s): the bad value came from another rank through the norm's"
                           " all-reduce; record: %s", when(record), record["grad_norm"], where(record),
                           describe_largest(largest), record.path)
        self._capture_after(record, len(slots))
        return record

    def overflow_is_incident(self, optimizer: Any, scale: Optional[float], min_scale: Optional[float],
                             loss_finite: Optional[bool]) -> bool:
        """An fp16 overflow that is more than routine: the step's loss was non-finite (a forward overflow,
        which no loss scale explains, warm-up or not), the scale collapsed, or skips keep recurring after
        training had applied updates. The same on every rank (skips are counted whether recorded or not;
        ``loss_finite`` is agreed over the model-parallel group, None where not known)."""
        state, _ = self.optimizer(optimizer)
        return loss_finite is False or _collapsed(scale, min_scale) or (
            state.warmed_up and state.consecutive_skips + 1 == self.config.skip_warn_after)

    def loss_scale_overflow(self, optimizer: Any, leaf: int, scale: Optional[float],
                            min_scale: Optional[float], slots: Sequence[ParamSlot], grads: Grads,
                            loss_finite: Optional[bool]) -> Optional[Written]:
        """Record and log it; the record when the loss was non-finite or the scale collapsed (first time),
        on which to stop if asked. ``loss_finite``: the step's loss, agreed over the model-parallel group
        (None: not known, the step was not kept)."""
        state, _ = self.optimizer(optimizer)
        skips = state.consecutive_skips + 1  # this step's skip is counted when the step returns
        chosen = [i for i, slot in enumerate(slots) if slot.optimizer == leaf]
        collapsed = _collapsed(scale, min_scale)
        # no update applied yet: the scale is still coming down from its initial value (Megatron-LM's is
        # 2**32), and a run of skips is how dynamic loss scaling finds its footing, not an incident; unless
        # the loss itself was non-finite: no loss scale makes the forward pass overflow
        warmup = not state.warmed_up and loss_finite is not False
        incident = self.overflow_is_incident(optimizer, scale, min_scale, loss_finite)
        record = self._record(
            optimizer, RecordKind.LOSS_SCALE_OVERFLOW, [slots[i] for i in chosen], [grads[i] for i in chosen],
            {"loss_scale": None if scale is None else json_float(scale),
             "min_loss_scale": None if min_scale is None else json_float(min_scale), "sub_optimizer": leaf,
             "consecutive_skips": skips, "scale_collapsed": collapsed, "warmup": warmup,
             "loss_finite": loss_finite}, incident)
        first = self.config.skip_warn_after
        if incident:
            self._capture_after(record, len(slots))
        if loss_finite is False:
            logger.error("%s: fp16 step skipped with a non-finite loss (loss scale %s): the forward pass"
                         " overflowed, which no loss scale explains; %s; record: %s", when(record), scale,
                         describe_params(record), record.path)
            return record
        if collapsed and not state.scale_collapse_reported:
            state.scale_collapse_reported = True
            logger.error("%s: loss scale collapsed to %s (its minimum) after %d skipped steps;"
                         " %s; record: %s", when(record), scale, skips, describe_params(record),
                         record.path)
            return record
        if not warmup and skips >= first and is_power_of_two(skips // first) and skips % first == 0:
            logger.warning("%s: %d consecutive fp16 steps skipped for gradient overflow"
                           " (loss scale %s); %s; record: %s", when(record), skips, scale,
                           describe_params(record), record.path)
        else:
            logger.debug("%s: loss-scale overflow (scale %s), step skipped", when(record), scale)
        return None

    def nonfinite_loss(self, micro_batch: Optional[int], message: str, loss: float,
                       batch: Optional[Dict[str, Any]], rerun_skipped: Optional[str]) -> Dict[str, Any]:
        """Megatron's loss check rejected this rank's loss (``--rerun-mode disabled``): record and log it
        before Megatron's RuntimeError goes on to the user."""
        step = self._clock.current()
        record = self._writer.record(RecordKind.NONFINITE_LOSS, step, [], self._with_health({
            "micro_batch": micro_batch, "loss": json_float(loss), "message": message,
            "megatron_mode": "disabled", "batch": batch, "rerun_skipped": rerun_skipped}, step, True))
        logger.error("%s: Megatron's loss check rejected a non-finite loss (%s) on %s, micro-batch %s"
                     " (%r); Megatron raises next; %s%s; record: %s", when(record), record["loss"],
                     where(record), micro_batch, message,
                     f"the micro-batch: {batch['path']}" if batch else "no micro-batch kept",
                     f"; not run again: {rerun_skipped}" if rerun_skipped else "", record.path)
        return record

    def state(self, held: StepState, ids_by_name: Dict[str, int], at_launch: Optional[torch.Tensor],
              learning_rates: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The weights and optimizer state as the failing step found them (``weights.state_fields``) and
        the learning rates of the last steps: the ``state`` record, and a log line where a weight or a
        moment was already bad."""
        found, extra = state_fields(held, ids_by_name, at_launch)
        links = self._links()  # where Megatron's validation ends the step before any norm: its only record
        extra = {**extra, "learning_rates": learning_rates,
                 **({} if links is None else {"pipeline_links": links})}
        record = self._writer.record(RecordKind.STATE, self._clock.current(), found, extra)
        if found:
            first = found[0]
            logger.error("%s: the weights on %s were already non-finite when the step began: %s (%s copy, %s,"
                         " first at %s)%s; record: %s", when(record), where(record), first["name"],
                         first["copy"], nonfinite_counts(first), first["first_bad_index"],
                         f" and {len(found) - 1} more" if len(found) > 1 else "", record.path)
        for fault in extra["optimizer_state"][:1]:
            logger.error("%s: the optimizer state on %s is bad: %s of %s holds %d NaN, %d Inf and %d negative"
                         " value(s); record: %s", when(record), where(record), fault["state"], fault["name"],
                         fault["nan"], fault["inf"], fault["negative"], record.path)
        return record

    def replica_divergence(self, found: Divergence, read_at: int) -> Written:
        """This rank's weights differed from its data-parallel peers' at a replica check: the record, and an
        error log line naming the first differing parameter and element."""
        record = self._writer.record(RecordKind.REPLICA_DIVERGENCE, found.step, [],
                                     found.record_fields(read_at))
        first = found.params[0] if found.params else {}
        majority = (f", the majority's {first.get('majority_value')}" if found.agreeing
                    else "; no majority: which copy is wrong is not known")
        logger.error("%s: the weights on %s differ from its %d data-parallel peer(s)': %s at %s (%s%s); %d"
                     " parameter(s) differ; record: %s", when(record), where(record), found.replicas - 1,
                     first.get("name"), first.get("index"), first.get("value"), majority, found.params_total,
                     record.path)
        return record

    def _capture_after(self, record: Dict[str, Any], local_params: int) -> None:
        """Capture: write what retention kept of this step; arm the implicated module where this rank may
        be the origin (not where its own gradients were clean before the data-parallel collective)."""
        implicated = record["params"] and record["pre_reduction"] != "clean"
        forward = implicated and local_params > 0 and record["params_total"] >= FORWARD_SHARE * local_params
        first = max(record["params"], key=lambda p: p.get("order", -1))["name"] if implicated else None
        arm = bool(implicated) and not (forward and self._rerun_expected())
        self._captures.on_detection(record["step"], bool(forward), first, arm=arm)


def at_norm(record: Dict[str, Any]) -> str:
    """A grad-norm record's rank at the norm: "nonfinite" (it holds a non-finite gradient), "overflow"
    (every gradient finite, its own float32 sum of squares, or before the collective its largest gradient's
    square, not), or "finite"."""
    if record["params"]:
        return "nonfinite"
    largest = record.get("largest_grad")
    overflows = bool(largest and largest["overflows"]) or record.get("pre_reduction") == "overflow"
    return "overflow" if overflows else "finite"


def _overflow_source(pre_reduction: Optional[str]) -> str:
    """Where this rank's huge gradient came from, as its pre-reduction check saw it."""
    return _OVERFLOW_SOURCES.get(pre_reduction or "", "no pre-reduction check says whether it was produced"
                                                      " here")


_OVERFLOW_SOURCES = {
    "overflow": "it was this large before the data-parallel collective: produced in this replica",
    "clean": "before the data-parallel collective every gradient here was small: received through it from"
             " another replica"}


def _collapsed(scale: Optional[float], min_scale: Optional[float]) -> bool:
    """The fp16 loss scale has come down to its minimum: dynamic scaling cannot recover from here."""
    return scale is not None and min_scale is not None and scale <= min_scale
