"""The state behind an installation: what the patches report to, and what writes maps and records.

Patches translate Megatron calls into the events below (optimizer built, step begins, non-finite grad
norm, loss-scale overflow) with plain data (``ParamSlot`` lists and gradient tensors); the runtime runs
the pure detection functions and writes the results. An internal error is logged once per kind and
the original behaviour goes on (``config.strict`` lets it propagate); the only exception raised into
training on purpose is ``NonFiniteGradientError``, with ``on_nonfinite="raise"``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .bundle import bundle_dir, tensors_bytes, write_bundle
from .capture import CaptureManager, bundle_contents
from .config import GradnanConfig, parse_ranges
from .detect import offending_params
from .frames import FrameBuffer, FrameTracer, first_nonfinite
from .log import logger
from .maps import ParamSlot, map_document
from .probe import Probes, enclosing_module
from .records import (
    FORWARD_SHARE,
    RECORD_SCHEMA,
    SCHEMA_VERSION,
    append_record,
    json_float,
    map_path,
    records_path,
    run_identity,
    shown_axes,
    write_json_atomic,
)


class NonFiniteGradientError(RuntimeError):
    """Raised with ``on_nonfinite="raise"`` after the forensic record is on disk."""


class AbortRequested(RuntimeError):
    """Raised with ``abort_after_step`` once that step has finished and its records are on disk."""


_INTENDED = (NonFiniteGradientError, AbortRequested)  # the only exceptions gradnan raises into training


class _Tracked:
    """What the runtime knows of one (outermost) optimizer."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.steps = 0
        self.map_file: Optional[str] = None
        self.consecutive_skips = 0
        self.scale_collapse_reported = False
        self.last_nonfinite_step: Optional[int] = None
        self.consecutive_nonfinite = 0


