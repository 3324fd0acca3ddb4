"""The undo log (Patcher, patch_scope), module hooks, the Instrumentor base class, the re-entrancy guard and
prefix_renamer.

Everything is patched on small classes and torch modules made here, never on Megatron itself.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any, Callable, List

import pytest
import torch
from packaging.version import Version

from gradnan.errors import InternalError
from gradnan.patches.instrumentor import Instrumentor, SurfaceMissing
from gradnan.patches.module_hooks import ModuleHooks
from gradnan.patches.names import prefix_renamer
from gradnan.patches.reentrancy_guard import Outermost
from gradnan.patches.undo_log import WRAPPED_ATTR, Patcher, is_gradnan_wrapper, patch_scope

# what gradnan patches in megatron-core, on the installed release (CI runs it on each: setup.cfg)
pytestmark = pytest.mark.megatron_surface


def calls_through(original: Callable) -> Callable:
    """A wrapper factory in the shape the instrumentors use: call the original, tag the result."""

    def wrapper(self, *args, **kwargs):
        return ("wrapped", original(self, *args, **kwargs))

    return wrapper


@pytest.fixture
def classes():
    """Fresh Base/Child per test so a failing undo cannot leak into other tests."""

    class Base:
        def step(self, x):
            """Base.step docstring."""
            return ("base", x)

        inherited_value = "from base"

    class Child(Base):
        def own(self):
            return "child"

        own_value = 1

    return Base, Child


# --- Patcher.set ------------------------------------------------------------------------------


def test_set_then_undo_restores_the_same_object(classes):
    _, child = classes
    original = child.__dict__["own"]
    patcher = Patcher()
    patcher.set(child, "own", lambda self: "patched")
    assert child().own() == "patched"
    assert len(patcher) == 1
    patcher.undo()
    assert child.__dict__["own"] is original
    assert len(patcher) == 0


def test_set_inherited_attribute_then_undo_removes_it_from_subclass(classes):
    base, child = classes
    assert "inherited_value" not in vars(child)
    patcher = Patcher()
    patcher.set(child, "inherited_value", "patched")
    assert child.inherited_value == "patched"
    assert base.inherited_value == "from base"
    patcher.undo()
    assert "inherited_value" not in vars(child)
    assert child.inherited_value == "from base"


def test_set_new_attribute_then_undo_removes_it(classes):
    _, child = classes
    patcher = Patcher()
    patcher.set(child, "brand_new", 42)
    assert child.brand_new == 42
    patcher.undo()
    assert not hasattr(child, "brand_new")


def test_set_twice_on_same_name_undoes_in_reverse_order(classes):
    _, child = classes
    first, second = object(), object()
    patcher = Patcher()
    patcher.set(child, "own_value", first)
    patcher.set(child, "own_value", second)
    assert child.own_value is second
    patcher.undo()
    assert child.own_value == 1


def test_set_on_module_and_instance():
    module = types.ModuleType("fake_megatron_random")
    sentinel = object()
    module.get_state = sentinel
    instance = types.SimpleNamespace(scale=2.0)
    patcher = Patcher()
    patcher.set(module, "get_state", lambda: None)
    patcher.set(instance, "scale", 1.0)
    patcher.set(instance, "added", True)
    patcher.undo()
    assert module.get_state is sentinel
    assert vars(instance) == {"scale": 2.0}


def test_set_on_object_without_dict_restores_value():
    """Objects with __slots__ have no __dict__: the previous value itself is saved."""

    class Slotted:
        __slots__ = ("value",)

    slotted = Slotted()
    original = object()
    slotted.value = original
    patcher = Patcher()
    patcher.set(slotted, "value", "patched")
    assert slotted.value == "patched"
    patcher.undo()
    assert slotted.value is original


def test_undo_twice_is_harmless(classes):
    _, child = classes
    patcher = Patcher()
    patcher.set(child, "own_value", 2)
    patcher.undo()
    patcher.undo()
    assert child.own_value == 1


# --- Patcher.wrap -----------------------------------------------------------------------------


def test_wrap_own_method_and_undo(classes):
    base, _ = classes
    original = vars(base)["step"]
    patcher = Patcher()
    assert patcher.wrap(base, "step", calls_through) is True
    wrapper = vars(base)["step"]
    assert base().step(3) == ("wrapped", ("base", 3))
    assert is_gradnan_wrapper(wrapper)
    assert getattr(wrapper, WRAPPED_ATTR) is original
    assert wrapper.__wrapped__ is original
    assert wrapper.__name__ == "step" and wrapper.__doc__ == "Base.step docstring."
    patcher.undo()
    assert vars(base)["step"] is original
    assert base().step(3) == ("base", 3)


def test_wrap_inherited_method_patches_subclass_only_and_undo_removes_it(classes):
    base, child = classes
    original = vars(base)["step"]
    patcher = Patcher()
    assert patcher.wrap(child, "step", calls_through) is True
    assert "step" in vars(child)
    assert child().step(1) == ("wrapped", ("base", 1))
    assert base().step(1) == ("base", 1)
    assert getattr(vars(child)["step"], WRAPPED_ATTR) is original
    patcher.undo()
    assert "step" not in vars(child)
    assert vars(base)["step"] is original


def test_wrap_twice_does_not_double_wrap(classes):
    base, _ = classes
    patcher = Patcher()
    assert patcher.wrap(base, "step", calls_through) is True
    wrapper = vars(base)["step"]
    assert patcher.wrap(base, "step", calls_through) is False
    assert vars(base)["step"] is wrapper
    assert base().step(0) == ("wrapped", ("base", 0))
    assert len(patcher) == 1


def test_wrap_by_second_patcher_is_refused(classes):
    """Two installations must not stack wrappers on the same method."""
    base, _ = classes
    first, second = Patcher(), Patcher()
    first.wrap(base, "step", calls_through)
    assert second.wrap(base, "step", calls_through) is False
    assert len(second) == 0


def test_wrap_subclass_after_base_is_refused(classes):
    """Child inherits the already wrapped Base.step: wrapping Child would call the wrapper twice."""
    base, child = classes
    patcher = Patcher()
    assert patcher.wrap(base, "step", calls_through) is True
    assert patcher.wrap(child, "step", calls_through) is False
    assert "step" not in vars(child)
    assert child().step(5) == ("wrapped", ("base", 5))


def test_wrap_passes_the_current_attribute_to_the_factory(classes):
    base, _ = classes
    original = vars(base)["step"]
    seen: List[Any] = []

    def factory(wrapped):
        seen.append(wrapped)
        return calls_through(wrapped)

    Patcher().wrap(base, "step", factory)
    assert seen == [original]


def test_wrap_module_function_and_undo():
    module = types.ModuleType("fake_param_groups")

    def build(x):
        return x * 2

    module.build = build
    patcher = Patcher()
    assert patcher.wrap(module, "build", lambda original: lambda x: original(x) + 1)
    assert module.build(5) == 11
    patcher.undo()
    assert module.build is build


def test_wrap_missing_attribute_raises_attribute_error(classes):
    base, _ = classes
    with pytest.raises(AttributeError):
        Patcher().wrap(base, "no_such_method", calls_through)


def test_is_gradnan_wrapper():
    def plain():
        pass

    def marked():
        pass

    setattr(marked, WRAPPED_ATTR, plain)
    assert not is_gradnan_wrapper(plain)
    assert not is_gradnan_wrapper(None)
    assert not is_gradnan_wrapper(42)
    assert is_gradnan_wrapper(marked)


def test_is_gradnan_wrapper_none_marker_is_not_a_wrapper():
    def cleared():
        pass

    setattr(cleared, WRAPPED_ATTR, None)
    assert not is_gradnan_wrapper(cleared)


# --- Patcher.registered and patch_scope -------------------------------------------------------


def test_registered_hooks_are_removed_at_undo_with_the_attributes(classes):
    _, child = classes
    module = torch.nn.Linear(2, 2)
    patcher = Patcher()
    patcher.registered(module.register_forward_hook(lambda *args: None))
    patcher.set(child, "own_value", 2)
    patcher.registered(module.register_forward_pre_hook(lambda *args: None))
    assert len(patcher) == 3 and len(module._forward_hooks) == 1 and len(module._forward_pre_hooks) == 1
    patcher.undo()
    assert not module._forward_hooks and not module._forward_pre_hooks and child.own_value == 1
    assert len(patcher) == 0


def test_patch_scope_undoes_its_changes_when_the_block_ends(classes):
    _, child = classes
    instance = child()
    with patch_scope() as patcher:
        patcher.set(instance, "own", lambda: "in the block")
        patcher.set(child, "own_value", 2)
        assert instance.own() == "in the block" and child.own_value == 2
    assert "own" not in vars(instance) and instance.own() == "child" and child.own_value == 1


def test_patch_scope_undoes_its_changes_when_the_block_raises(classes):
    _, child = classes
    module = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="inside the block"):
        with patch_scope() as patcher:
            patcher.set(child, "own_value", 2)
            patcher.registered(module.register_forward_hook(lambda *args: None))
            raise RuntimeError("inside the block")
    assert child.own_value == 1 and not module._forward_hooks


# --- module_hooks.ModuleHooks -----------------------------------------------------------------


def test_a_replaced_forward_is_undone_to_the_class_forward():
    module = torch.nn.Linear(2, 2)
    hooks = ModuleHooks()
    hooks.replace_forward(module, lambda x: "replaced")
    assert module(torch.ones(2)) == "replaced"
    hooks.remove()
    assert "forward" not in vars(module) and module.forward.__func__ is torch.nn.Linear.forward


def test_a_replaced_forward_is_undone_to_the_instance_forward_it_replaced():
    module = torch.nn.Linear(2, 2)
    own = module.forward
    module.forward = own  # someone else's instance-level forward (a profiler, another tool)
    hooks = ModuleHooks()
    hooks.replace_forward(module, lambda x: "replaced")
    hooks.remove()
    assert vars(module)["forward"] is own


def test_module_hooks_fire_until_removed():
    module = torch.nn.Linear(2, 2)
    seen: List[str] = []
    hooks = ModuleHooks()
    hooks.before_forward(module, lambda mod, args: seen.append("before"))
    hooks.after_forward(module, lambda mod, args, kwargs, output: seen.append("after"))
    hooks.on_gradient(module.weight, lambda grad: seen.append("gradient"))
    module(torch.ones(2)).sum().backward()
    assert seen == ["before", "after", "gradient"]
    hooks.remove()
    module(torch.ones(2)).sum().backward()
    assert len(seen) == 3
    assert not module._forward_hooks and not module._forward_pre_hooks and not module.weight._backward_hooks


# --- Instrumentor -----------------------------------------------------------------------------


class FakeInstrumentor(Instrumentor):
    """Wraps ``target.step`` (and ``target.own`` when asked), then optionally raises."""

    name = "fake"

    def __init__(self, target, *, extra: bool = False, error: BaseException = None):
        super().__init__()
        self.target, self.extra, self.error = target, extra, error
        self.applied = 0

    def _apply(self, patcher, runtime):
        self.applied += 1
        patcher.wrap(self.target, "step", calls_through)
        if self.extra:
            patcher.set(self.target, "own", lambda self: runtime)
        if self.error is not None:
            raise self.error


def test_instrument_and_uninstrument_restore_exactly(classes):
    base, _ = classes
    original = vars(base)["step"]
    instrumentor = FakeInstrumentor(base)
    assert instrumentor.active is False
    instrumentor.instrument(runtime=None)
    assert instrumentor.active is True
    assert base().step(2) == ("wrapped", ("base", 2))
    instrumentor.uninstrument()
    assert instrumentor.active is False
    assert vars(base)["step"] is original


def test_instrument_twice_is_a_no_op(classes):
    base, _ = classes
    instrumentor = FakeInstrumentor(base)
    instrumentor.instrument(runtime=None)
    wrapper = vars(base)["step"]
    instrumentor.instrument(runtime=None)
    assert instrumentor.applied == 1
    assert vars(base)["step"] is wrapper


def test_instrument_again_after_uninstrument_reapplies(classes):
    base, _ = classes
    instrumentor = FakeInstrumentor(base)
    instrumentor.instrument(runtime=None)
    instrumentor.uninstrument()
    instrumentor.instrument(runtime=None)
    assert instrumentor.applied == 2
    assert is_gradnan_wrapper(vars(base)["step"])


@pytest.mark.parametrize(
    "error",
    [SurfaceMissing("no such class"), AttributeError("renamed"), ImportError("no module megatron.x")],
    ids=["SurfaceMissing", "AttributeError", "ImportError"],
)
def test_instrument_undoes_partial_patches_and_raises_surface_missing(classes, error):
    _, child = classes
    own = vars(child)["own"]
    instrumentor = FakeInstrumentor(child, extra=True, error=error)
    with pytest.raises(SurfaceMissing, match=str(error)) as info:
        instrumentor.instrument(runtime=None)
    assert info.value.__cause__ is error
    assert instrumentor.active is False
    assert "step" not in vars(child)  # the inherited method's wrapper is gone again
    assert vars(child)["own"] is own


def test_instrument_failure_can_be_retried(classes):
    base, _ = classes
    instrumentor = FakeInstrumentor(base, error=AttributeError("first try"))
    with pytest.raises(SurfaceMissing):
        instrumentor.instrument(runtime=None)
    instrumentor.error = None
    instrumentor.instrument(runtime=None)
    assert instrumentor.active and instrumentor.applied == 2


def test_instrument_that_patches_nothing_is_surface_missing():
    class NothingToDo(Instrumentor):
        def _apply(self, patcher, runtime):
            pass

    instrumentor = NothingToDo()
    with pytest.raises(SurfaceMissing, match="nothing to patch"):
        instrumentor.instrument(runtime=None)
    assert not instrumentor.active


def test_instrument_already_wrapped_surface_is_surface_missing(classes):
    """A second instrumentor over an already wrapped method patches nothing and says so."""
    base, _ = classes
    FakeInstrumentor(base).instrument(runtime=None)
    with pytest.raises(SurfaceMissing, match="nothing to patch"):
        FakeInstrumentor(base).instrument(runtime=None)


def test_instrument_undoes_partial_patches_on_unexpected_error(classes):
    """install() has no handle on an instrumentor whose instrument() raised, so nothing could undo
    what it left behind; it must clean up itself whatever the error."""
    base, _ = classes
    original = vars(base)["step"]
    instrumentor = FakeInstrumentor(base, error=TypeError("signature changed"))
    with pytest.raises(InternalError, match="TypeError: signature changed"):
        instrumentor.instrument(runtime=None)
    assert vars(base)["step"] is original
    assert instrumentor.active is False


def test_base_apply_is_abstract():
    with pytest.raises(InternalError, match="NotImplementedError"):
        Instrumentor().instrument(runtime=None)


def test_the_version_is_the_imported_megatron_not_the_installed_wheel(monkeypatch):
    """A source checkout on PYTHONPATH shadows the wheel: its ``package_info`` names the code imported."""
    from megatron.core import package_info

    from gradnan.patches.instrumentor import megatron_version
    from gradnan.patches.model import versions

    assert megatron_version() == Version(package_info.__version__)
    monkeypatch.setattr(package_info, "__version__", "0.99.0rc1")
    assert str(megatron_version()) == "0.99.0rc1" and versions()["megatron_core"] == "0.99.0rc1"
    assert "megatron-core 0.99.0rc1 is outside the tested range" in Instrumentor().version_note()


@pytest.mark.parametrize("version", ["0.12.0", "0.13.1", "0.16.1", "0.17.1", "0.19.1", "0.20.0", "0.20.99"])
def test_version_note_none_within_supported_range(mocker, version):
    mocker.patch("gradnan.patches.instrumentor.megatron_version", return_value=Version(version))
    assert Instrumentor().version_note() is None


@pytest.mark.parametrize("version", ["0.11.9", "0.21.0", "1.0.0"])
def test_version_note_outside_range_names_version_and_range(mocker, version):
    installed = mocker.patch("gradnan.patches.instrumentor.megatron_version", return_value=Version(version))
    note = Instrumentor().version_note()
    installed.assert_called_once_with()
    assert note is not None
    assert version in note and Instrumentor.supported in note


def test_version_note_none_when_megatron_version_unknown(mocker):
    mocker.patch("gradnan.patches.instrumentor.megatron_version", return_value=None)
    assert Instrumentor().version_note() is None


def test_version_note_uses_subclass_range(mocker):
    class Narrow(Instrumentor):
        supported = ">=0.15"

    mocker.patch("gradnan.patches.instrumentor.megatron_version", return_value=Version("0.14.0"))
    assert ">=0.15" in Narrow().version_note()
    assert Instrumentor().version_note() is None


# --- names.prefix_renamer ---------------------------------------------------------------------


def test_global_name_rewrites_matching_prefix():
    renames = {"decoder.layers.0.": "decoder.layers.2.", "decoder.layers.1.": "decoder.layers.3."}
    assert prefix_renamer(renames)("decoder.layers.1.mlp.weight") == "decoder.layers.3.mlp.weight"


def test_global_name_longest_prefix_wins_regardless_of_order():
    """``decoder.layers.1`` is a textual prefix of ``decoder.layers.10.``; the longer match must win."""
    renames = {"decoder.layers.1": "decoder.layers.5", "decoder.layers.10.": "decoder.layers.14."}
    assert prefix_renamer(renames)("decoder.layers.10.mlp.bias") == "decoder.layers.14.mlp.bias"
    reversed_renames = dict(reversed(list(renames.items())))
    assert prefix_renamer(reversed_renames)("decoder.layers.10.mlp.bias") == "decoder.layers.14.mlp.bias"
    assert prefix_renamer(renames)("decoder.layers.1.mlp.bias") == "decoder.layers.5.mlp.bias"


def test_global_name_without_match_is_unchanged():
    renames = {"decoder.layers.0.": "decoder.layers.4."}
    assert prefix_renamer(renames)("embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    assert prefix_renamer({})("x") == "x"


def test_global_name_whole_name_as_prefix():
    assert prefix_renamer({"output_layer.weight": "head.weight"})("output_layer.weight") == "head.weight"


def test_global_name_only_rewrites_the_prefix_once():
    renames = {"a.": "a.a."}
    assert prefix_renamer(renames)("a.a.w") == "a.a.a.w"


# --- reentrancy_guard.Outermost ---------------------------------------------------------------


def test_outermost_true_only_at_the_outer_level():
    guard = Outermost()
    seen = []
    with guard.enter() as outer:
        seen.append(outer)
        with guard.enter() as inner:
            seen.append(inner)
            with guard.enter() as innermost:
                seen.append(innermost)
        with guard.enter() as sibling:
            seen.append(sibling)
    with guard.enter() as again:
        seen.append(again)
    assert seen == [True, False, False, False, True]


def test_outermost_resets_after_exception():
    guard = Outermost()
    with pytest.raises(RuntimeError):
        with guard.enter():
            with guard.enter():
                raise RuntimeError("inside the wrapped call")
    with guard.enter() as outer:
        assert outer is True


def test_outermost_guards_are_independent():
    first, second = Outermost(), Outermost()
    with first.enter():
        with second.enter() as other:
            assert other is True


def test_outermost_is_per_thread():
    """While the main thread is nested inside the guard, another thread's first call is outermost."""
    guard = Outermost()
    results = {}

    def other_thread():
        with guard.enter() as outer:
            with guard.enter() as inner:
                results["other"] = (outer, inner)

    with guard.enter() as main_outer:
        with guard.enter() as main_inner:
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join(timeout=10)
            assert not thread.is_alive()
            with guard.enter() as main_innermost:
                pass
    assert (main_outer, main_inner, main_innermost) == (True, False, False)
    assert results["other"] == (True, False)


