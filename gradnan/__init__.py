"""gradnan: find the rank, parameter and module behind a NaN/Inf grad norm in Megatron training.

    import gradnan
    gradnan.install(out_dir="gradnan_out")   # before the optimizer is built

The package is layered around its one contract, the files on disk (docs/how-it-works.md):
``gradnan.training`` (``install()``) and ``gradnan.patches`` (the Megatron patch layer) write them,
``gradnan.formats`` defines them, ``gradnan.offline`` reads them (report, frames, replay, plot),
``gradnan.selftest`` checks a suspect device, ``gradnan.testing`` is the tiny real Megatron job the demo
and the tests run.

The training-time names (``install``, ``seed_all``, ...) are loaded on first use (PEP 562): the offline
commands (``gradnan report | maps | frames``) import neither torch nor megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import GradnanConfig
from .config.values import FramesMode, OnNonfinite, PreReduction, RerunMode
from .errors import (
    AbortRequested,
    ConfigError,
    GradnanError,
    InputError,
    InternalError,
    NonFiniteGradientError,
    UsageError,
)

__version__ = "0.1.0"

_TRAINING_NAMES = {"Installation": ".training.install", "check": ".training.install",
                   "current": ".training.install", "install": ".training.install",
                   "uninstall": ".training.install", "seed_all": ".training.seed"}

__all__ = ["AbortRequested", "ConfigError", "FramesMode", "GradnanConfig", "GradnanError", "InputError",
           "Installation", "InternalError", "NonFiniteGradientError", "OnNonfinite", "PreReduction",
           "RerunMode", "UsageError", "check", "current", "install", "seed_all", "uninstall", "__version__"]


def __getattr__(name: str) -> Any:
    """``gradnan.install`` and the other training-time names, imported (with torch) when first used."""
    if name not in _TRAINING_NAMES:
        raise AttributeError(f"module 'gradnan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_TRAINING_NAMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
