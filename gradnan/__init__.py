"""gradnan: find the rank, parameter and module behind a NaN/Inf grad norm in Megatron training.

    import gradnan
    gradnan.install(out_dir="gradnan_out")   # before the optimizer is built

The package is layered around its one contract, the files on disk (docs/how-it-works.md):
``gradnan.training`` (``install()`` and the Megatron adapter) writes them, ``gradnan.formats`` defines
them, ``gradnan.offline`` reads them (report, frames, replay, plot), ``gradnan.selftest`` checks a
suspect device, ``gradnan.testing`` is the tiny real Megatron job the demo and the tests run.
"""

from .config import FramesMode, GradnanConfig, OnNonfinite, PreReduction, RerunMode
from .errors import (
    AbortRequested,
    ConfigError,
    GradnanError,
    InputError,
    InternalError,
    NonFiniteGradientError,
    UsageError,
)
from .training.install import Installation, check, current, install, uninstall
from .training.seed import seed_all

__version__ = "0.1.0"

__all__ = ["AbortRequested", "ConfigError", "FramesMode", "GradnanConfig", "GradnanError", "InputError",
           "Installation", "InternalError", "NonFiniteGradientError", "OnNonfinite", "PreReduction", "RerunMode", "UsageError",
           "check", "current", "install", "seed_all", "uninstall", "__version__"]
