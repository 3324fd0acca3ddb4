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
    # the rule tables: pure decisions over the files' observations, called by both sides
    "gradnan.decision": ("gradnan.errors", "gradnan.formats"),
    "gradnan.offline": ("gradnan.errors", "gradnan.formats", "gradnan.decision"),
    "gradnan.selftest": ("gradnan.errors", "gradnan.commandline", "gradnan.formats"),
    # the patch layer calls the runtime through the interface below both (gradnan.events), never directly
    "gradnan.patches": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.formats",
                        "gradnan.events", "megatron"),
    "gradnan.events": ("gradnan.config", "gradnan.formats"),
    "gradnan.patches.undo_log": (),  # the undo log every change goes through knows nothing of Megatron
    "gradnan.training": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.formats",
                         "gradnan.events", "gradnan.decision"),
    # install() and seed_all() are where the training side reaches the patch layer
    "gradnan.training.install": ("gradnan.errors", "gradnan.config", "gradnan.log", "gradnan.training",
                                 "gradnan.events", "gradnan.patches"),
    "gradnan.training.seed": ("gradnan.errors", "gradnan.training", "gradnan.patches"),
    # the recorder wraps ``torch.autograd.Function.apply`` while it records, through the undo log alone
    "gradnan.training.recorder": ("gradnan.errors", "gradnan.formats", "gradnan.training", "gradnan.events",
                                  "gradnan.patches.undo_log"),
    "gradnan.testing": ("gradnan", "megatron"),
    "gradnan.commandline": ("gradnan.errors", "gradnan.config", "gradnan.formats"),
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
        yield from ((node.lineno, name) for name in _imported(node, package))


def _imported(node: ast.AST, package: str) -> Iterator[str]:
    """The modules one import statement names (none for any other node), relative ones resolved."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        if node.module is None:  # ``from . import selftest``: the modules named
            yield from (f"{base}.{alias.name}" for alias in node.names)
        else:
            yield base


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
        found.append(f"{module}:{line} imports {imported}"
                     f" ({part} may import {', '.join(allowed) or 'nothing of gradnan'})")
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
    ("gradnan.offline.incident.report", "from ...training.runtime import Runtime\n"),
    ("gradnan.offline.incident.report", "def f():\n    import megatron.core\n"),
    ("gradnan.formats.records", "from ..offline.incident.read import read_run\n"),
    ("gradnan.training.runtime", "from megatron.core import parallel_state\n"),
    ("gradnan.training.install", "def f():\n    import megatron.core.optimizer\n"),
    ("gradnan.patches.undo_log", "from megatron.core import rerun_state_machine\n"),
    ("gradnan.training.capture", "from ..patches.model import global_named_modules\n"),
    ("gradnan.training.capture", "from ..testing.toy import TinyGPT\n"),
    ("gradnan.selftest", "from ..training import install\n"),
])
def test_the_checker_catches_a_backward_import(module, source):
    """Each of these would break the contract: the checker must say so (a check that cannot fail proves
    nothing)."""
    [problem] = violations(source, module, is_package=module == "gradnan.selftest")
    assert problem.startswith(f"{module}:")


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def eager_imports(source: str, module: str, is_package: bool) -> Iterator[str]:
    """The modules ``source`` imports when it is imported: module level and class bodies, not function
    bodies (lazy imports) nor ``if TYPE_CHECKING:`` blocks."""
    package = module if is_package else module.rpartition(".")[0]

    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_type_checking(node):
                continue
            for name in _imported(node, package):
                yield name
                if isinstance(node, ast.ImportFrom) and node.module is not None:  # names may be modules
                    yield from (f"{name}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from walk(getattr(node, field, []) or [])

    yield from walk(ast.parse(source).body)


def loaded_by_importing(start: str) -> set:
    """Every module, gradnan's own and third-party top-level names, that importing ``start`` loads: the
    eager imports, transitively, with the ``__init__`` of every package on the way."""
    files = {module_name(path): path for path in package_modules()}
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            prefix = ".".join(parts[:depth])
            if prefix in seen or (prefix.startswith("gradnan.") and prefix not in files):
                continue  # seen, or a name imported from a module, not a module
            seen.add(prefix)
            if prefix in files:
                path = files[prefix]
                todo.extend(eager_imports(path.read_text(), prefix, path.name == "__init__.py"))
    return seen


OFFLINE_ENTRY_POINTS = ("gradnan.cli", "gradnan.offline.incident.report",
                        "gradnan.offline.incident.analysis", "gradnan.offline.incident.plot",
                        "gradnan.offline.incident.frames_view", "gradnan.offline.incident.read", "gradnan")


@pytest.mark.parametrize("start", OFFLINE_ENTRY_POINTS)
def test_the_offline_side_loads_neither_torch_nor_megatron_nor_the_training_side(start):
    loaded = loaded_by_importing(start)
    assert not {"torch", "megatron", "gradnan.training"} & loaded, sorted(loaded)


def test_the_import_walk_sees_through_package_inits_and_skips_lazy_imports(tmp_path):
    """A check that cannot fail proves nothing: the walk finds torch behind a package ``__init__`` and
    leaves a function's import alone."""
    assert "torch" in loaded_by_importing("gradnan.training.scan")
    assert "gradnan.training" in loaded_by_importing("gradnan.training.scan")
    assert list(eager_imports("import json\ndef f():\n    import torch\n", "gradnan.x", False)) == ["json"]
    assert "torch" not in eager_imports("from typing import TYPE_CHECKING\n"
                                        "if TYPE_CHECKING:\n    import torch\n",
                                        "gradnan.x", False)


def _frames_record() -> dict:
    from gradnan.formats import records

    frame = {"step": 2, "module": "decoder.layers.0.mlp", "class": "MLP", "call": 3, "recomputed": 0,
             "entries": [{"name": "output[0]", "kind": "output", "dtype": "torch.bfloat16", "abs_min": 0.5,
                          "abs_max": "inf"}]}
    return records.to_json("frames", 2, None, {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0},
                           {"started": 1.0}, [], 0,
                           {"mode": "detect", "frames": [frame], "frames_total": 1, "first_nonfinite": 0})


@pytest.mark.parametrize("command", [["report"], ["report", "--json"], ["maps", "--rank", "3"], ["frames"]])
def test_offline_commands_run_without_importing_torch_or_megatron(tmp_path, command):
    """The commands a user runs on a laptop over a shared run directory: run in a fresh interpreter, the
    modules loaded at the end are checked."""
    import subprocess
    import sys

    from gradnan.formats.layout import records_path
    from gradnan.formats.safe_write import append_json_line
    from gradnan.testing.synthetic import write_run_dir

    write_run_dir(tmp_path, 16)
    append_json_line(records_path(str(tmp_path), {"global_rank": 0, "tp": 0, "pp": 0, "dp": 0}),
                     _frames_record())
    probe = ("import sys\nfrom gradnan.cli import main\ncode = main(sys.argv[1:])\n"
             "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules), code, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe, command[0], str(tmp_path), *command[1:]],
                            capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "[] 0", result.stderr
    assert result.stdout.strip()
