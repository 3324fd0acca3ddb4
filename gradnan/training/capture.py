"""Which modules are captured when, so that a failure can be replayed offline (see ``gradnan.replay``).

The ``CaptureManager`` arms the capture of a module (``module_capture.ModuleCapture``: each call recorded
as an op trace, with its RNG state and the gradients that flowed back) at the modules and steps the
configuration names, or after a detection at the module where a value first went non-finite (found by a
``ForwardOriginFinder`` for a forward-pass incident), disarms it when the failure does not recur, and at
the end of the step (or at a detection) writes the chosen call as a bundle (``gradnan.bundle``). Nothing
is watched and nothing costs anything while no capture is armed. The capture modes are described in
``module_capture``.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import GradnanConfig
from ..events import ModelFacts, ModuleHooking, ModuleHooks, NamedModules
from ..formats.text import shell_word
from ..log import logger
from .clock import StepClock
from .error_guard import ErrorGuard
from .frames import FrameTracer, forward_origin
from .messages import when, where
from .module_capture import ModuleCall, ModuleCapture, bundle_contents
from .window import RecordingWindow
from .writer import Writer, Written

ARMED_STEPS = 20  # an armed capture whose failure does not recur stops watching after this many steps
FINDER_STEPS = 3  # the forward-origin finder checks every module call: a few steps at most


class ForwardOriginFinder:
    """For a few steps, traces every module call (``gradnan.frames``, one host read per step) and finds the
    first module (in the order forward calls finish, so the deepest first) whose weights and inputs are
    finite and whose outputs are not, keeping the frames before it as context. Armed only after a
    forward-pass incident."""

    def __init__(self, modules: List[Tuple[str, torch.nn.Module]], step_now: Callable[[], int],
                 hooks: ModuleHooks, max_frames: int = 21) -> None:
        self.tracer = FrameTracer(modules, step_now, lambda: True, hooks)
        self.max_frames = max_frames
        self.steps_left = FINDER_STEPS
        self.found: Optional[str] = None
        self.frames: List[Dict[str, Any]] = []

    def attach(self) -> "ForwardOriginFinder":
        self.tracer.attach()
        return self

    def detach(self) -> None:
        self.tracer.detach()

    def end_step(self) -> None:
        frames = self.tracer.read()
        self.steps_left -= 1
        origin = forward_origin(frames)
        if origin is not None:
            self.found = origin.module
            self.frames = [frame.to_json() for frame in frames[:frames.index(origin) + 1]][-self.max_frames:]


class CaptureManager:
    """Which modules are watched when, and when their calls become bundles (through ``writer``, while
    ``window`` records). ``named_modules()`` gives the model's modules by global name; ``facts`` says
    what the optimizer saw of a parameter's gradient and how a parameter is partitioned; ``hooking``
    whether modules may be hooked at all."""

    def __init__(self, config: GradnanConfig, clock: StepClock, window: RecordingWindow, writer: Writer,
                 guard: ErrorGuard, facts: ModelFacts, named_modules: Callable[[], NamedModules],
                 hooking: ModuleHooking) -> None:
        self.config, self._clock, self._window, self._writer = config, clock, window, writer
        self._guard, self._facts, self._named_modules, self._hooking = guard, facts, named_modules, hooking
        self.captures: Dict[str, ModuleCapture] = {}
        self.finder: Optional[ForwardOriginFinder] = None

    def write_call(self, step: int, capture: ModuleCapture, call: ModuleCall, context: Dict[str, Any],
                   observed: Optional[Dict[str, Any]] = None) -> Optional[Written]:
        """One bundle (its manifest with its ``path``); None when nothing more can be written (not recording,
        or a bound reached)."""
        if not self._window.recording():
            return None
        manifest, tensors = bundle_contents(capture, call, observed or {}, context, self._facts.param_facts)
        written = self._writer.bundle(step, capture.name, manifest, tensors)
        if written is not None:
            logger.warning("%s: captured %s on %s (%s); replay it: gradnan replay %s", when(written),
                           capture.name, where(written), context.get("trigger", capture.mode),
                           shell_word(written.path))
        return written

    def _selected(self) -> List[Tuple[str, torch.nn.Module]]:
        patterns = self.config.patterns("capture_modules")
        return [(name, module) for name, module in self._watchable()
                if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]

    def _watchable(self) -> List[Tuple[str, torch.nn.Module]]:
        """Named modules that ``modules`` / ``exclude_modules`` let capture watch."""
        return self.config.watched(self._named_modules())

    def _rank_selected(self) -> bool:
        ranks = self.config.ranges("capture_ranks")
        return not ranks or int(self._writer.coords()["global_rank"]) in ranks

    def arm(self, name: str, mode: str, confirm: Optional[Callable[[], bool]] = None) -> bool:
        if name in self.captures or self._hooking.new is None:
            return False
        module = dict(self._watchable()).get(name)
        if module is None:
            return False
        hooks = self._hooking.new()
        self.captures[name] = ModuleCapture(name, module, mode, self._guard, hooks, confirm).attach()
        return True

    def disarm(self, name: str) -> None:
        capture = self.captures.pop(name, None)
        if capture is not None:
            capture.detach()

    def arm_forward_origin(self) -> None:
        if self.finder is None and self._hooking.new is not None:
            self.finder = ForwardOriginFinder(self._watchable(), self._clock.current, self._hooking.new(),
                                              self.config.max_frames).attach()

    def start(self) -> None:
        """Optimizer built: retention begins; an explicit capture of the first step is armed."""
        if self.config.capture_modules and not self._selected():
            logger.warning("capture_modules %r matches no module of this model", self.config.capture_modules)
        if self._rank_selected() and self.config.capture_retain:
            for name, _ in self._selected():
                self.arm(name, "retain")
        self._arm_explicit(None)

    def _arm_explicit(self, step: Optional[int]) -> None:
        """Arm the explicit captures of ``step``. ``None``: the first step, whose number the step filters
        cannot know yet when the optimizer is built (Megatron-LM sets its iteration later, and a resumed
        run does not start at 1): armed now, confirmed at the module's first call."""
        steps = self.config.ranges("capture_steps")
        if not (steps and self._rank_selected()) or (step is not None and step not in steps):
            return
        confirm = (lambda: self._clock.filter_step() in steps) if step is None else None
        for name, _ in self._selected():
            self.arm(name, "always", confirm)

    def end_step(self, step: int, next_step: int) -> None:
        """``step``: the step that ended, as records name it; ``next_step``: the next one as the step
        filters (``capture_steps``) see it."""
        for name, capture in list(self.captures.items()):
            if capture.mode == "retain":
                capture.end_step()
                continue
            call = capture.chosen_call()
            if call is not None:
                self.write_call(step, capture, call, {"trigger": capture.mode, **capture.context})
            if call is not None or capture.mode == "always":
                self.disarm(name)
                continue
            capture.end_step()
            if capture.steps_watched >= ARMED_STEPS:
                logger.info("capture of %s disarmed: no non-finite value in %d steps", name, ARMED_STEPS)
                self.disarm(name)
        if self.finder is not None:
            self.finder.end_step()
            if self.finder.found is not None and self.arm(self.finder.found, "incident"):
                self.captures[self.finder.found].context = {"forward_origin": self.finder.found,
                                                            "frames": self.finder.frames}
            if self.finder.found is not None or self.finder.steps_left <= 0:
                self.finder.detach()
                self.finder = None
        self._arm_explicit(next_step)

    def on_detection(self, step: int, forward_pattern: bool, first_param: Optional[str], arm: bool) -> None:
        """A detection on this rank: write what retention kept, then (``arm``) watch for the next
        occurrence."""
        for capture in list(self.captures.values()):
            if capture.mode == "retain" and capture.calls:
                params = dict(capture.module.named_parameters())
                observed = {name: self._facts.observed_grad(param) for name, param in params.items()}
                if self.write_call(step, capture, capture.calls[-1], {"trigger": "retain"}, observed) is None:
                    self.disarm(capture.name)  # nothing more can be written: stop tracing every step
        if not (arm and self.config.capture):
            return
        if forward_pattern:
            self.arm_forward_origin()
        elif first_param and "." in first_param:
            self.arm(first_param.rsplit(".", 1)[0], "incident")

    def close(self) -> None:
        for name in list(self.captures):
            self.disarm(name)
        if self.finder is not None:
            self.finder.detach()
            self.finder = None
