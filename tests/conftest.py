"""Fixtures shared by the test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from .helpers import environ_without_gradnan

# The property tests draw the same examples on every machine and every run (a failure is the code's, not
# the draw's); HYPOTHESIS_PROFILE=explore draws fresh ones on each run, to hunt for new failures.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def no_gradnan_variables(monkeypatch):
    """No ``GRADNAN_*`` variable of the caller's shell reaches ``install()``: only what a test passes."""
    for key in [key for key in os.environ if key.startswith("GRADNAN_")]:
        monkeypatch.delenv(key)


@pytest.fixture(scope="module")
def wandb_offline(tmp_path_factory):
    """W&B as on a machine without a network: offline (a run folder that ``wandb sync`` uploads later),
    quiet, under a folder of the module's own (``WANDB_DIR``, returned), for the jobs it spawns."""
    directory = tmp_path_factory.mktemp("wandb_dir")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_DIR", str(directory))
        patch.setenv("WANDB_SILENT", "true")
        yield directory


@pytest.fixture
def clean_environ():
    """``os.environ`` less the ``GRADNAN_*`` variables, for a child process."""
    return environ_without_gradnan()


UNIT_COORDS = {"global_rank": 0, "world_size": 1, "host": "h", "device": "cpu", "tp": 0, "pp": 0, "dp": 0,
               "tp_size": 1, "pp_size": 1, "dp_size": 1}


@pytest.fixture
def make_runtime(tmp_path):
    """A runtime at unit level, writing into ``tmp_path``: ``make_runtime(named_modules, **options)``;
    ``named_modules`` stands for the model's modules by global name. It may hook them (the ``module_hooks``
    patch is applied to it)."""
    from gradnan.config import GradnanConfig
    from gradnan.events import ModelFacts
    from gradnan.patches.module_hooks import ModuleHooksInstrumentor
    from gradnan.training.runtime import Runtime

    def make(named_modules=(), **options):
        modules = list(named_modules)
        facts = ModelFacts(coords=lambda: dict(UNIT_COORDS), versions=lambda: {},
                           named_modules=lambda chunks: modules, **options.pop("facts", {}))
        runtime = Runtime(GradnanConfig(**{"out_dir": str(tmp_path), **options}), facts)
        ModuleHooksInstrumentor().instrument(runtime)
        return runtime

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


@pytest.fixture
def no_hang():
    """A test that would block (a FIFO opened for reading waits for a writer) fails after 60 s instead."""
    import signal

    def hung(signum, frame):
        raise TimeoutError("blocked for 60 s: a read that should have been refused at once")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def crafted_bundle():
    """``crafted_bundle(path, kind, victim=None, edit=None)``: a capture bundle written by
    ``gradnan.formats.bundle.write``. ``kind="healthy"``: a recorded ``Linear`` call; ``"from_file"``: the
    exploit, a trace mapping ``victim`` into memory (``aten.from_file``, shared) and copying a payload
    into it. ``edit(manifest, tensors)`` changes either before writing."""
    import torch

    from gradnan.formats import bundle
    from gradnan.training.recorder import OpRecorder

    def recorded_linear():
        torch.manual_seed(0)
        module, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
        recorder = OpRecorder()
        recorder.mark_inputs([x], "args")
        recorder.mark_inputs(dict(module.named_parameters()), "param")
        with recorder:
            out = module(x)
        trace = recorder.result(out)
        return trace.to_json(), {**trace.leaves, "out.0": out.detach()}

    def from_file(victim):
        payload = torch.frombuffer(bytearray(b"import os; os.system('touch owned')  #"), dtype=torch.uint8)
        ops = [{"op": "aten.from_file.default", "args": [str(victim)],
                "kwargs": {"shared": True, "size": payload.numel(), "dtype": {"dtype": "uint8"}},
                "out": {"t": "%0"}},
               {"op": "aten.copy_.default", "args": [{"t": "%0"}, {"t": "args.0"}], "kwargs": {},
                "out": {"t": "%1"}}]
        trace = {"schema": "gradnan.trace", "version": 1, "ops": ops, "outputs": {"t": "%1"},
                 "first_nonfinite": None,
                 "leaves": {"args.0": {"shape": [payload.numel()], "dtype": "uint8"}}}
        return trace, {"args.0": payload}

    def make(path, kind, victim=None, edit=None):
        trace, tensors = recorded_linear() if kind == "healthy" else from_file(victim)
        manifest = {"module": {"path": "decoder.linear", "class": "Linear"}, "step": 1,
                    "rank": dict(UNIT_COORDS), "run": {"id": None, "attempt": "0", "started": 1.7e9},
                    "created": 1.7e9, "trigger": "always",
                    "outputs": 1 if kind == "healthy" else 0, "recompute": False, "trace": trace,
                    "seen": {"outputs_nonfinite": False}}
        if edit is not None:
            edit(manifest, tensors)
        return bundle.write(path, manifest, tensors)

    return make


