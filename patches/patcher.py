"""The undo log behind every patch, and the base class of the instrumentors.

Like pytest's ``MonkeyPatch``: each change is recorded with what was there before (or that nothing was),
so undoing puts back the very same objects (``is``-identical) in reverse order.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import InternalError

_ABSENT = object()
WRAPPED_ATTR = "__gradnan_wrapped__"


class SurfaceMissing(Exception):
    """A Megatron surface an instrumentor needs is not there (renamed, removed, not installed)."""


def is_gradnan_wrapper(obj: Any) -> bool:
    return getattr(obj, WRAPPED_ATTR, None) is not None


class Patcher:
    """Records attribute changes and undoes them exactly."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        saved = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name)
        self._undo.append((owner, name, saved))
        setattr(owner, name, value)

    def wrap(self, owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
        """Replace ``owner.name`` by ``make_wrapper(original)``; never wraps a gradnan wrapper again."""
        original = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
        if is_gradnan_wrapper(original):
            return False
        wrapper = make_wrapper(original)
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, WRAPPED_ATTR, original)
        self.set(owner, name, wrapper)
        return True

    def undo(self) -> None:
        while self._undo:
            owner, name, saved = self._undo.pop()
            if saved is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)

    def __len__(self) -> int:
        return len(self._undo)


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


class Instrumentor:
    """One Megatron surface: ``instrument()`` patches it, ``uninstrument()`` restores it exactly.

    Subclasses set ``name`` and ``supported`` (a megatron-core version specifier) and implement
    ``_apply(patcher, runtime)``, raising ``SurfaceMissing`` when what they patch is not there.
    """

    name = "?"
    supported = ">=0.12,<0.21"

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
            raise InternalError(f"instrumenting {self.name} failed: {type(exc).__name__}: {exc}") from exc
        if not self.active:
            raise SurfaceMissing("nothing to patch")

    def uninstrument(self) -> None:
        self._patcher.undo()

    def _apply(self, patcher: Patcher, runtime: Any) -> None:
        raise NotImplementedError
