"""What training went on with is not always what the module returned: a forward hook may replace the
output, an operation outside the module may change it in place. The capture keeps both, and the replay
says so instead of "matches: yes" (issue 24)."""

from __future__ import annotations

import json

import pytest
import torch

from gradnan.formats import bundle
from gradnan.offline.replay.command import format_text, replay_bundle
from gradnan.patches.module_hooks import ModuleHooks
from gradnan.training.error_guard import ErrorGuard
from gradnan.training.module_capture import ModuleCapture, bundle_contents

from .conftest import UNIT_COORDS


def _captured(tmp_path, change):
    """A ``Linear`` captured in training while ``change(module, x)`` runs it (and perhaps alters what
    comes out), written as a bundle the way training writes one, and its replay."""
    torch.manual_seed(0)
    module, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    capture = ModuleCapture("decoder.linear", module, "always", ErrorGuard(True), ModuleHooks())
    used = change(module, capture, x)
    manifest, tensors = bundle_contents(capture, capture.chosen_call(), {}, {}, lambda param: {})
    manifest.update({"step": 1, "rank": dict(UNIT_COORDS), "run": {"id": None, "attempt": "0",
                                                                    "started": 1.7e9}})
    written = bundle.write(tmp_path / "bundle", manifest, tensors)
    capture.detach()
    return used, manifest, replay_bundle(written, device="cpu")


def _untouched(module, capture, x):
    capture.attach()
    return module(x)


def _poisoning_hook(module, capture, x):
    """A forward hook registered before the capture (as a user's or a library's would be) replaces the
    output with a NaN in one element."""
    module.register_forward_hook(lambda m, args, out: out.index_fill(1, torch.tensor([0]), float("nan")))
    capture.attach()
    return module(x)


def _changed_in_place(module, capture, x):
    """An operation after the call overwrites the returned tensor in place."""
    capture.attach()
    out = module(x)
    with torch.no_grad():
        out.mul_(float("inf"))
    return out


def _storage_swapped(module, capture, x):
    """Megatron's pipeline frees a sent output by swapping its storage for one element
    (``deallocate_output_tensor``): nothing to compare, nothing changed."""
    capture.attach()
    out = module(x)
    out.data = torch.empty((1,))
    return out


def test_an_untouched_output_matches_and_no_change_is_reported(tmp_path):
    _, manifest, result = _captured(tmp_path, _untouched)
    assert manifest["outputs_changed"] == [] and result["outputs_changed_after_return"] == []
    assert result["verdict"] == "healthy" and result["replay_matches_saved_outputs"]
    assert "Training went on with" not in format_text(result)


@pytest.mark.parametrize("change, by, wording", [
    (_poisoning_hook, "forward_hook", "by a forward hook on the module"),
    (_changed_in_place, "in_place", "in place, by an operation outside the module"),
])
def test_a_nonfinite_output_made_after_the_module_returned_is_named(tmp_path, change, by, wording):
    used, manifest, result = _captured(tmp_path, change)
    assert manifest["outputs_changed"] == [{"output": 0, "by": by, "nonfinite": True}]
    assert manifest["seen"]["outputs_nonfinite"] is False  # the module's own output was finite
    _, tensors = bundle.load(tmp_path / "bundle")
    assert torch.equal(torch.isnan(tensors["used_out.0"]), torch.isnan(used.detach()))
    assert result["verdict"] == "changed_after_return" and not result["reproduces"]
    assert result["replay_matches_saved_outputs"]  # with the module's own output
    text = format_text(result)
    assert ("Training went on with other values: output 0 NON-FINITE, changed after the module returned"
            f" {wording}") in text
    assert json.loads(json.dumps(result))["outputs_changed_after_return"][0]["by"] == by


def test_an_output_whose_storage_was_swapped_is_not_called_changed(tmp_path):
    _, manifest, result = _captured(tmp_path, _storage_swapped)
    assert manifest["outputs_changed"] == [] and result["verdict"] == "healthy"


@pytest.mark.parametrize("changes", [
    {"output": 0, "by": "forward_hook"},
    [{"output": -1, "by": "forward_hook", "nonfinite": True}],
    [{"output": 0, "by": "sabotage", "nonfinite": True}],
    [{"output": 0, "by": "in_place", "nonfinite": "yes"}],
])
def test_a_malformed_outputs_changed_is_refused_in_one_line(tmp_path, crafted_bundle, capsys, changes):
    from gradnan.cli import main

    written = crafted_bundle(tmp_path / "b", "healthy",
                             edit=lambda manifest, tensors: manifest.update(outputs_changed=changes))
    assert main(["replay", str(written), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'outputs_changed' must be a list" in error
