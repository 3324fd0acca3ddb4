"""Seed every random number generator a Megatron training step draws from, so a captured step replays exactly.

The equivalent of msprobe's ``seed_all``: call it on every rank, after ``initialize_model_parallel`` and
before building the model, with the same seed as the run being replayed.
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict

import torch

from ..errors import ConfigError
from ..patches.model import seed_rng_tracker

_SEED_LIMIT = 2**32  # NumPy's legacy seeding rejects anything larger
_CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS needs a fixed workspace to pick the same kernels every call


def _check(seed: Any, deterministic: Any) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _SEED_LIMIT:
        raise ConfigError(f"seed_all: seed must be an int in [0, 2**32), got {seed!r}")
    if not isinstance(deterministic, bool):
        raise ConfigError(f"seed_all: deterministic must be a bool, got {deterministic!r}")


def _seed_numpy(seed: int) -> bool:
    try:
        import numpy
    except ImportError:
        return False
    numpy.random.seed(seed)
    return True


def _make_deterministic() -> None:
    """Make torch pick deterministic kernels (raising on ops that have none) and cuDNN stop autotuning.

    NCCL's reduction order (``NCCL_ALGO``, ...) is left alone: NCCL reads it when a communicator is created,
    so it belongs to the launcher's environment, not to a call made inside the running job."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_all(seed: int = 1234, deterministic: bool = False) -> Dict[str, Any]:
    """Seed Python's ``random``, NumPy (when installed), torch (CPU and every CUDA device) and, when
    Megatron's model parallel state is initialized, its model-parallel RNG tracker; return what was seeded.

    ``PYTHONHASHSEED`` is set for the processes started from here on (this interpreter's hash seed was fixed
    at its start). ``deterministic=True`` also turns on deterministic algorithms (see
    ``_make_deterministic``); ``False`` leaves those settings as they are. Raises ``ConfigError`` on a bad
    argument.
    """
    _check(seed, deterministic)
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    numpy_seeded = _seed_numpy(seed)
    torch.manual_seed(seed)
    megatron_skipped = seed_rng_tracker(seed)
    if deterministic:
        _make_deterministic()
    return {
        "seed": seed,
        "python": True,
        "numpy": numpy_seeded,
        "torch": True,
        "megatron_tracker": megatron_skipped is None,
        "megatron_skipped": megatron_skipped,
        "deterministic": deterministic,
    }
