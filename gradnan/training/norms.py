"""Grad norms that Megatron returns as device tensors, checked without making the host wait for the device.

From megatron-core 0.18, with Transformer Engine, ``get_grad_norm_fp32`` returns the norm as a one-element
CUDA tensor. Turning it into a Python number (``float``, ``.item()``) would wait for the device on every
healthy step. Instead the value is copied, non-blocking, into pinned host memory behind a CUDA event, and
read only once the event says the copy has landed: at the end of the step if the device is already there
(it usually is wherever the training loop reads anything back, as Megatron-LM's does every step), else at
the latest just before the gradients are zeroed for the next step, where gradnan waits for that one copy
because the evidence is about to be overwritten. A norm on the CPU is read at once.
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable, List, Optional, Tuple

import torch


class DeviceScalar:
    """The first element of a tensor, on its way to host memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        value = tensor.detach().reshape(-1)[:1].to(torch.float32)
        self._host = torch.empty(1, dtype=torch.float32, pin_memory=value.is_cuda)
        self._host.copy_(value, non_blocking=value.is_cuda)
        self._event: Optional[torch.cuda.Event] = None
        if value.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self._event is None or self._event.query()

    def read(self) -> float:
        """The value; waits for this one copy if it has not landed yet. The host buffer is read as memory,
        not through a tensor method, so no tensor call is made on the host copy."""
        if self._event is not None:
            self._event.synchronize()
        return ctypes.c_float.from_address(self._host.data_ptr()).value


class PendingNorms:
    """Norms given as tensors, waiting to be read, and the end-of-step work that must follow them."""

    def __init__(self) -> None:
        self._norms: List[Tuple[DeviceScalar, Callable[[float], None]]] = []
        self._then: List[Callable[[], None]] = []

    def add(self, norm: DeviceScalar, on_nonfinite: Callable[[float], None]) -> None:
        self._norms.append((norm, on_nonfinite))

    def then(self, finish: Callable[[], None]) -> None:
        """Run ``finish`` once every pending norm is read (at once if none is pending)."""
        self._then.append(finish)
        if not self._norms:
            self.settle(wait=False)

    def settle(self, wait: bool) -> bool:
        """Read the pending norms if their copies have landed (or ``wait``); call ``on_nonfinite`` for a bad
        one, then the deferred end-of-step work. False if something is still in flight."""
        if not wait and not all(norm.ready() for norm, _ in self._norms):
            return False
        norms, self._norms = self._norms, []
        finishes, self._then = self._then, []
        try:
            for norm, on_nonfinite in norms:
                value = norm.read()
                if not math.isfinite(value):
                    on_nonfinite(value)
        finally:
            for finish in finishes:
                finish()
        return True
