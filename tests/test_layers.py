"""The layer contract, read from the source: which part of gradnan may import which (docs/how-it-works.md).

formats is the one contract and imports no other part; the offline side and the self-test read files and
never import the training side or Megatron; only the Megatron patch layer (``patches/``, installed as
``gradnan.patches``) imports Megatron, and only ``install()`` and ``seed_all()`` reach it from the training
side; nothing in the product imports the test harness except the CLI's ``demo`` command."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradnan"
PATCHES = ROOT / "patches"  # the package gradnan.patches (setup.cfg's package_dir)

# part -> the gradnan parts it may import (besides itself); "megatron" stands for the megatron package
ALLOWED: Dict[str, Tuple[str, ...]] = {
    "gradnan.errors": (),
    "gradnan.log": (),
    "gradnan.config": ("gradnan.errors", "gradnan.formats"),  # formats.schema: the one bounded read
    "gradnan.formats": ("gradnan.errors",),
    "gradnan.offline": ("gradnan.errors", "gradnan.formats"),
    "gradnan.selftest": ("gradnan.errors", "gradnan.formats"),
    "gradnan.patches": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.formats", "gradnan.training",
                        "megatron"),
    "gradnan.patches.undo_log": (),  # the undo log every change goes through knows nothing of Megatron
    "gradnan.training": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.formats"),
    # install() and seed_all() are where the training side reaches the patch layer
    "gradnan.training.install": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.training",
                                 "gradnan.patches"),
    "gradnan.training.seed": ("gradnan.errors", "gradnan.training", "gradnan.patches"),
    "gradnan.testing": ("gradnan", "megatron"),
    "gradnan.commandline": ("gradnan.errors", "gradnan.config"),
    "gradnan.cli": ("gradnan.errors", "gradnan.commandline", "gradnan.offline", "gradnan.selftest",
                    "gradnan.testing.demo"),
    "gradnan.run": ("gradnan.errors", "gradnan.commandline", "gradnan.config", "gradnan"),
    "gradnan.__main__": ("gradnan.cli",),
    "gradnan": ("gradnan.errors", "gradnan.config", "gradnan.training"),
}


def module_name(path: Path) -> str:
    """The dotted name a source file is imported as: ``patches/x.py`` is ``gradnan.patches.x``."""
    root, prefix = (PATCHES, ["gradnan", "patches"]) if path.is_relative_to(PATCHES) else (ROOT, [])
    parts = prefix + list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The longest key of ALLOWED that ``module`` is (or is inside)."""
    return max((part for part in ALLOWED if module == part or module.startswith(part + ".")), key=len)


def imports(source: str, module: str, is_package: bool) -> Iterator[Tuple[int, str]]:
    """(line, imported module) for every import in ``source``, at any depth (lazy imports count)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if node.module is None:  # ``from . import selftest``: the modules named
                yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            else:
                yield node.lineno, base


def violations(source: str, module: str, is_package: bool = False) -> List[str]:
    part = part_of(module)
    allowed = ALLOWED[part]
    found = []
    for line, imported in imports(source, module, is_package):
        target = "megatron" if imported.split(".")[0] == "megatron" else imported
        if target != "megatron" and not target.startswith("gradnan"):
            continue
        if target == part or target.startswith(part + ".") or any(
                target == ok or target.startswith(ok + ".") for ok in allowed):
            continue
        found.append(f"{module}:{line} imports {imported} ({part} may import {', '.join(allowed) or 'nothing of gradnan'})")
    return found


def package_modules() -> List[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *PATCHES.rglob("*.py")])


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_imports_only_what_its_layer_may(path):
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


def test_every_module_belongs_to_a_layer():
    assert all(part_of(module_name(path)) for path in package_modules())


def test_the_patch_layer_is_read_under_its_installed_name():
    """A file of ``patches/`` is checked as ``gradnan.patches.*``, the part that may import Megatron."""
    names = {module_name(path) for path in package_modules()}
    assert {"gradnan.patches", "gradnan.patches.optimizer"} <= names
    assert not any(name.startswith("patches") for name in names)
    assert part_of(module_name(PATCHES / "optimizer.py")) == "gradnan.patches"


@pytest.mark.parametrize("module, source", [
    ("gradnan.offline.report", "from ..training.runtime import Runtime\n"),
    ("gradnan.offline.report", "def f():\n    import megatron.core\n"),
    ("gradnan.formats.records", "from ..offline.read import read_run\n"),
    ("gradnan.training.runtime", "from megatron.core import parallel_state\n"),
    ("gradnan.training.install", "def f():\n    import megatron.core.optimizer\n"),
    ("gradnan.patches.undo_log", "from megatron.core import rerun_state_machine\n"),
    ("gradnan.training.capture", "from ..patches.model import global_named_modules\n"),
    ("gradnan.training.capture", "from ..testing.toy import TinyGPT\n"),
    ("gradnan.selftest", "from ..training import install\n"),
])
def test_the_checker_catches_a_backward_import(module, source):
    """Each of these would break the contract: the checker must say so (a check that cannot fail proves nothing)."""
    [problem] = violations(source, module, is_package=module == "gradnan.selftest")
    assert problem.startswith(f"{module}:")