@pytest.fixture(scope="session")
def mlp_bundle(tmp_path_factory):
    """A real capture bundle (``gradnan.trace`` v4, with digests): ``decoder.layers.0.mlp`` of the tiny
    Megatron-Core GPT, one process, bf16, step 1. Its trace: view, t, view, mm, _unsafe_view, add, gelu
    (op 6), t, view, mm, _unsafe_view, view."""
    from gradnan.testing.toy import launch
    from gradnan.testing.toy_job import TinyGPTJob

    out = tmp_path_factory.mktemp("mlp_capture")
    launch(TinyGPTJob(world_size=1, dtype="bf16", steps=1, quiet=True,
                      gradnan={"out_dir": str(out), "capture_modules": "decoder.layers.0.mlp",
                               "capture_steps": "1"}))
    (bundle,) = (out / "bundles").glob("*/*")
    return bundle


def make_python_environment(root, startup=""):
    """A real virtual environment at ``root`` (``python -m venv --without-pip``, a second 'stack') that sees
    this environment's packages (a ``.pth`` naming its site-packages) and runs ``startup`` (Python source,
    e.g. a ``torch.library`` registration that changes one aten kernel) at every start; returns the path
    of its ``python``."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(python), "-c", where], check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip())
    (site / "a_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if startup:
        (site / f"{root.name}_startup.py").write_text(startup)
        (site / f"z_{root.name}.pth").write_text(f"import {root.name}_startup\n")
    return python


@pytest.fixture
def python_environment(tmp_path):
    """``make(name, startup="")``: ``make_python_environment`` under ``tmp_path``."""
    def make(name, startup=""):
        return make_python_environment(tmp_path / name, startup)

    return make


# One environment, each wrapper script naming the operator it changes: at its boundary (the
# ADInplaceOrView key, under autograd and above the kernel, so that neither the backward nor the calls a
# kernel makes inside itself change), its floating outputs scaled by 1 + 2^-7 (one bf16 ulp and more),
# its boolean ones negated, its integer ones plus one; in place for an in-place operator.
CHANGER = '''
import os

import torch

_NAME = os.environ.get("CHANGED_OPERATOR")
if _NAME:
    _, _packet, _overload = _NAME.split(".")
    _op = getattr(getattr(torch.ops.aten, _packet), _overload)
    _in_place = any(ret.alias_info is not None and ret.alias_info.is_write for ret in _op._schema.returns)

    def _change(value):
        if isinstance(value, (list, tuple)):
            return type(value)(_change(item) for item in value)
        if not isinstance(value, torch.Tensor):
            return value
        if value.dtype == torch.bool:
            return value.logical_not_() if _in_place else value.logical_not()
        if value.is_floating_point():
            return value.mul_(1 + 2 ** -7) if _in_place else value * (1 + 2 ** -7)
        return value.add_(1) if _in_place else value + 1

    def _changed(*args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return _change(_op(*args, **kwargs))

    _LIBRARY = torch.library.Library("aten", "IMPL")
    _LIBRARY.impl(_NAME.split(".", 1)[1].removesuffix(".default"), _changed, "ADInplaceOrView")
'''


@pytest.fixture(scope="session")
def changed(tmp_path_factory):
    """``changed(operator)``: a wrapper script (``#!/bin/sh``) that runs one environment's python with
    ``CHANGED_OPERATOR`` set, that environment changing that one operator (``CHANGER``)."""
    folder = tmp_path_factory.mktemp("changed")
    python = make_python_environment(folder / "changer", CHANGER)

    def wrapper(operator):
        script = folder / f"{operator}.sh"
        script.write_text(f'#!/bin/sh\nCHANGED_OPERATOR={operator} exec {python} "$@"\n')
        script.chmod(0o755)
        return script

    return wrapper


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory) -> Path:
    """Three run directories, under the returned folder: ``data``, a forward failure in megatron-core's mock
    data with its rerun, samples, kept micro-batch and bundle; ``device``, a transient one with NVML's
    reading of the device; ``synthetic``, a self-test result, a probe and a bundle (every other kind). For
    the tests that plant hostile values in every field of what real runs write (one launch for them all)."""
    from gradnan.testing.toy import launch_many

    from .test_device_health import TRANSIENT
    from .test_samples import BASE
    from .test_untrusted import run_files, valid_documents, write_run

    root = tmp_path_factory.mktemp("real_runs")
    launch_many([
        BASE.with_(poisoned_samples=(13,), gradnan={"out_dir": str(root / "data"), "frames": "detect"}),
        TRANSIENT.with_(gradnan={"out_dir": str(root / "device")},
                        prepare="tests.test_device_health:stand_in_nvml")])
    write_run(root / "synthetic", run_files(valid_documents()))
    return root
