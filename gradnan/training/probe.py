"""``gradnan.check(tensor, "label")``: an in-code probe for computations between modules (Hugging Face's
``detect_overflow``), without its host syncs.

Each call leaves its counts (NaN, Inf, abs-min, abs-max) on the device; the runtime reads all of a step's
probes at once at the end of the step and records the non-finite ones with the enclosing module's global
name. Without an installation a probe costs one function call, so probes can stay in the code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Dict, List, Optional

import torch

from ..formats.schema import json_float
from .frames import in_backward, read_pairs


@dataclass
class _Pending:
    label: str
    step: int
    module: Optional[str]
    recompute: bool
    shape: List[int]
    dtype: str
    first_pair: int  # (nan, inf) then (abs_min, abs_max) in the pending list


class Probes:
    """The probes of the step in progress, their statistics still on the device."""

    def __init__(self) -> None:
        self._pending: List[_Pending] = []
        self._stats: List[torch.Tensor] = []

    def add(self, tensor: Any, label: str, step: int, module: Optional[str]) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gradnan.check({label!r}) needs a tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return
        value = tensor.detach()
        low, high = torch.aminmax(value.abs())
        self._pending.append(_Pending(label, step, module, in_backward(),
                                      list(value.shape), str(value.dtype), len(self._stats) // 2))
        self._stats += [torch.isnan(value).sum(), torch.isinf(value).sum(), low, high]

    def read(self) -> List[Dict[str, Any]]:
        """The step's probes that saw a non-finite value, in call order (one host read); then empty."""
        pending, stats = self._pending, self._stats
        self._pending, self._stats = [], []
        if not pending:
            return []
        pairs = read_pairs(stats)
        bad = []
        for probe in pending:
            (nan, inf), (low, high) = pairs[probe.first_pair], pairs[probe.first_pair + 1]
            if nan or inf:
                bad.append({"label": probe.label, "module": probe.module, "step": probe.step,
                            "recompute": probe.recompute, "nan": int(nan), "inf": int(inf),
                            "abs_min": json_float(low), "abs_max": json_float(high), "shape": probe.shape,
                            "dtype": probe.dtype})
        return bad


def enclosing_module(names: Callable[[], Dict[int, str]]) -> Optional[str]:
    """The global name of the innermost model module whose method is on the call stack: the caller of
    ``check`` runs inside it. ``names()``: module id -> global name. Walks Python frames, so it costs
    nothing until a probe is called."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            name = names().get(id(owner))
            if name is not None:
                return name
        frame = frame.f_back
    return None
