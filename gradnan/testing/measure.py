"""Measuring instruments for the tests and benchmarks: host syncs and peak extra memory of a piece of code.

- ``HostSyncCounter``: counts the tensor calls that make the host wait for the device (``item``,
  ``tolist``, ``bool``/``float``/``int`` conversion, ``numpy``). On CPU nothing waits, but the count is
  the same as on a GPU, which is what matters.
- ``CudaSyncCounter``: on a GPU, every synchronization the CUDA runtime reports
  (``torch.cuda.set_sync_debug_mode``), whoever made it: device-to-host copies, ``nonzero``, blocking
  host-to-device copies, stream synchronizations.
- ``PeakMemory``: the largest number of bytes the code had allocated beyond what existed before. On
  CUDA the allocator's peak; on CPU the fresh tensors produced by the code's operators (a
  ``TorchDispatchMode``), freed when their tensors die (allocations inside one kernel are not seen).
- ``OperatorCounter``: the operators the code dispatches below autograd (forward, backward and the kit's
  own), each as many times as it runs: on a GPU each is a kernel launch or a view, so the count is what a
  piece of code costs in launches, the same on any machine.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..patches.undo_log import Patcher

_SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


class HostSyncCounter:
    """Counts host-syncing calls on ``torch.Tensor`` while active, from any thread or hook (it wraps the
    methods themselves: a ``TorchFunctionMode`` would miss calls made inside autograd hooks)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._patcher = Patcher()
        self._depth = threading.local()  # shared by all the wrapped methods: nested calls count once

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostSyncCounter":
        for name in _SYNCING:
            self._patcher.wrap(torch.Tensor, name, self._counting(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patcher.undo()

    def _counting(self, name: str):
        counts, local = self.counts, self._depth

        def make(original):
            def counted(*args, **kwargs):
                depth = getattr(local, "depth", 0)
                if depth == 0:  # one sync, even where one of these methods calls another
                    counts[name] += 1
                local.depth = depth + 1
                try:
                    return original(*args, **kwargs)
                finally:
                    local.depth = depth

            return counted

        return make


class CudaSyncCounter:
    """Counts the synchronizations PyTorch's CUDA runtime reports while active: its sync debug mode set to
    warn, every warning recorded (the autograd engine's device threads hand theirs back to the caller)."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self) -> None:
        self.total = 0
        self._records: Any = None
        self._catch: Any = None
        self._mode = 0

    def __enter__(self) -> "CudaSyncCounter":
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
        self.total = sum(self.MESSAGE in str(record.message) for record in self._records)


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._release, nbytes)
        return out


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self._mode: Any = None
        self._baseline = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveBytes()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
        else:
            self._mode.__exit__(*exc)
            self.bytes = self._mode.peak


class OperatorCounter(TorchDispatchMode):
    """``with OperatorCounter() as ops: ...`` then ``ops.total``; ``ops.by_phase``: the count under each
    label of ``phase(label)`` (the innermost one; ``"other"`` outside any), so a benchmark can say where the
    operators go. Sees every operator below autograd, the backward's included (its engine runs the mode
    on the calling thread on CPU, and hands it to its device threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_phase: Counter = Counter()
        self._phases = ["other"]

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())

    def phase(self, label: str):
        """Wrap a function so that the operators it dispatches count under ``label``."""
        phases = self._phases

        def wrap(original):
            def labelled(*args, **kwargs):
                phases.append(label)
                try:
                    return original(*args, **kwargs)
                finally:
                    phases.pop()

            return labelled

        return wrap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_phase[self._phases[-1]] += 1
        return func(*args, **(kwargs or {}))
