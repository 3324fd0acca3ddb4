"""Run real megatron-core on a CPU-only torch (demo, tests and benchmarks; never used by ``install()``).

megatron-core is wired to CUDA: ``device='cuda'`` factories, ``torch.cuda.*`` RNG calls, ``.cuda()`` and
``param.type() == 'torch.cuda.FloatTensor'`` checks. The shim sends every such device to the CPU through a
``TorchFunctionMode`` (per thread, pushed for the life of the process) and replaces the few ``torch.cuda``
functions Megatron calls with CPU equivalents. Everything it changes is undone by ``deactivate()``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..patches.undo_log import Patcher


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_if_cuda(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuStream:
    """The one stream of a CPU: work is done in order, so every wait and record is already satisfied.
    Constructed in place of ``torch.cuda.Stream`` too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any) -> None:
        return None

    def wait_stream(self, *args: Any) -> None:
        return None

    def wait_event(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


def _cpu_stream_context(stream: Any = None) -> contextlib.nullcontext:
    return contextlib.nullcontext(stream)


class CpuShim:
    """Activate once per process before building Megatron models; ``deactivate()`` undoes it."""

    def __init__(self) -> None:
        self._patcher = Patcher()
        self._mode: Optional[_CudaToCpuMode] = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def activate(self) -> "CpuShim":
        if self.active:
            return self
        from megatron.core.tensor_parallel import random as megatron_random

        for name, replacement in (
            ("current_device", lambda: 0),
            ("synchronize", _no_op),
            ("current_stream", lambda device=None: _CPU_STREAM),  # core 0.19+ start_grad_sync
            ("stream", _cpu_stream_context),
            ("Stream", _CpuStream),
            ("get_rng_state", _cpu_rng_state),
            ("set_rng_state", _set_cpu_rng_state),
            ("manual_seed", _cpu_manual_seed),
            ("manual_seed_all", _cpu_manual_seed),
        ):
            self._patcher.set(torch.cuda, name, replacement)
        self._patcher.set(megatron_random, "_get_cuda_rng_state", _cpu_rng_state)
        self._patcher.set(megatron_random, "_set_cuda_rng_state", _set_cpu_rng_state)
        self._skip_empty_fp8_quantization()
        self._router_without_transformer_engine()
        self._in_custom_backward()
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()
        return self

    def _skip_empty_fp8_quantization(self) -> None:
        """megatron-core 0.12's distributed optimizer calls ``quantize_param_shard`` even with no FP8
        parameters, and without Transformer Engine that raises; with none to quantize it has no work."""
        from megatron.core.optimizer import distrib_optimizer

        original = getattr(distrib_optimizer, "quantize_param_shard", None)
        if original is None:
            return

        def quantize_param_shard(model_params, *args, **kwargs):
            if len(model_params):
                return original(model_params, *args, **kwargs)
            return None

        self._patcher.set(distrib_optimizer, "quantize_param_shard", quantize_param_shard)

    def _in_custom_backward(self) -> None:
        """Torch-function modes are off while autograd runs a custom ``Function.backward`` (Megatron's
        collectives allocate there with ``device=torch.cuda.current_device()``): enter the mode again."""
        from torch.autograd import function

        def make(original):
            def apply(ctx: Any, *args: Any) -> Any:
                with _CudaToCpuMode():
                    return original(ctx, *args)

            return apply

        self._patcher.wrap(function.BackwardCFunction, "apply", make)

    def _router_without_transformer_engine(self) -> None:
        """The MoE router's gating (core 0.16) tests ``te_general_gemm is not None``, a name only bound when
        Transformer Engine imports; without it the test raises NameError. None selects the torch path."""
        try:
            from megatron.core.transformer.moe import moe_utils
        except ImportError:
            return
        if not hasattr(moe_utils, "te_general_gemm"):
            self._patcher.set(moe_utils, "te_general_gemm", None)

    def deactivate(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._patcher.undo()


SHIM = CpuShim()
