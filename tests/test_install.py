"""install()/uninstall() on the real megatron-core classes: what is patched, exact restore, no double wrap,
missing surfaces reported, configuration from the environment."""

from __future__ import annotations

import logging

import pytest

import gradnan
from gradnan.config import ConfigError
from gradnan.patches.instrumentor import Instrumentor
from gradnan.patches.optimizer import optimizer_classes
from gradnan.patches.undo_log import WRAPPED_ATTR

PATCHED_METHODS = ("__init__", "step", "get_grad_norm", "clip_grad_norm",
                   "_unscale_main_grads_and_check_for_nan")


def _megatron_attributes():
    """Every attribute the kit may patch, as found in the owners' own __dict__ (absent -> None)."""
    found = {(m.__name__, "_get_param_groups"): vars(m).get("_get_param_groups")
             for m in _builder_modules()}
    for cls in optimizer_classes():
        for method in PATCHED_METHODS:
            found[(cls.__qualname__, method)] = vars(cls).get(method)
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    found[("DistributedDataParallel", "zero_grad_buffer")] = vars(DistributedDataParallel).get("zero_grad_buffer")
    return found


def _builder_modules():
    """The modules that bind the param-group builder (``optimizer.muon`` from core 0.15 to 0.18)."""
    import importlib.util

    names = ("megatron.core.optimizer", "megatron.core.optimizer.muon")
    modules = [importlib.import_module(name) for name in names if importlib.util.find_spec(name) is not None]
    return [module for module in modules if hasattr(module, "_get_param_groups")]


@pytest.fixture(autouse=True)
def _always_uninstall():
    yield
    gradnan.uninstall()


def test_install_patches_every_surface_and_uninstall_restores_the_same_objects(tmp_path):
    before = _megatron_attributes()
    installation = gradnan.install(out_dir=str(tmp_path))
    assert installation.missing == {}
    assert len(installation.patched) == 8
    during = _megatron_attributes()
    changed = {key for key in before if during[key] is not before[key]}
    assert ("ChainedOptimizer", "step") in changed
    assert ("ChainedOptimizer", "get_grad_norm") in changed
    assert ("MegatronOptimizer", "clip_grad_norm") in changed
    assert ("MixedPrecisionOptimizer", "_unscale_main_grads_and_check_for_nan") in changed
    assert ("megatron.core.optimizer", "_get_param_groups") in changed
    assert ("DistributedDataParallel", "zero_grad_buffer") in changed
    assert all(getattr(during[key], WRAPPED_ATTR) is before[key] for key in changed)
    gradnan.uninstall()
    after = _megatron_attributes()
    assert all(after[key] is before[key] for key in before)


def test_second_install_returns_the_first_and_wraps_nothing_twice(tmp_path):
    first = gradnan.install(out_dir=str(tmp_path / "a"))
    wrapped = _megatron_attributes()
    second = gradnan.install(out_dir=str(tmp_path / "b"))
    assert second is first
    assert second.out_dir == str(tmp_path / "a")
    assert _megatron_attributes() == wrapped


def test_install_uninstall_install_again(tmp_path):
    before = _megatron_attributes()
    gradnan.install(out_dir=str(tmp_path))
    gradnan.uninstall()
    again = gradnan.install(out_dir=str(tmp_path))
    assert len(again.patched) == 8
    assert _megatron_attributes() != before
    gradnan.uninstall()
    assert _megatron_attributes() == before


def test_a_missing_surface_is_named_not_silent(tmp_path, monkeypatch, caplog):
    for module in _builder_modules():
        monkeypatch.delattr(module, "_get_param_groups")
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        installation = gradnan.install(out_dir=str(tmp_path))
    [missing] = installation.missing
    assert "param-group builder" in missing
    assert "_get_param_groups" in installation.missing[missing]
    assert len(installation.patched) == 7
    assert "MISSING" in caplog.text


def test_options_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_OUT_DIR", str(tmp_path / "from_env"))
    monkeypatch.setenv("GRADNAN_MAX_PARAMS_PER_RECORD", "5")
    installation = gradnan.install()
    assert installation.out_dir == str(tmp_path / "from_env")
    assert installation.config.max_params_per_record == 5


def test_keyword_arguments_beat_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_OUT_DIR", str(tmp_path / "from_env"))
    assert gradnan.install(out_dir=str(tmp_path / "kw")).out_dir == str(tmp_path / "kw")


def test_a_misspelt_environment_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("GRADNAN_OUTDIR", "x")
    with pytest.raises(ConfigError, match="GRADNAN_OUTDIR"):
        gradnan.install()
    assert gradnan.current() is None


def test_concurrent_installs_from_threads_make_one_installation(tmp_path):
    import threading

    before = _megatron_attributes()
    results, barrier = [], threading.Barrier(8)

    def install():
        barrier.wait()
        results.append(gradnan.install(out_dir=str(tmp_path)))

    threads = [threading.Thread(target=install) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(result) for result in results}) == 1
    during = _megatron_attributes()
    assert all(getattr(during[key], WRAPPED_ATTR, None) in (None, before[key]) for key in before)


class _BuggyInstrumentor(Instrumentor):
    """An instrumentor with a bug of gradnan's own (not a missing Megatron surface)."""

    name = "buggy surface"

    def _apply(self, patcher, runtime):
        raise TypeError("'NoneType' object is not callable")


@pytest.mark.parametrize("strict", [False, True])
def test_a_bug_in_an_instrumentor_is_not_reported_as_a_missing_surface(tmp_path, monkeypatch, strict):
    from gradnan.training import install as install_module

    monkeypatch.setattr(install_module, "all_instrumentors", lambda: [_BuggyInstrumentor()])
    if strict:
        with pytest.raises(gradnan.InternalError, match="instrumenting buggy surface failed: TypeError"):
            gradnan.install(out_dir=str(tmp_path), strict=True)
        return
    installation = gradnan.install(out_dir=str(tmp_path))
    assert installation.missing == {} and list(installation.failed) == ["buggy surface"]
    assert "FAILED (a gradnan bug, please report it): buggy surface" in installation.summary()
