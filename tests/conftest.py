"""Fixtures shared by the test files."""

from __future__ import annotations

import os

import pytest

from .helpers import environ_without_gradnan


@pytest.fixture
def no_gradnan_variables(monkeypatch):
    """No ``GRADNAN_*`` variable of the caller's shell reaches ``install()``: only what a test passes."""
    for key in [key for key in os.environ if key.startswith("GRADNAN_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def clean_environ():
    """``os.environ`` less the ``GRADNAN_*`` variables, for a child process."""
    return environ_without_gradnan()


UNIT_COORDS = {"global_rank": 0, "world_size": 1, "host": "h", "device": "cpu", "tp": 0, "pp": 0, "dp": 0,
               "tp_size": 1, "pp_size": 1, "dp_size": 1}


@pytest.fixture
def make_runtime(tmp_path):
    """A runtime at unit level, writing into ``tmp_path``: ``make_runtime(named_modules, **options)``;
    ``named_modules`` stands for the model's modules by global name."""
    from gradnan.config import GradnanConfig
    from gradnan.training.events import ModelFacts
    from gradnan.training.runtime import Runtime

    def make(named_modules=(), **options):
        modules = list(named_modules)
        facts = ModelFacts(coords=lambda: dict(UNIT_COORDS), versions=lambda: {},
                           named_modules=lambda chunks: modules, **options.pop("facts", {}))
        return Runtime(GradnanConfig(**{"out_dir": str(tmp_path), **options}), facts)

    return make


@pytest.fixture
def megatron_lm_args(monkeypatch):
    """Megatron-LM's global args as its ``train()`` holds them (``curr_iteration`` set by the loop, after the
    optimizer is built). Megatron-LM's training package is not installable here (only megatron-core is):
    its ``global_vars`` module is stood in for by a module object."""
    import sys
    import types

    args = types.SimpleNamespace()
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = args
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    return args
