"""The undo log behind every change gradnan makes to Megatron and to the model: class and module attributes
(the instrumentors), instance ``forward`` swaps and hooks (``module_hooks``), the attributes of Megatron's
``RerunStateMachine`` and model config that a diagnostic pass sets aside (``schedules``), and the CPU shim's
stand-ins (tests and demo).

Like pytest's ``MonkeyPatch``: each change is recorded with what was there before (or that nothing was),
so undoing puts back the very same objects (``is``-identical) in reverse order. ``patch_scope()`` is the
same log for changes that last one block. Imports nothing of Megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterator, List, Optional, Sequence

_ABSENT = object()
WRAPPED_ATTR = "__gradnan_wrapped__"


def is_gradnan_wrapper(obj: Any) -> bool:
    return getattr(obj, WRAPPED_ATTR, None) is not None


def _restore(owner: Any, name: str, saved: Any) -> None:
    if saved is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, saved)


class Patcher:
    """Records changes and undoes them exactly, the last one first."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        saved = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name)
        self._undo.append(functools.partial(_restore, owner, name, saved))
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

    def after_import(self, module_name: str, apply: Callable[[ModuleType], None]) -> None:
        """``apply(module)`` to ``module_name`` now where it is imported, else as soon as it is (a finder on
        ``sys.meta_path`` wraps its loader): a surface of a package gradnan never imports itself.
        Undoing removes the finder; what ``apply`` changed is in this log too."""
        module = sys.modules.get(module_name)
        if module is not None:
            apply(module)
            return
        finder = _AfterImport(module_name, apply)
        sys.meta_path.insert(0, finder)
        self._undo.append(finder.remove)

    def registered(self, handle: Any) -> None:
        """A hook torch has registered (its handle, anything with ``remove()``): removed at ``undo()``."""
        self._undo.append(handle.remove)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for one module, the spec the other finders give, with a loader that runs
    ``apply(module)`` once the module's code has run."""

    def __init__(self, module_name: str, apply: Callable[[ModuleType], None]) -> None:
        self.module_name, self.apply = module_name, apply
        self._local = threading.local()  # while the other finders are asked (they may import)

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.module_name or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = next((found for finder in sys.meta_path if finder is not self
                         for found in [getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)]
                         if found is not None), None)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenApply(spec.loader, self)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenApply(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _AfterImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:  # not undone while the module was running
            self.finder.remove()
            try:
                self.finder.apply(module)
            except Exception:  # the import goes on, unpatched: gradnan never fails the program
                logging.getLogger("gradnan").exception("could not patch %s as it was imported",
                                                       self.finder.module_name)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


@contextlib.contextmanager
def patch_scope() -> Iterator[Patcher]:
    """Changes for the length of a block, ``with patch_scope() as p: p.set(...)``: undone when the block
    is left, by an exception too."""
    patcher = Patcher()
    try:
        yield patcher
    finally:
        patcher.undo()
