"""Forward frames and probes on the training side: when frame tracing hooks the model, and what each
step's single read of their statistics writes (``frames`` and ``probe`` records)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..config import GradnanConfig
from ..config.values import FramesMode
from ..events import ModuleHooking, NamedModules
from ..formats.incident import RecordKind
from ..formats.records import MAX_PROBES
from ..log import logger
from .clock import StepClock
from .frames import FrameBuffer, FrameTracer, first_nonfinite
from .messages import when, where
from .probe import Probes, enclosing_module
from .stops import stop_if_asked
from .window import RecordingWindow
from .writer import Writer


class ForwardWatch:
    def __init__(self, config: GradnanConfig, clock: StepClock, window: RecordingWindow, writer: Writer,
                 named_modules: Callable[[], NamedModules], hooking: ModuleHooking) -> None:
        self.config, self._clock, self._window, self._writer = config, clock, window, writer
        self._named_modules, self._hooking = named_modules, hooking
        self._trace_steps = config.ranges("trace_steps")
        self.frames: Optional[FrameTracer] = None
        self._buffer = FrameBuffer(config.max_frames)
        self._probes = Probes()
        self._module_name_cache: Optional[Dict[int, str]] = None

    def model_changed(self) -> None:
        self._module_name_cache = None

    def start(self) -> None:
        """Hook the watched modules of the known model chunks (once) when frame tracing is on and modules
        may be hooked."""
        if self.config.frames is FramesMode.OFF or self.frames is not None or self._hooking.new is None:
            return
        modules = self.config.watched(self._named_modules(), include_model=True)
        if not modules:
            logger.warning("frames=%s: no module to trace (model not seen yet, or modules/exclude_modules"
                           " exclude them all)", self.config.frames.value)
            return
        self.frames = FrameTracer(modules, self._clock.current, self._wanted, self._hooking.new()).attach()

    def close(self) -> None:
        if self.frames is not None:
            self.frames.detach()
            self.frames = None

    def _wanted(self) -> bool:
        if not self._window.recording():
            return False
        return (self._clock.filter_step() in self._trace_steps if self.config.frames is FramesMode.TRACE
                else True)

    def flush(self) -> None:
        """Read what the step's frames and probes measured (one host read each) and write what matters."""
        step = self._clock.current()
        bad_probes = self._probes.read()
        if bad_probes and self._window.recording():
            self._write_probes(step, bad_probes)
        if self.frames is None:
            return
        frames = self.frames.read()
        if self.config.frames is FramesMode.TRACE:
            if frames:
                bad = first_nonfinite(frames)
                self._writer.record(RecordKind.FRAMES, step, [], {
                    "mode": "trace", "frames": [f.to_json() for f in frames], "frames_total": len(frames),
                    "first_nonfinite": bad, "local_nonfinite": bad is not None})
            if self._clock.filter_step() >= self._trace_steps.last():
                self.frames.detach()  # the last traced step is written: no hook is left on the model
            return
        window = self._buffer.add(frames) if frames else None
        if window is None:
            return
        last = window[-1]
        record = self._writer.record(RecordKind.FRAMES, step, [], {
            "mode": "detect", "frames": [f.to_json() for f in window], "frames_total": len(window),
            "first_nonfinite": len(window) - 1, "local_nonfinite": True})
        logger.error("%s: forward value non-finite first in %s (%s) on %s; the %d frames before it are in"
                     " %s; frame detection now stops", when(record), last.module or "<model>", last.cls,
                     where(record), len(window) - 1, record.path)
        self.frames.detach()
        stop_if_asked(self.config, record)

    def probe(self, tensor: torch.Tensor, label: str) -> None:
        if self._window.recording():
            self._probes.add(tensor, label, self._clock.current(), enclosing_module(self._module_names))

    def _module_names(self) -> Dict[int, str]:
        if self._module_name_cache is None:
            self._module_name_cache = {id(module): name for name, module in self._named_modules()}
        return self._module_name_cache

    def _write_probes(self, step: int, bad: List[Dict[str, Any]]) -> None:
        record = self._writer.record(RecordKind.PROBE, step, [], {
            "probes": bad[:MAX_PROBES], "probes_total": len(bad), "local_nonfinite": True})
        first = bad[0]
        logger.error("%s: gradnan.check(%r) found %d NaN and %d Inf in %s on %s; record: %s", when(record),
                     first["label"], first["nan"], first["inf"], first["module"] or "code outside any module",
                     where(record), record.path)