class Runtime:
    def __init__(self, config: GradnanConfig, coords: Callable[[], Dict[str, Any]],
                 versions: Callable[[], Dict[str, Any]],
                 iteration: Callable[[], Optional[int]] = lambda: None,
                 named_modules: Callable[[Sequence[torch.nn.Module]], List[Tuple[str, torch.nn.Module]]] = (
                     lambda chunks: []),
                 observed_grad: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = (
                     lambda param: param.grad),
                 param_facts: Callable[[torch.nn.Parameter], Dict[str, Any]] = lambda param: {}) -> None:
        self.config = config
        self._coords = coords
        self._versions = versions
        self._iteration = iteration
        self._param_facts = param_facts
        self._lock = threading.Lock()
        self._local = threading.local()
        self._tracked: "weakref.WeakKeyDictionary[Any, _Tracked]" = weakref.WeakKeyDictionary()
        self._next_index = 0
        self._chunks: List["weakref.ref[torch.nn.Module]"] = []
        self._errors_logged: Set[str] = set()
        self._ids_by_name: Dict[str, int] = {}
        self._synced: Set[Tuple[int, int]] = set()
        self._deferred: List[Tuple[Any, torch.Tensor, Callable]] = []
        self._pre_reduction_checked = False
        self._pre_reduction_found = False
        self._pre_reduction_logged = False
        self._bucket_group_index: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.run = run_identity(config.run_id, os.environ, time.time())
        self._records_full = False
        self._bundles_written = 0
        self._bundle_limits_logged: Set[str] = set()
        self._named_modules = named_modules
        self.captures = CaptureManager(config, lambda: named_modules(self.known_chunks()), self._write_bundle,
                                       observed_grad, lambda: int(self.coords()["global_rank"]), self.record_step)
        self._recording = True
        self._manual_step: Optional[int] = None
        self._rank_recorded: Optional[bool] = None
        self._ranks, self._steps = parse_ranges(config.ranks), parse_ranges(config.steps)
        self._trace_steps = parse_ranges(config.trace_steps)
        self.frames: Optional[FrameTracer] = None
        self._frame_buffer = FrameBuffer(config.max_frames)
        self._probes = Probes()
        self._module_name_cache: Optional[Dict[int, str]] = None
        self._known_coords: Optional[Dict[str, Any]] = None

    def close(self) -> None:
        """Write what this step measured so far, then remove every hook this runtime put on the model."""
        self.flush_at_end()
        self.captures.close()
        if self.frames is not None:
            self.frames.detach()
            self.frames = None

    # -- safety -------------------------------------------------------------------------------------

    def guarded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; on an exception log it once per (what, type) and return None, unless strict."""
        try:
            return fn(*args)
        except _INTENDED:
            raise
        except Exception as exc:
            if self.config.strict:
                raise
            key = f"{what}:{type(exc).__name__}"
            if key not in self._errors_logged:
                self._errors_logged.add(key)
                logger.error("internal error in %s (training goes on unchanged): %s: %s", what,
                             type(exc).__name__, exc)
            return None

    # -- model chunks seen by the param-group builder ----------------------------------------------

    def register_chunks(self, chunks: Sequence[torch.nn.Module]) -> None:
        with self._lock:
            live = [ref for ref in self._chunks if ref() is not None]
            known = {id(ref()) for ref in live}
            live += [weakref.ref(chunk) for chunk in chunks if id(chunk) not in known]
            self._chunks = live
            self._module_name_cache = None

    def known_chunks(self) -> List[torch.nn.Module]:
        return [chunk for chunk in (ref() for ref in self._chunks) if chunk is not None]

    # -- optimizer lifecycle -------------------------------------------------------------------------

    def _track(self, optimizer: Any) -> Tuple[_Tracked, bool]:
        with self._lock:
            tracked = self._tracked.get(optimizer)
            if tracked is not None:
                return tracked, False
            tracked = _Tracked(self._next_index)
            self._next_index += 1
            self._tracked[optimizer] = tracked
            return tracked, True

    def coords(self) -> Dict[str, Any]:
        """This rank's coordinates, as first seen with the optimizer built (a write at exit, after the
        process groups are gone, still lands in this rank's file)."""
        return self._known_coords if self._known_coords is not None else self._coords()

    def optimizer_built(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None:
        tracked, new = self._track(optimizer)
        if new and self._known_coords is None:
            self._known_coords = self._coords()
        if new and self.config.maps:
            coords = self.coords()
            path = map_path(self.config.out_dir, coords, tracked.index)
            document = map_document(
                coords, self._versions(), self.run, tracked.index, type(optimizer).__name__, slots()
            )
            write_json_atomic(path, document)
            tracked.map_file = str(path)
            if tracked.index == 0:
                self._ids_by_name = {entry["name"]: entry["id"] for entry in document["params"]}
            logger.debug("wrote parameter map %s (%d parameters)", path, len(document["params"]))
        if new:
            self.captures.start(self.selection_step())
            self.start_frames()

    def begin_step(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None:
        self.optimizer_built(optimizer, slots)
        tracked, _ = self._track(optimizer)
        tracked.steps += 1
        self._local.stepping = optimizer
        self.guarded("frames", self.flush_step)  # every forward of this step is done

    def end_step(self, optimizer: Any, skipped: Optional[bool]) -> None:
        """``skipped``: the step applied no update (fp16 overflow); counts consecutive skips."""
        finished = self.selection_step()
        if getattr(self._local, "stepping", None) is optimizer:
            self._local.stepping = None
        with self._lock:
            self._deferred = []
            self._pre_reduction_checked = False
            self._pre_reduction_found = False
        tracked, _ = self._track(optimizer)
        self.captures.end_step(self._loop_step(tracked.steps), finished + 1)
        if skipped is not None:
            tracked.consecutive_skips = tracked.consecutive_skips + 1 if skipped else 0
            if not skipped:
                tracked.scale_collapse_reported = False
        if self._manual_step is None:
            self._abort_if_asked(finished)

    def stepping_optimizer(self) -> Optional[Any]:
        return getattr(self._local, "stepping", None)

    def upcoming_step(self) -> int:
        """The step in progress: the stepping optimizer's count, else one past the last step taken."""
        stepping = self.stepping_optimizer()
        with self._lock:
            if stepping is not None and stepping in self._tracked:
                return self._tracked[stepping].steps
            return max((t.steps for t in self._tracked.values()), default=0) + 1

    def ids_by_name(self) -> Dict[str, int]:
        return self._ids_by_name

    # -- steps and the recording window --------------------------------------------------------------

    def record_step(self) -> int:
        """The step in progress as records name it: the custom loop's count once ``step()`` is used,
        else the optimizer's."""
        return self._loop_step(self.upcoming_step())

    def _loop_step(self, step: int) -> int:
        """``step`` (an optimizer count), or the custom loop's count once it calls ``step()``."""
        return self._manual_step if self._manual_step is not None else step

    def selection_step(self) -> int:
        """The step in progress as the step filters see it: Megatron-LM's iteration where its loop runs."""
        if self._manual_step is not None:
            return self._manual_step
        iteration = self._iteration()
        return iteration if iteration is not None else self.upcoming_step()

    def recording(self) -> bool:
        """Whether anything is recorded now (``start()``/``stop()``, ``ranks``, ``steps``)."""
        if not self._recording:
            return False
        if self._ranks and self._rank_recorded is None:
            self._rank_recorded = int(self.coords()["global_rank"]) in self._ranks
        if self._ranks and not self._rank_recorded:
            return False
        return not self._steps or self.selection_step() in self._steps

    def flush_at_end(self) -> None:
        """``flush_step`` when the run ends (uninstall, interpreter exit): nothing to stop any more."""
        try:
            self.guarded("end of run", self.flush_step)
        except _INTENDED:
            pass

    def set_recording(self, on: bool) -> None:
        if not on:
            self.guarded("frames", self.flush_step)  # the window's last step is written before it closes
        self._recording = on

    def advance_step(self) -> None:
        """A custom loop finished a step (call it after the optimizer's step): write what it measured,
        then count the next one. The loop's count starts from the optimizer steps taken so far (at least
        1: a loop without a Megatron optimizer) and from then on names records and steps filters."""
        if self._manual_step is None:
            with self._lock:
                self._manual_step = max([1, *(t.steps for t in self._tracked.values())])
        finished = self._manual_step
        self.flush_step()
        self._manual_step = finished + 1
        self._abort_if_asked(finished)

    def _abort_if_asked(self, finished: int) -> None:
        limit = self.config.abort_after_step
        if limit and finished >= limit:
            raise AbortRequested(f"gradnan: stopping after step {finished} as configured"
                                 f" (abort_after_step={limit}); records are in {self.config.out_dir}")

    # -- forward frames and probes --------------------------------------------------------------------

    def start_frames(self) -> None:
        """Hook the watched modules of the known model chunks (once) when frame tracing is on."""
        if self.config.frames == "off" or self.frames is not None:
            return
        modules = [(name, module) for name, module in self._named_modules(self.known_chunks())
                   if self.config.watches(name)]
        if not modules:
            logger.warning("frames=%s: no module to trace (model not seen yet, or modules/exclude_modules"
                           " exclude them all)", self.config.frames)
            return
        self.frames = FrameTracer(modules, self.record_step, self._frames_wanted).attach()

    def _frames_wanted(self) -> bool:
        if not self.recording():
            return False
        return self.selection_step() in self._trace_steps if self.config.frames == "trace" else True

    def flush_step(self) -> None:
        """Read what the step's frames and probes measured (one host read each) and write what matters."""
        step = self.record_step()
        bad_probes = self._probes.read()
        if bad_probes and self.recording():
            self._write_probes(step, bad_probes)
        if self.frames is None:
            return
        frames = self.frames.read()
        if self.config.frames == "trace":
            if frames:
                bad = first_nonfinite(frames)
                self._write("frames", step, [], {"mode": "trace", "frames": [f.to_json() for f in frames],
                                                 "frames_total": len(frames), "first_nonfinite": bad,
                                                 "local_nonfinite": bad is not None})
            if self.selection_step() >= max(self._trace_steps):
                self.frames.detach()  # the last traced step is written: no hook is left on the model
            return
        if not frames:
            return
        window = self._frame_buffer.add(frames)
        if window is None:
            return
        last = window[-1]
        record = self._write("frames", step, [], {
            "mode": "detect", "frames": [f.to_json() for f in window], "frames_total": len(window),
            "first_nonfinite": len(window) - 1, "local_nonfinite": True})
        logger.error("step %d: forward value non-finite first in %s (%s) on %s; the %d frames before it are in"
                     " %s; frame detection now stops", step, last.module or "<model>", last.cls, _where(record),
                     len(window) - 1, record["_path"])
        self.frames.detach()
        self._stop_if_asked(record)

    def probe(self, tensor: torch.Tensor, label: str) -> None:
        if self.recording():
            self._probes.add(tensor, label, self.record_step(), enclosing_module(self._module_names))

    def _module_names(self) -> Dict[int, str]:
        if self._module_name_cache is None:
            self._module_name_cache = {id(module): name for name, module in self._named_modules(self.known_chunks())}
        return self._module_name_cache

    def _write_probes(self, step: int, bad: List[Dict[str, Any]]) -> None:
        record = self._write("probe", step, [], {"probes": bad, "local_nonfinite": True})
        first = bad[0]
        logger.error("step %d: gradnan.check(%r) found %d NaN and %d Inf in %s on %s; record: %s", step,
                     first["label"], first["nan"], first["inf"], first["module"] or "code outside any module",
                     _where(record), record["_path"])

    # -- pre-reduction (data-parallel bucket) checks -------------------------------------------------

    def first_sync_of_step(self, group: Any) -> bool:
        """True once per bucket group per step (Megatron may start a group's sync twice)."""
        if not self.recording():
            return False
        step = self.upcoming_step()
        with self._lock:
            key = (id(group), step)
            if key in self._synced:
                return False
            self._synced = {k for k in self._synced if k[1] == step} | {key}
            self._pre_reduction_checked = True
            return True

    def defer_pre_reduction_flags(self, group: Any, flags: torch.Tensor, describe: Callable) -> None:
        """Keep a bucket group's on-device flags until a non-finite norm asks for them (no host sync)."""
        with self._lock:
            self._deferred.append((group, flags, describe))

    def pre_reduction_flags(self, group: Any, flags: torch.Tensor, describe: Callable, mode: str,
                            level: int = logging.WARNING) -> bool:
        """Read a bucket group's flags; on a bad bucket record its parameters. True if one was bad."""
        bad = [index for index, finite in enumerate(flags.tolist()) if not finite]
        if not bad:
            return False
        slots, grads, buckets = describe(group, bad)
        found = offending_params(slots, grads)
        if not found:
            return False
        with self._lock:
            group_index = self._bucket_group_index.setdefault(group, len(self._bucket_group_index))
        record = self._write("pre_reduction", self.upcoming_step(), found, {
            "mode": mode, "bucket_group": group_index, "buckets": buckets, "order": "backward",
            "micro_batch": None})
        with self._lock:
            self._pre_reduction_found = True
            first, self._pre_reduction_logged = not self._pre_reduction_logged, True
        logger.log(level if first else logging.DEBUG,
                   "step %d: non-finite gradient on %s BEFORE the data-parallel collective: %s;"
                   " this rank produced it; record: %s", record["step"], _where(record),
                   _describe_params(record), record["_path"])
        return True

    def _flush_deferred(self, level: int) -> str:
        """Read the deferred bucket flags of this step: "nonfinite", "clean" or "unchecked"."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
            checked = self._pre_reduction_checked
        bad = [self.pre_reduction_flags(group, flags, describe, mode="deferred", level=level)
               for group, flags, describe in deferred]
        if any(bad) or self._pre_reduction_found:
            return "nonfinite"
        return "clean" if checked else "unchecked"

    # -- detections ----------------------------------------------------------------------------------

    def _write(self, kind: str, step: int, found: List[Dict[str, Any]],
               extra: Dict[str, Any]) -> Dict[str, Any]:
        coords = self.coords()
        limit = self.config.max_params_per_record
        step = self._loop_step(step)
        record = {
            "schema": RECORD_SCHEMA,
            "version": SCHEMA_VERSION,
            "kind": kind,
            "step": step,
            "iteration": self._iteration(),
            "time": time.time(),
            "rank": coords,
            "run": self.run,
            "local_nonfinite": bool(found),
            "params": found[:limit],
            "params_total": len(found),
            **extra,
        }
        path = records_path(self.config.out_dir, coords)
        record["_path"] = str(path)
        if path.exists() and path.stat().st_size >= self.config.max_records_bytes:
            if not self._records_full:
                self._records_full = True
                logger.error("%s reached max_records_bytes (%d): later records are not written",
                             path, self.config.max_records_bytes)
            return record
        append_record(path, {key: value for key, value in record.items() if key != "_path"})
        return record

    def _record(self, optimizer: Any, kind: str, slots: Sequence[ParamSlot],
                grads: Sequence[Optional[torch.Tensor]], extra: Dict[str, Any]) -> Dict[str, Any]:
        # an fp16 overflow is routine until it repeats: its pre-reduction finding is logged quietly
        pre_reduction = self._flush_deferred(logging.ERROR if kind == "nonfinite_grad_norm" else logging.DEBUG)
        tracked, _ = self._track(optimizer)
        return self._write(kind, tracked.steps, offending_params(slots, grads), {
            "optimizer_index": tracked.index, "map": tracked.map_file,
            "pre_reduction": pre_reduction, **extra})

    def nonfinite_grad_norm(self, optimizer: Any, norm: float, slots: Sequence[ParamSlot],
                            grads: Sequence[Optional[torch.Tensor]]) -> None:
        if not self.recording():
            return
        record = self._record(optimizer, "nonfinite_grad_norm", slots, grads,
                              {"grad_norm": json_float(norm)})
        tracked, _ = self._track(optimizer)
        consecutive = tracked.last_nonfinite_step == record["step"] - 1
        tracked.consecutive_nonfinite = tracked.consecutive_nonfinite + 1 if consecutive else 1
        tracked.last_nonfinite_step = record["step"]
        count = tracked.consecutive_nonfinite
        where = _where(record)
        if count > 1:
            level = logging.WARNING if _is_power_of_two(count) else logging.DEBUG
            logger.log(level, "step %d: grad norm non-finite for %d consecutive steps on %s; %s",
                       record["step"], count, where, _describe_params(record))
        elif record["params"]:
            logger.error("step %d: grad norm is %s; %s on %s; record: %s. Without a loss scaler"
                         " Megatron applies this update: the weights become non-finite.",
                         record["step"], record["grad_norm"], _describe_params(record), where,
                         record["_path"])
        else:
            logger.warning("step %d: grad norm is %s; the gradients on %s are finite (the bad value"
                           " came from another rank through the norm's all-reduce); record: %s",
                           record["step"], record["grad_norm"], where, record["_path"])
        self._after_detection(record, len(slots))
        self._stop_if_asked(record)

    def _after_detection(self, record: Dict[str, Any], local_params: int) -> None:
        """Capture: write what retention kept of this step; arm the implicated module where this rank may
        be the origin (not where its own gradients were clean before the data-parallel collective)."""
        implicated = record["params"] and record["pre_reduction"] != "clean"
        forward = implicated and local_params > 0 and record["params_total"] >= FORWARD_SHARE * local_params
        first = max(record["params"], key=lambda p: p.get("order", -1))["name"] if implicated else None
        self.captures.on_detection(record["step"], bool(forward), first, arm=bool(implicated))

    def _write_bundle(self, step: int, capture: Any, call: Any, observed: Dict[str, Any],
                      context: Dict[str, Any]) -> bool:
        if not self.recording():
            return False
        step = self._loop_step(step)
        manifest, tensors = bundle_contents(capture, call, observed, context, self._param_facts)
        size = tensors_bytes(tensors)
        limit = ("max_bundles" if self._bundles_written >= self.config.max_bundles
                 else "max_bundle_bytes" if size > self.config.max_bundle_bytes else None)
        if limit is not None:
            if limit not in self._bundle_limits_logged:
                self._bundle_limits_logged.add(limit)
                logger.warning("capture of %s at step %d not written: %s reached", capture.name, step, limit)
            return False
        coords = self.coords()
        manifest.update(rank=coords, run=self.run, versions=self._versions(), step=step,
                        iteration=self._iteration())
        path = write_bundle(bundle_dir(self.config.out_dir, coords, step, capture.name), manifest, tensors)
        self._bundles_written += 1
        logger.warning("step %d: captured %s on %s (%s); replay it: gradnan replay %s", step, capture.name,
                       _where(manifest), capture.mode, path)
        return True

    def _stop_if_asked(self, record: Dict[str, Any]) -> None:
        if self.config.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                f"gradnan: {record['kind']} at step {record['step']} on {_where(record)}; stopping as"
                f" configured (on_nonfinite=raise); record: {record['_path']}")

    def loss_scale_overflow(self, optimizer: Any, leaf: int, scale: Optional[float],
                            min_scale: Optional[float], slots: Sequence[ParamSlot],
                            grads: Sequence[Optional[torch.Tensor]]) -> None:
        if not self.recording():
            return
        tracked, _ = self._track(optimizer)
        skips = tracked.consecutive_skips + 1  # this step's skip is counted when the step returns
        chosen = [i for i, slot in enumerate(slots) if slot.optimizer == leaf]
        collapsed = scale is not None and min_scale is not None and scale <= min_scale
        record = self._record(
            optimizer, "loss_scale_overflow", [slots[i] for i in chosen], [grads[i] for i in chosen],
            {"loss_scale": None if scale is None else json_float(scale),
             "min_loss_scale": None if min_scale is None else json_float(min_scale), "sub_optimizer": leaf,
             "consecutive_skips": skips, "scale_collapsed": collapsed},
        )
        first = self.config.skip_warn_after
        if collapsed or skips == first:
            self._after_detection(record, len(slots))
        if collapsed and not tracked.scale_collapse_reported:
            tracked.scale_collapse_reported = True
            logger.error("step %d: loss scale collapsed to %s (its minimum) after %d skipped steps;"
                         " %s; record: %s", record["step"], scale, skips,
                         _describe_params(record), record["_path"])
            self._stop_if_asked(record)
        elif skips >= first and _is_power_of_two(skips // first) and skips % first == 0:
            logger.warning("step %d: %d consecutive fp16 steps skipped for gradient overflow"
                           " (loss scale %s); %s; record: %s", record["step"], skips, scale,
                           _describe_params(record), record["_path"])
        else:
            logger.debug("step %d: loss-scale overflow (scale %s), step skipped", record["step"], scale)


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _where(record: Dict[str, Any]) -> str:
    rank = record["rank"]
    axes = " ".join(f"{axis}{rank.get(axis)}" for axis in shown_axes(rank))
    return f"rank {rank['global_rank']} ({axes}, {rank['host']} {rank['device']})"


def _describe_params(record: Dict[str, Any]) -> str:
    params = record["params"]
    if not params:
        return "no local parameter gradient is non-finite"
    first = params[0]
    counts = ", ".join(f"{first[k]} {label}" for k, label in (("nan", "NaN"), ("inf", "Inf"))
                       if first[k])
    more = record["params_total"] - 1
    tail = f" and {more} more parameter(s)" if more else ""
    return (f"non-finite gradient in {first['name']} ({counts}, first at "
            f"{first['first_bad_index']}){tail}")


def is_finite_number(value: Any) -> bool:
    """True for a finite Python/NumPy number or one-element tensor; None counts as finite (no norm)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))
