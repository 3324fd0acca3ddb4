"""What training went on with is not always what the module returned: a forward hook may replace the
output, an operation outside the module may change it in place. The capture keeps both, and the replay
says so instead of "matches: yes" (issue 24)."""

from __future__ import annotations

import json

import pytest
import torch

from gradnan.formats import bundle
from gradnan.offline.replay.command import replay_bundle
from gradnan.offline.replay.text import format_text
from gradnan.patches.module_hooks import ModuleHooks
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob
from gradnan.training.error_guard import ErrorGuard
from gradnan.training.module_capture import ModuleCapture, bundle_contents, parameter_names

from .conftest import UNIT_COORDS


class SkipBiasLinear(torch.nn.Linear):
    """Returns ``(x @ weight.T, bias)``, the bias itself, as megatron-core's linear layers built with
    ``skip_bias_add`` do (the caller adds it, fused with what comes next)."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


def _captured(tmp_path, change, linear=torch.nn.Linear):
    """A ``linear`` captured in training while ``change(module, capture, x)`` runs it (and perhaps alters
    what comes out), written as a bundle the way training writes one, and its replay."""
    torch.manual_seed(0)
    module, x = linear(3, 2), torch.randn(4, 3)
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


def _bias_updated(gradient):
    """A training step: forward, backward from the sum of the output and the returned bias, the bias's
    gradient set to ``gradient`` (NaN: a corrupted gradient), then the optimizer's update in place."""
    def step(module, capture, x):
        capture.attach()
        out, bias = module(x)
        (out + bias).sum().backward()
        module.bias.grad.fill_(gradient)
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        return bias
    return step


def _bias_hooked(module, capture, x):
    """A forward hook registered before the capture writes NaN into the returned bias in place, before
    anything downstream reads it: a corruption, the bias being a parameter or not."""
    def poison(_module, _args, out):
        out[1].data.fill_(float("nan"))

    module.register_forward_hook(poison)
    capture.attach()
    return module(x)[1]


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


@pytest.mark.parametrize("gradient, after", [(1.0, "finite"), (float("nan"), "NON-FINITE")])
def test_a_returned_parameter_changed_by_the_update_is_named_not_a_corruption(tmp_path, gradient, after):
    _, manifest, result = _captured(tmp_path, _bias_updated(gradient), SkipBiasLinear)
    assert manifest["outputs_parameters"] == [None, "bias"]
    assert manifest["outputs_changed"] == [{"output": 1, "by": "in_place", "nonfinite": after != "finite"}]
    _, tensors = bundle.load(tmp_path / "bundle")
    assert "used_out.1" not in tensors  # the updated bias is not what training went on with
    assert result["outputs_changed_after_return"][0]["updated_parameter"] == "bias"
    assert result["verdict"] == "healthy" and "changed" not in result["summary"]
    text = format_text(result)
    assert "Training went on with" not in text
    assert ("Output 1 is the module's parameter bias, returned as itself (as a linear layer built with"
            " skip_bias_add returns its bias): it changed after the call because training updated the"
            f" parameter (the optimizer step), not a second corruption; the update left it {after}") in text


def test_an_output_is_a_parameter_where_it_is_that_tensor_or_one_on_all_of_its_data():
    module = SkipBiasLinear(3, 2)
    bias = module.bias
    outputs = [bias, bias.detach(), bias.detach().clone(), bias[:1], module.weight.t()]
    assert parameter_names(module, outputs) == ["bias", "bias", None, None, None]


def test_an_update_that_leaves_a_returned_parameter_nonfinite_does_not_choose_the_call():
    """An incident capture waits for a call with something non-finite of its own: the NaN the update
    wrote into the bias is the next call's input."""
    module, x = SkipBiasLinear(3, 2), torch.randn(4, 3)
    capture = ModuleCapture("decoder.linear", module, "incident", ErrorGuard(True), ModuleHooks())
    _bias_updated(float("nan"))(module, capture, x)
    assert capture.calls and capture.chosen_call() is None
    module(x)
    assert capture.chosen_call() is capture.calls[1]
    capture.detach()


