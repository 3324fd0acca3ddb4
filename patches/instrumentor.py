"""The base class of the instrumentors, one per patched Megatron surface, the megatron-core versions they
were tested against (``supported.py``), and the dry run that finds a missing surface before anything is
patched."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import InternalError
from .supported import MEGATRON_CORE
from .undo_log import Patcher


class SurfaceMissing(Exception):
    """A Megatron surface an instrumentor needs is not there (renamed, removed, not installed)."""


def installed_version(distribution: str) -> Optional[Version]:
    from importlib import metadata

    try:
        return Version(metadata.version(distribution))
    except (metadata.PackageNotFoundError, InvalidVersion):
        return None


def megatron_version() -> Optional[Version]:
    """The megatron-core that is imported: ``megatron.core.package_info``, which a source checkout on
    ``PYTHONPATH`` brings with it, where the installed wheel's metadata would name another release."""
    try:
        from megatron.core import package_info

        return Version(package_info.__version__)
    except (ImportError, AttributeError, InvalidVersion):
        return installed_version("megatron-core")


class SurfaceProbe(Patcher):
    """A dry run of an instrumentor's ``_apply``: every attribute it would replace is looked up (one that is
    not there raises as in the real patch), and counted; nothing is changed."""

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append(lambda: None)

    def after_import(self, module_name: str, apply: Callable[[ModuleType], None]) -> None:
        """Looked up now where the module is imported, else counted (a finder would wait for it)."""
        module = sys.modules.get(module_name)
        if module is not None:
            apply(module)
        else:
            self._undo.append(lambda: None)


class Instrumentor:
    """One Megatron surface: ``instrument()`` patches it, ``uninstrument()`` restores it exactly.

    Subclasses set ``name`` (short and stable: what ``disabled_patches`` and ``Installation`` name it by),
    ``description`` (what it patches, for people), ``without`` (what is lost when it is not patched,
    disabled or missing) and ``supported`` (a megatron-core version specifier), and implement
    ``_apply(patcher, runtime)``, raising ``SurfaceMissing`` when what they patch is not there.
    """

    name = "?"
    description = "?"
    without = "?"
    supported = MEGATRON_CORE

    def __init__(self) -> None:
        self._patcher = Patcher()

    @property
    def active(self) -> bool:
        return len(self._patcher) > 0

    def version_note(self) -> Optional[str]:
        version = megatron_version()
        if version is None or version in SpecifierSet(self.supported):
            return None
        return f"megatron-core {version} is outside the tested range {self.supported}"

    def missing(self, runtime: Any) -> Optional[str]:
        """Why the surface is not there, found by a dry run that patches nothing; None where it is (or
        where the dry run met a gradnan bug, which ``instrument()`` then reports as one)."""
        probe = SurfaceProbe()
        try:
            self._apply(probe, runtime)
        except (SurfaceMissing, ImportError, AttributeError) as exc:
            return str(exc)
        except Exception:
            return None
        return None if len(probe) else "nothing to patch"

    def instrument(self, runtime: Any) -> None:
        """Patch the surface. ``SurfaceMissing`` when Megatron lacks it (a module, class or attribute
        is not there); ``InternalError`` for anything else, which is gradnan's own bug, not a missing
        surface. Either way nothing is left half-patched."""
        if self.active:
            return
        try:
            self._apply(self._patcher, runtime)
        except (SurfaceMissing, ImportError, AttributeError) as exc:
            self._patcher.undo()
            raise SurfaceMissing(str(exc)) from exc
        except Exception as exc:
            self._patcher.undo()
            failure = f"{type(exc).__name__}: {exc}"
            raise InternalError(f"instrumenting {self.description} failed: {failure}") from exc
        if not self.active:
            raise SurfaceMissing("nothing to patch")

    def uninstrument(self) -> None:
        self._patcher.undo()

    def _apply(self, patcher: Patcher, runtime: Any) -> None:
        raise NotImplementedError
