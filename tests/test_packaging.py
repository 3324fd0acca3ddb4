"""The patch layer lives in ``patches/`` beside ``gradnan/`` and installs as ``gradnan.patches`` (setup.cfg's
``package_dir``), never as a top-level ``patches`` package: with the README's editable install and with a
built wheel."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from gradnan.patches.supported import MEGATRON_CORE
from gradnan.testing.demo import DEMO_MODULE

from .helpers import environ_without_gradnan

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "gradnan", "patches")
WHERE_FROM = """
import gradnan.patches
print(gradnan.patches.__file__)
try:
    import patches
    print(patches.__file__)
except ModuleNotFoundError:
    print("no top-level patches")
"""


def _setup_options() -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config["options"]


def _listed(option: str) -> list:
    return [line.strip() for line in _setup_options()[option].splitlines() if line.strip()]


def test_every_package_folder_is_listed_in_setup_cfg():
    """The list is explicit (``find:`` cannot put ``patches/`` under ``gradnan``): a package folder left
    out of it would be missing from every wheel."""
    folders = {".".join(path.parent.relative_to(ROOT).parts)
               for path in (ROOT / "gradnan").rglob("__init__.py")}
    assert sorted(_listed("packages")) == sorted(folders | {"gradnan.patches"})
    assert _listed("package_dir") == ["gradnan.patches = patches"]
    assert (ROOT / "patches" / "__init__.py").is_file() and not (ROOT / "gradnan" / "patches").exists()


def test_megatron_core_requirement_is_the_tested_floor_without_a_ceiling():
    """The installed metadata asks for the floor of the one declared range: a patch kit that caps
    megatron-core makes pip downgrade or refuse the user's the day a newer release ships; outside the tested
    range ``install()`` warns instead (docs/megatron-versions.md)."""
    [requirement] = [Requirement(line) for line in metadata.requires("gradnan")
                     if Requirement(line).name == "megatron-core"]
    [floor] = [specifier for specifier in SpecifierSet(MEGATRON_CORE) if specifier.operator == ">="]
    assert requirement.specifier == SpecifierSet(str(floor)) and Version("99.0") in requirement.specifier


def test_every_range_the_docs_print_is_the_declared_one():
    """The tested range is written in one place (``patches/supported.py``); the docs quote it."""
    quoted = {(path.name, match) for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
              if path.name != "changes.md"  # the history says what each release said then
              for match in re.findall(r">=\s*0\.\d+\s*,\s*<\s*\d+\.\d+", path.read_text())}
    assert quoted and {match for _, match in quoted} == {MEGATRON_CORE}, sorted(quoted)


def _where_from(tmp_path: Path, environ: dict) -> list:
    """Where a fresh interpreter, started outside the source tree, imports ``gradnan.patches`` from, and
    whether it finds a top-level ``patches``."""
    done = subprocess.run([sys.executable, "-c", WHERE_FROM], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _pip(cwd: Path, *arguments: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *arguments],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_editable_install_maps_the_patches_folder_into_gradnan(tmp_path):
    environ = {key: value for key, value in environ_without_gradnan().items() if key != "PYTHONPATH"}
    assert _where_from(tmp_path, environ) == [str(ROOT / "patches" / "__init__.py"), "no top-level patches"]


@pytest.mark.slow
def test_a_built_wheel_installed_into_a_fresh_venv_holds_gradnan_patches_and_runs_the_demo(tmp_path):
    """The wheel, installed by pip into a new virtual environment: torch and megatron-core come from this
    environment's site-packages through a path entry added after the install (no .pth file of it runs
    there, so neither does the editable install's finder); gradnan comes from the wheel alone."""
    source, wheels, venv = tmp_path / "source", tmp_path / "wheels", tmp_path / "venv"
    source.mkdir()
    for name in BUILD_INPUTS:  # built from a copy: no build/ folder left in the worktree, none reused from it
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    _pip(source, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), ".")
    [wheel] = wheels.glob("*.whl")
    # the new environment's own pip: this one's would first uninstall the gradnan installed here
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install",
                              "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")  # after the install
    assert not (site / "patches").exists() and (site / "gradnan" / "patches" / "__init__.py").is_file()
    environ = {key: value for key, value in environ_without_gradnan().items() if key != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", WHERE_FROM], cwd=tmp_path, env=environ, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines() == [str(site / "gradnan" / "patches" / "__init__.py"),
                                         "no top-level patches"]
    demo = subprocess.run([str(python), "-m", "gradnan", "demo", "--out", str(tmp_path / "demo")],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    assert DEMO_MODULE in demo.stdout
    here = subprocess.run([sys.executable, "-c", "import gradnan"], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert here.returncode == 0, f"this environment's gradnan install was touched: {here.stderr}"