def test_a_returned_parameter_changed_by_a_forward_hook_is_still_a_corruption(tmp_path):
    _, manifest, result = _captured(tmp_path, _bias_hooked, SkipBiasLinear)
    assert manifest["outputs_changed"] == [{"output": 1, "by": "forward_hook", "nonfinite": True}]
    assert result["outputs_changed_after_return"][0]["updated_parameter"] is None
    assert result["verdict"] == "changed_after_return"
    assert ("Training went on with other values: output 1 NON-FINITE, changed after the module returned by a"
            " forward hook on the module") in format_text(result)


def test_a_bundle_without_outputs_parameters_reads_them_from_its_trace(tmp_path):
    """Bundles written before ``outputs_parameters``: an output the trace names as a ``param.`` leaf is
    that parameter."""
    _, manifest, _ = _captured(tmp_path, _bias_updated(1.0), SkipBiasLinear)
    del manifest["outputs_parameters"]
    bundle.write(tmp_path / "older", manifest, bundle.load(tmp_path / "bundle")[1])
    result = replay_bundle(tmp_path / "older", device="cpu")
    assert result["outputs_changed_after_return"][0]["updated_parameter"] == "bias"
    assert "Training went on with" not in format_text(result)


@pytest.mark.parametrize("parameters", [["bias"], [None, "bias"], "bias", [3]])
def test_a_malformed_outputs_parameters_is_refused_in_one_line(tmp_path, crafted_bundle, capsys, parameters):
    from gradnan.cli import main

    written = crafted_bundle(tmp_path / "b", "healthy",
                             edit=lambda manifest, tensors: manifest.update(outputs_parameters=parameters))
    if parameters == ["bias"]:  # one output, one name: accepted
        assert main(["replay", str(written), "--device", "cpu"]) == 0
        return
    assert main(["replay", str(written), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'outputs_parameters' must be a list of 1 parameter names" in error


FC1 = "decoder.layers.0.mlp.linear_fc1"  # a ColumnParallelLinear built with skip_bias_add: (output, bias)


@pytest.fixture(scope="module")
def megatron_bundles(tmp_path_factory):
    """Real megatron-core, one process each, ``linear_fc1`` captured at step 2: ``bias``, its bias's
    reduced gradient NaN at that step (the update writes NaN into the bias it returned); ``hook``, a
    forward hook on it writes NaN into its output (the rerun's capture sees the hook)."""
    root = tmp_path_factory.mktemp("outputs_changed")
    launch_many([TinyGPTJob(world_size=1, steps=2, quiet=True, injections=(injection,),
                            gradnan={"out_dir": str(root / name), "capture_modules": FC1,
                                     "capture_steps": "2"})
                 for name, injection in [("bias", Injection(0, 2, FC1 + ".bias", where="main_grad", index=3)),
                                         ("hook", Injection(0, 2, FC1, where="forward", index=3))]])
    return root


@pytest.mark.slow
def test_megatron_skip_bias_add_bias_updated_after_the_call_is_named_not_a_corruption(megatron_bundles):
    [written] = (megatron_bundles / "bias" / "bundles").glob("*/*")
    result = replay_bundle(written, device="cpu")
    assert result["module"]["class"] == "ColumnParallelLinear"
    assert result["outputs_changed_after_return"] == [
        {"output": 1, "by": "in_place", "nonfinite": True, "updated_parameter": "bias"}]
    assert result["verdict"] == "healthy"
    text = format_text(result)
    assert "Training went on with" not in text and "outside the module" not in text
    assert "Output 1 is the module's parameter bias" in text and "the update left it NON-FINITE" in text


@pytest.mark.slow
def test_megatron_output_changed_by_a_forward_hook_is_still_reported(megatron_bundles):
    bundles = sorted((megatron_bundles / "hook" / "bundles").glob("*/*"))
    manifests = [json.loads((b / "manifest.json").read_text()) for b in bundles]
    [written] = [b for b, manifest in zip(bundles, manifests) if manifest["trigger"] == "rerun"]
    result = replay_bundle(written, device="cpu")
    assert result["outputs_changed_after_return"] == [
        {"output": 0, "by": "forward_hook", "nonfinite": True, "updated_parameter": None}]
    assert result["verdict"] == "changed_after_return"
    assert ("Training went on with other values: output 0 NON-FINITE, changed after the module returned by a"
            " forward hook on the module") in format_text(result)
