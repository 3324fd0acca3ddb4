"""Forward frames: the abs-min/abs-max of every watched module call's weights, inputs and outputs
(Hugging Face ``DebugUnderflowOverflow``'s frames), at one host read per step instead of several per tensor.

A forward hook on each watched module turns the call into a ``Frame``: the names of its entries
(``weight``, ``input[0]``, ``kwargs.attention_mask``, ``output[0]``, ...) on the host, and for each
floating-point entry its smallest and largest magnitude left on the device (two ``torch._foreach_norm``
calls per call and dtype, however many entries). ``FrameTracer.read()`` stacks the step's statistics and
copies them to the host once; only then are frames turned into JSON.

Weights change only at the optimizer step, so a module's weights are measured once per step however
often it is called; a tensor seen again unchanged (a parent's input is its first child's, an identity
module's output is its input, a bias is returned as an output) is not measured twice. A call made
during backward (activation recompute) measures nothing: the frame of the same module's forward gets
``recomputed`` counted instead, so frames are never doubled. A frame without any tensor is not kept.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..events import ModuleHooks
from ..formats.magnitude import Growth, entries_growth
from ..formats.schema import json_float
from .scan import SCANNED_DTYPES


@dataclass
class Frame:
    """One forward call of one module. ``stats[i]`` indexes the step's statistics (None: not measured,
    e.g. an integer mask); ``values`` holds them once read."""

    step: int
    module: str
    cls: str
    call: int
    names: List[str]
    kinds: List[str]
    dtypes: List[str]
    stats: List[Optional[int]]
    recomputed: int = 0
    values: List[Optional[Tuple[float, float]]] = field(default_factory=list)

    @property
    def nonfinite(self) -> bool:
        return any(v is not None and not all(map(math.isfinite, v)) for v in self.values)

    def nonfinite_in(self, kind: str) -> bool:
        """Whether any entry of this kind ("weight", "input", "output") is non-finite."""
        return any(v is not None and not all(map(math.isfinite, v))
                   for k, v in zip(self.kinds, self.values) if k == kind)

    def growth(self) -> Optional[Growth]:
        """Whether this call's output grew out of line over its inputs and weights
        (``gradnan.formats.magnitude``)."""
        return entries_growth((kind, dtype, None if value is None else value[1])
                              for kind, dtype, value in zip(self.kinds, self.dtypes, self.values))

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "module": self.module, "class": self.cls, "call": self.call,
                "recomputed": self.recomputed,
                "entries": [{"name": name, "kind": kind, "dtype": dtype,
                             "abs_min": None if v is None else json_float(v[0]),
                             "abs_max": None if v is None else json_float(v[1])}
                            for name, kind, dtype, v in zip(self.names, self.kinds, self.dtypes,
                                                            self.values)]}


def named_entries(args: Sequence[Any], kwargs: Dict[str, Any], outputs: Any) -> List[Tuple[str, str, Any]]:
    """(name, kind, tensor) for the tensors of a call, named as DebugUnderflowOverflow names them
    (``input[i]``, ``output``, ``output[i][j]``), plus ``kwargs.<name>``; nested lists, tuples and dicts
    are walked."""
    entries: List[Tuple[str, str, Any]] = []

    def walk(name: str, kind: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            entries.append((name, kind, value))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{name}[{index}]", kind, item)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{name}.{key}", kind, item)

    for index, value in enumerate(args):
        walk(f"input[{index}]", "input", value)
    for key, value in kwargs.items():
        walk(f"kwargs.{key}", "input", value)
    walk("output", "output", outputs)
    return entries


def measurable(tensor: torch.Tensor) -> bool:
    """A dense, non-empty tensor of a float dtype whose magnitudes ``torch._foreach_norm`` reads (not a
    sparse or float8 one)."""
    return tensor.dtype in SCANNED_DTYPES and tensor.layout == torch.strided and tensor.numel() > 0


def in_backward() -> bool:
    """Whether this code runs inside the backward pass: a forward call there is activation recompute."""
    return torch._C._current_autograd_node() is not None


MAX_PENDING = 1 << 16  # statistics kept on the device before an early read (long forward-only phases)


class FrameTracer:
    """Forward hooks on the given modules (through ``hooks``), collecting frames while ``active()`` says so.

    ``step_now()`` names the step a forward belongs to and ``active()`` says whether it is traced (both
    asked once per step, at its first frame). Statistics stay on the device until ``read()`` (or until
    ``MAX_PENDING`` of them wait: evaluation between two optimizer steps runs forwards only); frames
    are pure host data after it."""

    def __init__(self, modules: Sequence[Tuple[str, torch.nn.Module]], step_now: Callable[[], int],
                 active: Callable[[], bool], hooks: ModuleHooks) -> None:
        self._modules = list(modules)
        self._step_now, self._active, self._hooks = step_now, active, hooks
        self._reset()

    def _reset(self) -> None:
        self._step: Optional[int] = None
        self._on = False
        self._pending: List[torch.Tensor] = []
        self._values: List[Tuple[float, float]] = []
        self._frames: List[Frame] = []
        self._seen: Dict[int, Tuple[Any, int, int]] = {}
        self._last_frame: Dict[str, Frame] = {}

    def attach(self) -> "FrameTracer":
        for name, module in self._modules:
            self._hooks.after_forward(module, self._hook(name))
        return self

    def detach(self) -> None:
        self._hooks.remove()
        self._reset()

    def frame_count(self) -> int:
        """Frames taken since the last read."""
        return len(self._frames)

    @torch.no_grad()
    def _measure(self, tensors: Sequence[Any]) -> List[Optional[int]]:
        """The index of each tensor's (abs-min, abs-max) in this step's statistics (None: not measurable),
        measuring those that were not measured yet this step as this very tensor, unchanged since (same
        version): by dtype and device, two ``torch._foreach_norm`` calls (-inf and inf) for them all."""
        indices: List[Optional[int]] = [None] * len(tensors)
        fresh: Dict[int, List[int]] = {}  # id of a tensor to measure -> its places in ``tensors``
        for place, tensor in enumerate(tensors):
            if not measurable(tensor):
                continue
            seen = self._seen.get(id(tensor))
            if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
                indices[place] = seen[2]
            else:
                fresh.setdefault(id(tensor), []).append(place)
        groups: Dict[tuple, List[torch.Tensor]] = {}
        for places in fresh.values():
            tensor = tensors[places[0]]
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        for group in groups.values():
            lows, highs = torch._foreach_norm(group, -math.inf), torch._foreach_norm(group, math.inf)
            for tensor, low, high in zip(group, lows, highs):
                self._pending += [low, high]
                index = len(self._values) + len(self._pending) // 2 - 1
                self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, index)
                for place in fresh[id(tensor)]:
                    indices[place] = index
        if len(self._pending) >= MAX_PENDING:
            self._values += read_pairs(self._pending)
            self._pending = []
        return indices

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, outputs: Any) -> None:
            if self._step is None:
                self._step = self._step_now()
                self._on = self._active()
            if not self._on:
                return
            if in_backward():
                previous = self._last_frame.get(name)
                if previous is not None:
                    previous.recomputed += 1
                return
            weights = list(module.named_parameters(recurse=False))
            entries = named_entries(args, kwargs, outputs)
            if not weights and not entries:
                return
            frame = Frame(step=self._step, module=name, cls=type(module).__qualname__, call=len(self._frames),
                          names=[w[0] for w in weights] + [e[0] for e in entries],
                          kinds=["weight"] * len(weights) + [e[1] for e in entries],
                          dtypes=[str(w[1].dtype) for w in weights] + [str(e[2].dtype) for e in entries],
                          stats=self._measure([w[1] for w in weights] + [e[2] for e in entries]))
            self._frames.append(frame)
            self._last_frame[name] = frame
        return hook

    def read(self) -> List[Frame]:
        """The step's frames with their values (one host read), and the tracer ready for the next step."""
        frames, values, pending = self._frames, self._values, self._pending
        self._reset()
        if not frames:
            return []
        values = values + read_pairs(pending)
        for frame in frames:
            frame.values = [None if index is None else values[index] for index in frame.stats]
        return frames


