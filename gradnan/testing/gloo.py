"""Several real ``torch.distributed`` gloo processes on this machine, each running real megatron-core
through the CPU shim: the one way the toy job, the tests' hand-written loops and the benchmarks start."""

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
def gloo_process(rank: int, world_size: int, port: int, quiet: bool = True) -> Iterator[None]:
    """Inside a spawned process: launcher variables as torchrun sets them, one intra-op thread, the CPU
    shim, a gloo process group for the block; the group is destroyed after it."""
    from .cpu_shim import SHIM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if quiet:
        warnings.filterwarnings("ignore")
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
