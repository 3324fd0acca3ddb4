"""Issue: capture the implicated module and replay the failure offline (real megatron-core, TP=2).

- fp16 overflow driven in one rank's MLP: a bundle for that module on that rank; replay in a fresh
  process reproduces it in fp16, not in float64, and names the operator;
- a NaN put into a gradient once (after the module computed it): replay does not reproduce it;
- capture across activation recompute with keyword arguments (attention mask, rotary embeddings);
- a tampered bundle (a pickled object inside) is refused with one line.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob

from .helpers import printed_commands

# real gloo jobs or subprocesses: `pytest -m "not slow"` skips them
pytestmark = [pytest.mark.slow, pytest.mark.megatron_surface]

OVERFLOW_WEIGHT = "decoder.layers.1.mlp.linear_fc1.weight"
CORRUPTED_MODULE = "decoder.layers.0.mlp.linear_fc1"
ATTENTION = "decoder.layers.0.self_attention"


def _bundles(run_dir: Path, rank: int):
    return sorted((run_dir / "bundles").glob(f"rank{rank:05d}_*/*"))


def _replay(bundle: Path, *extra):
    result = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(bundle), *extra],
                            capture_output=True, text=True, timeout=300)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    jobs = [
        TinyGPTJob(tp=2, dtype="fp16", steps=4,
                   gradnan={"out_dir": str(root / "overflow"), "skip_warn_after": 1},
                   injections=(Injection(1, 2, OVERFLOW_WEIGHT, "60000", where="scale_to"),)),
        # the same without the rerun: the finder watches later steps and captures on both TP ranks
        TinyGPTJob(tp=2, dtype="fp16", steps=4, gradnan={"out_dir": str(root / "overflow_no_rerun"),
                                                         "skip_warn_after": 1, "rerun": "off"},
                   injections=(Injection(1, 2, OVERFLOW_WEIGHT, "60000", where="scale_to"),)),
        TinyGPTJob(tp=2, dtype="fp32", steps=3,
                   gradnan={"out_dir": str(root / "one_off"), "capture_modules": CORRUPTED_MODULE,
                            "capture_retain": True, "capture_ranks": "1"},
                   injections=(Injection(1, 2, CORRUPTED_MODULE + ".weight", "nan", where="main_grad",
                                         index=7),)),
        TinyGPTJob(dtype="bf16", steps=3, recompute=True, position_embedding="rope",  # DP=2: no TP collective
                   gradnan={"out_dir": str(root / "recompute"), "capture_modules": ATTENTION,
                            "capture_steps": "2", "capture_ranks": "0"}),
    ]
    launch_many(jobs)
    return root


def test_fp16_overflow_in_one_ranks_mlp_is_captured_there_and_replays_as_precision(runs):
    [bundle, *_] = _bundles(runs / "overflow", 1)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["module"]["path"].startswith("decoder.layers.1.mlp")
    assert manifest["rank"]["global_rank"] == 1 and manifest["rank"]["tp"] == 1
    # the forward-origin finder (frame tracing, one host read per step) chose the module: its frame is
    # the last of the context, the first whose weights and inputs are finite and outputs are not
    assert manifest["forward_origin"] == manifest["module"]["path"] == manifest["frames"][-1]["module"]
    last = manifest["frames"][-1]
    finite = {e["kind"]: all(isinstance(e[k], float) for k in ("abs_min", "abs_max")) for e in last["entries"]
              if e["kind"] != "output"}
    assert finite == {"weight": True, "input": True}
    assert "inf" in [e["abs_max"] for e in last["entries"] if e["kind"] == "output"]
    assert manifest["params"]["weight"]["tensor_parallel"] is True  # a TP shard, with its partition
    assert manifest["params"]["weight"]["partition_dim"] == 0
    result = _replay(bundle, "--json")
    assert result.returncode == 0, result.stderr
    replayed = json.loads(result.stdout)
    assert replayed["verdict"] == "precision"
    assert replayed["runs"]["captured"]["outputs_nonfinite"]
    assert not replayed["runs"]["float64"]["outputs_nonfinite"]
    assert "mm" in replayed["runs"]["captured"]["first_nonfinite"]["op"]
    assert replayed["replay_matches_saved_outputs"]


def test_a_one_off_corruption_does_not_reproduce(runs):
    bundles = _bundles(runs / "one_off", 1)
    [bundle] = [b for b in bundles if b.name.startswith("step0000002_")]  # the failing step itself
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["module"]["path"] == CORRUPTED_MODULE and manifest["trigger"] == "retain"
    assert manifest["step"] == 2 and manifest["seen"]["observed_nonfinite"]
    replayed = json.loads(_replay(bundle, "--json").stdout)
    assert replayed["verdict"] == "not_reproduced"
    assert replayed["reproduces"] is False
    assert not _bundles(runs / "one_off", 0)  # capture_ranks=1


def test_capture_across_recompute_with_keyword_arguments(runs):
    [bundle] = _bundles(runs / "recompute", 0)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["module"]["path"] == ATTENTION and manifest["step"] == 2
    assert manifest["recompute"] is True and manifest["grad_enabled"] is True
    assert manifest["grad_inputs"] and manifest["grad_outputs"]  # gradients in and out of the module
    leaves = manifest["trace"]["leaves"]
    assert any(name.startswith("kwargs.attention_mask") for name in leaves)
    assert any(name.startswith("kwargs.rotary_pos_emb") for name in leaves)
    replayed = json.loads(_replay(bundle, "--json").stdout)
    assert replayed["verdict"] == "healthy" and replayed["replay_matches_saved_outputs"]  # bitwise, NaN-aware


def test_a_tampered_bundle_is_refused_in_one_line(runs, tmp_path):
    import shutil

    source = _bundles(runs / "one_off", 1)[0]
    bundle = tmp_path / "tampered"
    shutil.copytree(source, bundle)
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"param.weight": torch.ones(2), "evil": Payload()}, bundle / "tensors.pt",
               pickle_module=pickle)
    result = _replay(bundle)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "refused" in result.stderr
    assert not marker.exists()


def test_from_report_to_replay_in_two_commands(runs):
    """The documented workflow: `gradnan report RUN_DIR` names the bundle and the command; run it."""
    report = subprocess.run([sys.executable, "-m", "gradnan", "report", str(runs / "overflow")],
                            capture_output=True, text=True, timeout=120)
    lines = report.stdout.splitlines()
    origin = next(number for number, line in enumerate(lines) if line.startswith("Origin ("))
    assert origin < 8 and lines[origin + 1].startswith("  rank 1 (tp1 pp0 dp0)")  # near the top
    command, bisect = printed_commands(report.stdout, "replay")  # the replay, then the same under two stacks
    assert bisect == [*command, "--against", "OLD_STACK/bin/python", "--against", "NEW_STACK/bin/python"]
    replayed = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr
    assert "Verdict: precision" in replayed.stdout and "decoder.layers.1.mlp" in replayed.stdout


def test_an_armed_capture_whose_failure_does_not_recur_stops_watching(make_runtime):
    """Unit level (a plain module): capture and finder detach themselves after their step budget."""
    from gradnan.training.capture import ARMED_STEPS, FINDER_STEPS

    module = torch.nn.Linear(4, 4)
    manager = make_runtime([("lin", module)]).captures
    manager.on_detection(1, forward_pattern=False, first_param="lin.weight", arm=True)
    manager.arm_forward_origin()
    assert "forward" in vars(module) and manager.finder is not None and module._forward_hooks
    for step in range(max(ARMED_STEPS, FINDER_STEPS)):
        module(torch.ones(2, 4)).sum().backward()
        manager.end_step(step + 2, step + 3)
    assert "forward" not in vars(module) and not manager.captures and manager.finder is None
    assert not module._forward_hooks


def test_the_rerun_captures_only_the_origin_not_its_tensor_parallel_peer(runs):
    assert _bundles(runs / "overflow", 1) and not _bundles(runs / "overflow", 0)
    manifest = json.loads((_bundles(runs / "overflow", 1)[0] / "manifest.json").read_text())
    assert (manifest["trigger"], manifest["step"]) == ("rerun", 2)  # the failing step itself


def test_a_tensor_parallel_peer_that_received_the_overflow_is_not_blamed(runs):
    """Without the rerun, rank 0's fc2 is captured at a later step: it got the Inf through the
    row-parallel all-reduce, and replay finds its own computation finite."""
    records = [json.loads(line) for path in (runs / "overflow_no_rerun" / "records").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    assert records and not [r for r in records if r["kind"] == "rerun"]  # rerun="off"
    bundles = [b for b in _bundles(runs / "overflow_no_rerun", 0) if "linear_fc2" in b.name]
    assert bundles
    replayed = json.loads(_replay(bundles[0], "--json").stdout)
    assert replayed["verdict"] == "not_reproduced"
    assert "from outside it" in replayed["summary"] and not replayed["replay_matches_saved_outputs"]


def test_replay_of_an_unreplayable_bundle_is_one_line(runs, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(_bundles(runs / "one_off", 1)[0], bundle)
    for device, message in (("cuda:7", "no such CUDA device"), ("warp-drive", "replay runs on cpu, cuda"),
                            ("mps", "replay runs on cpu, cuda")):
        result = _replay(bundle, "--device", device)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr


def _failing_capture(monkeypatch, strict: bool):
    """A capture of a plain module whose recording fails inside the training step (as a clone that runs
    out of memory would)."""
    from gradnan.patches.module_hooks import ModuleHooks
    from gradnan.training.error_guard import ErrorGuard
    from gradnan.training.module_capture import ModuleCapture

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ModuleCapture, "_keep", out_of_memory)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    return module, ModuleCapture("lin", module, "always", ErrorGuard(strict), ModuleHooks()).attach()


def test_a_failing_capture_leaves_the_step_unchanged_and_is_logged_once_per_installation(monkeypatch, caplog):
    x = torch.ones(2, 4)
    for _ in range(2):  # two installations one after the other: each says it once (no process-wide memory)
        module, capture = _failing_capture(monkeypatch, strict=False)
        expected = torch.nn.functional.linear(x, module.weight, module.bias)
        with caplog.at_level("ERROR", logger="gradnan"):
            assert torch.equal(module(x), expected) and torch.equal(module(x), expected)
        capture.detach()
    errors = [r.getMessage() for r in caplog.records if "internal error in capture" in r.getMessage()]
    assert len(errors) == 2 and "CUDA out of memory (simulated)" in errors[0]


def test_the_old_capture_mode_name_still_works_with_one_deprecation_warning(monkeypatch, caplog):
    """``on_nonfinite`` clashed with the configuration field of that name; the mode is now ``incident``."""
    from gradnan.patches.module_hooks import ModuleHooks
    from gradnan.training import module_capture
    from gradnan.training.error_guard import ErrorGuard

    monkeypatch.setattr(module_capture, "_warned_renames", set())
    with caplog.at_level("WARNING", logger="gradnan"):
        modes = [module_capture.ModuleCapture("lin", torch.nn.Linear(2, 2), "on_nonfinite", ErrorGuard(False),
                                              ModuleHooks()).mode for _ in range(2)]
    assert modes == ["incident", "incident"]
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings == ["capture mode 'on_nonfinite' is deprecated, use 'incident'"
                        " ('on_nonfinite' is also the name of a configuration field)"]


def test_a_failing_capture_fails_the_step_under_strict(monkeypatch):
    from gradnan.errors import InternalError

    module, _ = _failing_capture(monkeypatch, strict=True)
    with pytest.raises(InternalError, match="internal error in capture: RuntimeError: CUDA out of memory"):
        module(torch.ones(2, 4))


def test_a_detached_capture_leaves_the_module_as_it_found_it():
    """The capture's ``forward`` and gradient hooks go through the undo log: nothing of them is left."""
    from gradnan.patches.module_hooks import ModuleHooks
    from gradnan.training.error_guard import ErrorGuard
    from gradnan.training.module_capture import ModuleCapture

    module = torch.nn.Linear(4, 4)
    capture = ModuleCapture("lin", module, "always", ErrorGuard(True), ModuleHooks()).attach()
    assert vars(module)["forward"] == capture._forward and module.weight._backward_hooks
    module(torch.ones(2, 4)).sum().backward()
    assert capture.chosen_call().param_grads.keys() == {"weight", "bias"}
    capture.detach()
    assert ("forward" not in vars(module) and not module.weight._backward_hooks
            and not module.bias._backward_hooks)
