"""gradnan: find the rank, parameter and module behind a NaN/Inf grad norm in Megatron training.

    import gradnan
    gradnan.install(out_dir="gradnan_out")   # before the optimizer is built
"""

from .config import ConfigError, GradnanConfig
from .install import Installation, check, current, install, uninstall
from .runtime import AbortRequested, NonFiniteGradientError
from .seed import seed_all

__version__ = "0.1.0"

__all__ = ["AbortRequested", "ConfigError", "GradnanConfig", "Installation", "NonFiniteGradientError", "check",
           "current", "install", "seed_all", "uninstall", "__version__"]
