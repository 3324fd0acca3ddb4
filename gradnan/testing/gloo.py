"""Several real ``torch.distributed`` processes on this machine, each running real megatron-core: gloo through
the CPU shim (everywhere), or NCCL on one CUDA device per rank (on a GPU machine). The one way the toy job,
the tests' hand-written loops and the benchmarks start."""

from __future__ import annotations

import os
import socket
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for gloo's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def gloo_process(rank: int, world_size: int, port: int, quiet: bool = True,
                 device: str = "cpu") -> Iterator[None]:
    """Inside a spawned process: launcher variables as torchrun sets them, one intra-op thread, and for
    ``device="cpu"`` the CPU shim and a gloo process group, for ``"cuda"`` the rank's own GPU and an NCCL
    group (no shim: megatron-core as on a cluster). The group is destroyed after the block."""
    from .cpu_shim import SHIM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if quiet:
        warnings.filterwarnings("ignore")
    if device == "cuda":  # deterministic kernels, so that two runs of one job compare bitwise
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world_size)
    else:
        SHIM.activate()
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@contextmanager
def one_job() -> Iterator[None]:
    """One training job inside a gloo process: after it, gradnan is uninstalled and Megatron's parallel
    state destroyed, so the next job in the same process starts clean."""
    import gradnan
    from gradnan.patches.model import destroy_model_parallel

    try:
        yield
    finally:
        gradnan.uninstall()
        destroy_model_parallel()
