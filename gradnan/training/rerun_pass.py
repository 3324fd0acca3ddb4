"""What one pass of the in-place rerun saw, as pure functions over its frames and tensors: the micro-batch
each traced frame belongs to, the model's buffers kept and put back, the failing micro-batch's tensors, the
first non-finite element of a call's outputs, the pass's candidate origin and growth, a tensor-parallel
reduction's finding, and the replica's observations (``observation``) from its group's all-reduced facts.
``rerun.StepRerun`` runs the passes and records what they saw.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..events import MegatronRerun, ModuleHooks
from ..formats.incident import Conclusion
from ..formats.magnitude import Growth
from ..formats.observed import ReplicaObservation, Seen
from ..formats.schema import json_float
from .frames import Frame, first_growth, first_nonfinite, forward_origin

NONE = math.inf  # "no such micro-batch / call" in a MIN all-reduce


class MicroBatchCounter:
    """Forward pre-hooks on the model chunks (through ``hooks``): which micro-batch the frames being traced
    belong to (a chunk is called once per micro-batch; frames between two chunk calls belong to the first)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], frames_so_far: Callable[[], int],
                 hooks: ModuleHooks) -> None:
        self._frames_so_far = frames_so_far
        self._calls = [0] * len(chunks)
        self.starts: List[Tuple[int, int]] = []  # (frame index, micro-batch) at each chunk call
        self.current = -1
        self._hooks = hooks
        for index, chunk in enumerate(chunks):
            hooks.before_forward(chunk, self._hook(index))

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.current = self._calls[index]
            self._calls[index] += 1
            self.starts.append((self._frames_so_far(), self.current))
        return hook

    def of_frame(self, call: int) -> Optional[int]:
        found = None
        for first_frame, micro_batch in self.starts:
            if first_frame > call:
                break
            found = micro_batch
        return found

    def remove(self) -> None:
        self._hooks.remove()


def buffers_of(chunks: Sequence[torch.nn.Module]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) for every module buffer: a forward may update one (running statistics). Through
    ``nn.Module``'s method: Megatron's DDP has a ``buffers`` attribute of its own (its gradient buffers)."""
    seen, kept = set(), []
    for chunk in chunks:
        for buffer in torch.nn.Module.buffers(chunk):
            if id(buffer) not in seen:
                seen.add(id(buffer))
                kept.append((buffer, buffer.detach().clone()))
    return kept


def restore_buffers(kept: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, copy in kept:
            buffer.copy_(copy)


def batch_tensors(item: Any, limit: int) -> Tuple[Dict[str, torch.Tensor], int]:
    """The tensors of one micro-batch as the data iterator gave it (dicts, lists and tuples walked), named
    by their path, copied to the CPU while within ``limit`` bytes in all; and the bytes left out."""
    found: Dict[str, torch.Tensor] = {}
    left_out = 0

    def walk(name: str, value: Any) -> None:
        nonlocal left_out, limit
        if isinstance(value, torch.Tensor):
            size = value.numel() * value.element_size()
            if size <= limit:
                found[name or "batch"] = value.detach().to("cpu", copy=True)
                limit -= size
            else:
                left_out += size
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{name}.{key}" if name else str(key), item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{name}[{index}]", item)

    walk("", item)
    return found, left_out


def first_nonfinite_element(outputs: Sequence[torch.Tensor]) -> Optional[Dict[str, Any]]:
    """The first non-finite element of a module call's outputs (which output, its shape, the element's index
    in it): where in the sequence the value went non-finite, for ``gradnan batch`` to map onto the
    micro-batch's samples and tokens. One device read, at the incident only."""
    for position, tensor in enumerate(outputs):
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        flat = torch.nonzero(~torch.isfinite(tensor.reshape(-1)))[:1].tolist()
        if flat:
            index = [int(i) for i in torch.unravel_index(torch.tensor(flat[0][0]), tensor.shape)]
            return {"output": position, "shape": list(tensor.shape), "index": index}
    return None


