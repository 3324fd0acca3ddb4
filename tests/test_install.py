"""install()/uninstall() on the real megatron-core classes: what is patched, exact restore, no double wrap,
missing surfaces reported, patches disabled by name, configuration from the environment."""

from __future__ import annotations

import logging

import pytest
import torch

import gradnan
from gradnan.config import ConfigError
from gradnan.config.sources import resolve_config
from gradnan.patches import all_instrumentors
from gradnan.patches.instrumentor import Instrumentor
from gradnan.patches.optimizer import optimizer_classes
from gradnan.patches.p2p import communicate_owner
from gradnan.patches.schedules import SCHEDULES
from gradnan.patches.supported import MEGATRON_CORE
from gradnan.patches.undo_log import WRAPPED_ATTR

# what gradnan patches in megatron-core, on the installed release (CI runs it on each: setup.cfg)
pytestmark = pytest.mark.megatron_surface

PATCH_NAMES = ["param_groups", "optimizer", "loss_scale", "grad_sync", "grad_zeroing", "schedules",
               "result_validation", "module_hooks", "pipeline_links", "checkpoint", "bridge_loop"]
OPTIMIZER_METHODS = ("__init__", "step", "get_grad_norm", "clip_grad_norm")


def _surfaces():
    """Every Megatron attribute the kit may patch, by patch, as found in its owner's own __dict__ (absent ->
    None). ``module_hooks`` patches no Megatron attribute: it hooks model modules (see below)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.rerun_state_machine import RerunStateMachine

    owners = {
        "param_groups": [(module, "_get_param_groups") for module in _builder_modules()],
        "optimizer": [(cls, method) for cls in optimizer_classes() for method in OPTIMIZER_METHODS],
        "loss_scale": [(cls, "_unscale_main_grads_and_check_for_nan") for cls in optimizer_classes()],
        "grad_sync": [(_ParamAndGradBucketGroup, "start_grad_sync")],
        "grad_zeroing": [(DistributedDataParallel, "zero_grad_buffer")],
        "schedules": [(schedules, name) for name in SCHEDULES],
        "result_validation": [(RerunStateMachine, "should_checkpoint_and_exit")],
        "pipeline_links": [(communicate_owner(), "_communicate")],
        "checkpoint": [(dist_checkpointing, "save"), (serialization, "save")],
    }
    return {patch: {(getattr(owner, "__qualname__", owner.__name__), attribute): vars(owner).get(attribute)
                    for owner, attribute in pairs}
            for patch, pairs in owners.items()}


def _megatron_attributes():
    return {key: value for attributes in _surfaces().values() for key, value in attributes.items()}


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
    assert len(installation.patched) == len(PATCH_NAMES)
    during = _megatron_attributes()
    changed = {key for key in before if during[key] is not before[key]}
    assert ("ChainedOptimizer", "step") in changed
    assert ("ChainedOptimizer", "get_grad_norm") in changed
    assert ("MegatronOptimizer", "clip_grad_norm") in changed
    assert ("MixedPrecisionOptimizer", "_unscale_main_grads_and_check_for_nan") in changed
    assert ("megatron.core.optimizer", "_get_param_groups") in changed
    assert ("DistributedDataParallel", "zero_grad_buffer") in changed
    assert ("megatron.core.dist_checkpointing", "save") in changed
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
    assert len(again.patched) == len(PATCH_NAMES)
    assert _megatron_attributes() != before
    gradnan.uninstall()
    assert _megatron_attributes() == before


def test_a_missing_surface_is_named_not_silent(tmp_path, monkeypatch, caplog):
    for module in _builder_modules():
        monkeypatch.delattr(module, "_get_param_groups")
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        installation = gradnan.install(out_dir=str(tmp_path))
    assert list(installation.missing) == ["param_groups"]
    assert "_get_param_groups" in installation.missing["param_groups"]
    assert len(installation.patched) == len(PATCH_NAMES) - 1
    assert "MISSING: param-group builder (_get_param_groups) [param_groups]: " in caplog.text


def test_the_dry_run_finds_every_surface_of_this_megatron_core_and_changes_nothing(make_runtime):
    before, runtime = _megatron_attributes(), make_runtime()
    assert {instrumentor.name: instrumentor.missing(runtime) for instrumentor in all_instrumentors()} == {
        name: None for name in PATCH_NAMES}
    assert _megatron_attributes() == before


def test_a_missing_surface_is_reported_before_anything_is_patched(tmp_path, monkeypatch, caplog):
    """A dry run of every patch finds the surface a newer release lacks: it is logged before the first
    patch is applied, and its own patch is never tried."""
    for module in _builder_modules():
        monkeypatch.delattr(module, "_get_param_groups")
    applied, instrument = [], Instrumentor.instrument

    def noting_what_was_logged(self, runtime):
        applied.append((self.name, caplog.text))
        instrument(self, runtime)

    monkeypatch.setattr(Instrumentor, "instrument", noting_what_was_logged)
    with caplog.at_level(logging.WARNING, logger="gradnan"):
        installation = gradnan.install(out_dir=str(tmp_path))
    assert [name for name, _ in applied] == installation.patched == PATCH_NAMES[1:]
    first_logged = applied[0][1]
    assert f"left unpatched (tested: {MEGATRON_CORE}): param_groups: no _get_param_groups" in first_logged
    assert "MISSING" not in first_logged  # the summary comes after the patches


def test_options_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_OUT_DIR", str(tmp_path / "from_env"))
    monkeypatch.setenv("GRADNAN_MAX_PARAMS_PER_RECORD", "5")
    installation = gradnan.install()
    assert installation.out_dir == str(tmp_path / "from_env")
    assert installation.config.max_params_per_record == 5


def test_keyword_arguments_beat_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_OUT_DIR", str(tmp_path / "from_env"))
    assert gradnan.install(out_dir=str(tmp_path / "kw")).out_dir == str(tmp_path / "kw")


def test_a_config_object_leaves_the_variables_it_was_not_given_in_force(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADNAN_FRAMES", "detect")
    installation = gradnan.install(config=gradnan.GradnanConfig(out_dir=str(tmp_path)))
    assert (installation.out_dir, installation.config.frames) == (str(tmp_path), "detect")


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

    name = "buggy"
    description = "buggy surface"

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
    assert installation.missing == {} and list(installation.failed) == ["buggy"]
    assert "FAILED (a gradnan bug, please report it): buggy surface [buggy]: " in installation.summary()


# --- disabled_patches ---------------------------------------------------------------------------


def test_every_patch_has_a_short_stable_name_apart_from_its_description():
    instrumentors = all_instrumentors()
    assert [instrumentor.name for instrumentor in instrumentors] == PATCH_NAMES
    assert all(instrumentor.description not in ("?", instrumentor.name) and instrumentor.without != "?"
               for instrumentor in instrumentors)


@pytest.mark.parametrize("disabled", PATCH_NAMES)
def test_a_disabled_patch_leaves_its_surface_alone_and_the_others_patched(tmp_path, disabled):
    before = _surfaces()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    installation = gradnan.install(out_dir=str(tmp_path), disabled_patches=(disabled,), frames="detect")
    installation.start(model=model)  # frame tracing hooks the model's modules through module_hooks
    during = _surfaces()
    for patch, attributes in before.items():
        changed = [key for key, original in attributes.items() if during[patch][key] is not original]
        assert bool(changed) == (patch != disabled), patch
    assert bool(model[0]._forward_hooks) == (disabled != "module_hooks")
    assert installation.runtime.keeps_steps() == (disabled != "module_hooks")  # the rerun needs module hooks
    assert installation.disabled == [disabled]
    assert installation.patched == [name for name in PATCH_NAMES if name != disabled]
    gradnan.uninstall()
    after = _surfaces()
    assert all(after[patch][key] is original for patch, attributes in before.items()
               for key, original in attributes.items())
    assert not model[0]._forward_hooks and not model._forward_hooks


def test_a_disabled_patch_is_logged_once_at_info_with_what_it_costs(tmp_path, caplog, monkeypatch):
    for launcher_rank in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(launcher_rank, raising=False)
    with caplog.at_level(logging.INFO, logger="gradnan"):
        gradnan.install(out_dir=str(tmp_path), disabled_patches=("schedules", "module_hooks"))
    disabled = [record for record in caplog.records if "disabled (disabled_patches)" in record.getMessage()]
    assert [record.levelno for record in disabled] == [logging.INFO, logging.INFO]
    assert "patch schedules disabled" in disabled[0].getMessage()
    assert disabled[0].getMessage().endswith("no in-place rerun of the failing step")
    assert "patch module_hooks disabled" in disabled[1].getMessage()


def test_an_unknown_patch_name_is_an_error_listing_the_valid_ones_and_patches_nothing(tmp_path):
    before = _megatron_attributes()
    with pytest.raises(ConfigError, match=f"names no patch: schedule \\(valid: {', '.join(PATCH_NAMES)}\\)"):
        gradnan.install(out_dir=str(tmp_path), disabled_patches=("schedules", "schedule"))
    assert gradnan.current() is None
    assert _megatron_attributes() == before


def test_disabled_patches_are_read_from_the_environment_and_a_config_file(tmp_path):
    environ = {"GRADNAN_DISABLED_PATCHES": " schedules, module_hooks "}
    assert resolve_config(environ=environ).disabled_patches == ("schedules", "module_hooks")
    (tmp_path / "gradnan.toml").write_text('disabled_patches = ["grad_sync", "loss_scale"]\n')
    (tmp_path / "gradnan.json").write_text('{"disabled_patches": "grad_sync,loss_scale"}')
    for name in ("gradnan.toml", "gradnan.json"):
        config = resolve_config(environ={}, config_file=str(tmp_path / name))
        assert config.disabled_patches == ("grad_sync", "loss_scale")
    (tmp_path / "bad.json").write_text('{"disabled_patches": 3}')
    with pytest.raises(ConfigError, match="field 'disabled_patches' must be a list of names"):
        resolve_config(environ={}, config_file=str(tmp_path / "bad.json"))
