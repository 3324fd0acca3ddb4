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
from typing import Any, Callable, Iterator, List

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

    def registered(self, handle: Any) -> None:
        """A hook torch has registered (its handle, anything with ``remove()``): removed at ``undo()``."""
        self._undo.append(handle.remove)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)


@contextlib.contextmanager
def patch_scope() -> Iterator[Patcher]:
    """Changes for the length of a block, ``with patch_scope() as p: p.set(...)``: undone when the block
    is left, by an exception too."""
    patcher = Patcher()
    try:
        yield patcher
    finally:
        patcher.undo()
