"""gradnan: find the rank, parameter and module behind a NaN/Inf grad norm in Megatron training.

    import gradnan
    gradnan.install(out_dir="gradnan_out")   # before the optimizer is built
"""

from .config import ConfigError, GradnanConfig
from .install import Installation, current, install, uninstall
from .runtime import NonFiniteGradientError

__version__ = "0.1.0"

__all__ = ["ConfigError", "GradnanConfig", "Installation", "NonFiniteGradientError", "current", "install",
           "uninstall", "__version__"]