def test_outermost_nested_calls_through_wrappers():
    """The use it exists for: a wrapped method calling another wrapped method acts only once."""
    guard = Outermost()
    acted = []

    class Optimizer:
        def norm(self, depth):
            return depth if depth == 0 else self.norm(depth - 1)

    def make_wrapper(original):
        def wrapper(self, *args):
            with guard.enter() as outermost:
                result = original(self, *args)
            if outermost:
                acted.append(result)
            return result

        return wrapper

    patcher = Patcher()
    patcher.wrap(Optimizer, "norm", make_wrapper)
    try:
        assert Optimizer().norm(3) == 0
    finally:
        patcher.undo()
    assert acted == [0]


@pytest.fixture
def later_module(tmp_path, monkeypatch):
    """A module on sys.path that nothing has imported yet (as Megatron-Bridge's training modules are when
    ``-m gradnan.run`` installs gradnan), removed from sys.modules afterwards."""
    (tmp_path / "gradnan_later.py").write_text("def train_step(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gradnan_later", raising=False)
    yield "gradnan_later"
    sys.modules.pop("gradnan_later", None)


def _plus_ten(module):
    """A wrapper maker for ``module.train_step``: ten more."""
    return lambda original: (lambda x: original(x) + 10)


def test_a_module_imported_after_the_patch_is_wrapped_as_it_is_imported(later_module):
    patcher, finders = Patcher(), list(sys.meta_path)
    patcher.after_import(later_module, lambda module: patcher.wrap(module, "train_step", _plus_ten(module)))
    assert later_module not in sys.modules  # nothing imported by gradnan
    module = importlib.import_module(later_module)
    assert module.train_step(1) == 12 and sys.meta_path == finders  # the finder is gone once it has worked
    patcher.undo()
    assert module.train_step(1) == 2


def test_an_after_import_patch_undone_before_the_import_leaves_nothing(later_module):
    patcher, finders = Patcher(), list(sys.meta_path)
    patcher.after_import(later_module, lambda module: patcher.wrap(module, "train_step", _plus_ten(module)))
    patcher.undo()
    assert sys.meta_path == finders and importlib.import_module(later_module).train_step(1) == 2


def test_a_module_already_imported_is_patched_at_once(later_module):
    module = importlib.import_module(later_module)
    patcher = Patcher()
    patcher.after_import(later_module,
                         lambda imported: patcher.wrap(imported, "train_step", _plus_ten(imported)))
    assert module.train_step(1) == 12
    patcher.undo()
    assert module.train_step(1) == 2


def test_a_patch_that_fails_as_its_module_is_imported_leaves_the_import_whole(later_module, caplog):
    def broken(module):
        raise RuntimeError("a gradnan bug")

    patcher = Patcher()
    patcher.after_import(later_module, broken)
    assert importlib.import_module(later_module).train_step(1) == 2  # the program goes on, unpatched
    assert "could not patch gradnan_later as it was imported" in caplog.text
