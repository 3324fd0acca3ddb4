"""Everything is in setup.cfg but ``install_requires``: megatron-core's floor comes from the one
declaration of the tested range, ``patches/supported.py`` (read as text: nothing is installed yet)."""

import ast
from pathlib import Path

from setuptools import setup


def tested_megatron_core() -> str:
    """``MEGATRON_CORE`` of patches/supported.py, e.g. ">=0.12,<0.21"."""
    tree = ast.parse((Path(__file__).parent / "patches" / "supported.py").read_text())
    assigned = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    return assigned["MEGATRON_CORE"]


def floor(specifiers: str) -> str:
    [lower] = [specifier.strip() for specifier in specifiers.split(",") if specifier.strip().startswith(">=")]
    return lower


setup(install_requires=["torch>=2.4", f"megatron-core{floor(tested_megatron_core())}", "numpy", "packaging",
                        'tomli>=2; python_version < "3.11"'])