def read_pairs(flat: List[torch.Tensor]) -> List[Tuple[float, float]]:
    """[low0, high0, low1, high1, ...] 0-d tensors -> [(low0, high0), ...]: one stack per dtype, one cast
    and one copy to the host per device."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for position, tensor in enumerate(flat):
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    by_device: Dict[torch.device, List[Tuple[List[int], torch.Tensor]]] = {}
    for (device, _), positions in groups.items():
        by_device.setdefault(device, []).append((positions,
                                                 torch.stack([flat[p] for p in positions]).double()))
    numbers: List[float] = [0.0] * len(flat)
    for parts in by_device.values():
        host = torch.cat([stacked for _, stacked in parts]).cpu().tolist()
        for position, number in zip((p for positions, _ in parts for p in positions), host):
            numbers[position] = number
    return list(zip(numbers[0::2], numbers[1::2]))


def first_nonfinite(frames: Sequence[Frame]) -> Optional[int]:
    """Index of the first frame (in the order calls finished) with a non-finite weight, input or output."""
    return next((index for index, frame in enumerate(frames) if frame.nonfinite), None)


def forward_origin(frames: Sequence[Frame]) -> Optional[Frame]:
    """Where a forward value first went non-finite: the first call (deeper modules finish first, so the
    smallest such module) whose inputs are finite and outputs are not, preferring one whose weights are
    finite too (its own computation overflowed); else the first whose weights already are non-finite
    (a non-finite update was applied to them)."""
    produced = [frame for frame in frames if frame.nonfinite_in("output") and not frame.nonfinite_in("input")]
    return next((frame for frame in produced if not frame.nonfinite_in("weight")),
                produced[0] if produced else None)


def first_growth(frames: Sequence[Frame]) -> Optional[Tuple[Frame, Growth]]:
    """Where a value first grew out of line (``gradnan.formats.magnitude``): the first call, in the order
    calls finished, at or before the first non-finite one, whose output grew out of line over its inputs
    and weights. Deeper modules finish first, so of a module and its parent both growing, the module is
    named. Calls after the first non-finite one are not judged: what they grow is the aftermath."""
    bad = first_nonfinite(frames)
    for frame in frames if bad is None else frames[:bad + 1]:
        growth = frame.growth()
        if growth is not None:
            return frame, growth
    return None


class FrameBuffer:
    """Detection mode's ring: the last ``max_frames`` frames across steps, host values only."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.frames: List[Frame] = []

    def add(self, frames: Sequence[Frame]) -> Optional[List[Frame]]:
        """Add a step's frames; if one is non-finite, return the last ``max_frames`` frames ending at it."""
        bad = first_nonfinite(frames)
        upto = list(frames) if bad is None else list(frames[:bad + 1])
        self.frames = (self.frames + upto)[-self.max_frames:]
        return None if bad is None else list(self.frames)