@torch.no_grad()
def largest_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's largest magnitude, left on the device: non-finite exactly where the tensor holds a NaN
    or an Inf (0 for an empty one). One kernel."""
    if not tensor.numel():
        return torch.zeros((), dtype=tensor.dtype, device=tensor.device)
    return torch.linalg.vector_norm(tensor, math.inf)


class PassResult:
    """What one rank saw in the traced pass: its frames, where its first non-finite value was, the
    candidate origin (a call whose inputs were finite and outputs not) and the call where a value first
    grew out of line (at or before the first non-finite one)."""

    def __init__(self, frames: List[Frame], micro_batch_of: Callable[[int], Optional[int]],
                 losses: Tuple[Optional[bool], Optional[int]] = (None, None),
                 reductions: Sequence[Tuple[int, bool, bool]] = (),
                 received: Sequence[Tuple[int, bool]] = ()) -> None:
        self.frames = frames
        self.loss_finite, self.loss_micro_batch = losses
        self.reductions = reductions  # (the call it is in, partial sum finite, reduced value finite)
        self.received = received  # activations from the previous stage: (the next call, finite)
        index = first_nonfinite(frames)
        self.first = frames[index] if index is not None else None
        self.candidate = forward_origin(frames)
        self.grown = first_growth(frames)
        self.micro_batch_of = micro_batch_of

    @property
    def grown_frame(self) -> Optional[Frame]:
        return None if self.grown is None else self.grown[0]

    def grew_in(self) -> Optional[Dict[str, Any]]:
        """Where a value first grew out of line on this rank, as the ``rerun`` record's ``grew_in``."""
        if self.grown is None:
            return None
        frame, growth = self.grown
        return grew_in_json(frame, growth, self.micro_batch_of(frame.call))

    @staticmethod
    def key(frame: Optional[Frame]) -> float:
        """Position of a call in the step, comparable across tensor-parallel ranks, which make the same
        calls in the same order."""
        return NONE if frame is None else float(frame.call)

    def micro_batch(self) -> Optional[int]:
        frame = self.candidate or self.first
        return None if frame is None else self.micro_batch_of(frame.call)

    def received_before(self, frame: Optional[Frame]) -> bool:
        """Whether an activation this stage received from the previous pipeline stage before ``frame``'s
        call was non-finite: the model reads it through ``set_input_tensor``, no call's argument shows it."""
        return frame is not None and any(not finite and at <= frame.call for at, finite in self.received)

    def reduction_in(self, call: float) -> Tuple[float, float]:
        """In call ``call``'s tensor-parallel reduction (the first whose result is non-finite, else the
        first): (1 its partial sum here was non-finite, else 0; 1 its result was, else 0); (0, 0) without
        one."""
        inside = [(partial, reduced) for at, partial, reduced in self.reductions if at == call]
        partial, reduced = next((found for found in inside if not found[1]),
                                inside[0] if inside else (True, True))
        return float(not partial), float(not reduced)


def grew_in_json(frame: Frame, growth: Growth, micro_batch: Optional[int]) -> Dict[str, Any]:
    """The call where a value first grew out of line, as records and bundle manifests write it."""
    return {"module": frame.module, "class": frame.cls, "call": frame.call, "micro_batch": micro_batch,
            **growth.to_json()}


def reduction_finding(partial_bad: float, any_partial_bad: float, any_reduced_bad: float) -> Optional[str]:
    """How the earliest non-finite call's tensor-parallel reduction stood on this rank (the values
    all-reduced over the tensor-parallel group): "partial" (this rank's partial sum was non-finite: it made
    it), "received" (another rank's was: it came through the reduction), "collective" (every partial sum
    finite, the reduced value not: the reduction made it); None where that call reduced nothing
    non-finite."""
    if not any_reduced_bad:
        return None
    if partial_bad:
        return "partial"
    return "received" if any_partial_bad else "collective"


def largest(values: Sequence[float]) -> Any:
    """The largest of the values as a record writes it (NaN wins: it is what went wrong); None if none."""
    if not values:
        return None
    return json_float(math.nan if any(math.isnan(v) for v in values) else max(values))


def seen_state(state: float) -> Seen:
    """A state, 1 non-finite, 0 finite, -1 seen nowhere (all-reduced with max: on no rank)."""
    return Seen.NONFINITE if state > 0 else Seen.FINITE if state == 0 else Seen.UNSEEN


def observation(reproduced: float, loss: float, own_gradients: float, overflow: float, nonfinite: float,
                loss_again: float, megatron: Optional[MegatronRerun]) -> ReplicaObservation:
    """The replica's observations from its model-parallel group's all-reduced (max) facts: each state 1
    non-finite, 0 finite, -1 seen nowhere (``own_gradients``: unchecked)."""
    return ReplicaObservation(bool(reproduced), seen_state(loss), seen_state(loss_again),
                              seen_state(own_gradients), norm_overflowed(overflow, nonfinite),
                              None if megatron is None else Conclusion(megatron.job))


def norm_overflowed(overflow: float, nonfinite: float) -> bool:
    """From the model-parallel group's all-reduced (max) facts, at the norm or before the data-parallel
    collective (where Megatron's own bucket check stopped the step before any norm): a rank's gradients
    overflowed the float32 norm ("overflow") and no rank held a non-finite gradient ("nonfinite")."""
    return overflow > 0 and not nonfinite > 0
