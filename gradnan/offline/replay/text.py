"""A replay as people read it: ``format_text`` renders what ``replay_bundle`` decided (its ``gradnan.replay``
document), and the phrases the verdicts and the comparison of replays share."""

from __future__ import annotations

from typing import Any, Dict, List

from ...formats.layout import host_device
from ...formats.magnitude import magnitude_text
from ...formats.text import printable_lines, shell_word, untrusted


def growth_text(growth: Dict[str, Any]) -> str:
    """``grew out of line at aten.mul.Tensor (2.91 -> 3.9e28)``, or where upstream it grew."""
    magnitudes = (f"({magnitude_text(growth['inputs_abs_max'])} ->"
                  f" {magnitude_text(growth['output_abs_max'])})")
    if growth["where"] == "operator":
        return f"grew out of line at {untrusted(growth['op'])} {magnitudes}"
    inputs = growth["inputs"]
    text = (f"the module's inputs were already out of line ({untrusted(inputs['leaf'])} abs-max"
            f" {magnitude_text(inputs['abs_max'])}): the value grew before this module")
    return text + (f", in {untrusted(growth['module'])} ({untrusted(growth['class'])}) {magnitudes}"
                   if growth["module"] else "")


_CHANGED_BY = {"forward_hook": "by a forward hook on the module",
               "in_place": "in place, by an operation outside the module"}


def changed_text(changes: List[Dict[str, Any]]) -> str:
    """``output 0 NON-FINITE, changed after the module returned by a forward hook on the module``."""
    return "; ".join(f"output {change['output']}"
                     f" {'NON-FINITE' if change['nonfinite'] else 'finite but different'}, changed after the"
                     f" module returned {_CHANGED_BY[change['by']]}" for change in changes)


def not_updates(changes: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The changes after the call that are not a returned parameter's update (``_changes``): what training
    went on with instead of the module's outputs."""
    return [change for change in changes if change["updated_parameter"] is None]


def updated_parameter_text(change: Dict[str, Any]) -> str:
    """``Output 1 is the module's parameter bias, returned as itself (...): it changed after the call
    because training updated the parameter (the optimizer step), not a second corruption; ...``."""
    return (f"Output {change['output']} is the module's parameter {untrusted(change['updated_parameter'])},"
            " returned as itself (as a linear layer built with skip_bias_add returns its bias): it changed"
            " after the call because training updated the parameter (the optimizer step), not a second"
            f" corruption; the update left it {'NON-FINITE' if change['nonfinite'] else 'finite'}")


def operator_text(operator: Dict[str, Any]) -> str:
    """``aten.mm.default``, or ``the fused kernel ScaledSoftmax (megatron.core.fusions.fused_softmax, in
    decoder.layers.0.self_attention.core_attention)``."""
    fused = operator.get("fused")
    if not fused:
        return untrusted(operator["op"])
    where = f", in {untrusted(fused['module'])}" if fused.get("module") else ""
    return f"the fused kernel {untrusted(fused['class'])} ({untrusted(fused['class_module'])}{where})"


def fused_text(fused: Dict[str, Any]) -> str:
    """``Fused kernel ScaledSoftmax: output NON-FINITE; reference math float16 NON-FINITE, float32 finite,
    float64 finite: numerics``."""
    nonfinite = fused["reference_nonfinite"]
    reference = ("no reference math (opaque)" if nonfinite is None else "reference math " + ", ".join(
        f"{label} {'NON-FINITE' if bad else 'finite'}" for label, bad in nonfinite.items()))
    return f"Fused kernel {untrusted(fused['class'])}: output NON-FINITE; {reference}: {fused['finding']}"


def module_line(result: Dict[str, Any]) -> str:
    """``Module decoder.layers.1.mlp.linear_fc1 (ColumnParallelLinear), step 4, rank 1 (tp1 pp0 dp0, vm
    cpu)``: which call a replay (or a comparison of replays) is about."""
    rank = result["rank"]
    module = result["module"]
    return (f"Module {untrusted(module['path'])} ({untrusted(module['class'])}), step {result['step']},"
            f" rank {rank['global_rank']} (tp{rank['tp']} pp{rank['pp']} dp{rank['dp']},"
            f" {host_device(rank)})")


def format_text(result: Dict[str, Any]) -> str:
    lines = [f"gradnan replay of {shell_word(result['bundle'])}",
             module_line(result) + (", recompute pass" if result["recompute"] else ""),
             f"Verdict: {result['verdict']}: {result['summary']}"]
    for label, run in result["runs"].items():
        operator = run["first_nonfinite"]
        first = (f"first non-finite at op #{operator['index']} {operator_text(operator)}"
                 f" ({operator.get('phase', 'forward')})"
                 if operator else "no operator turned finite inputs non-finite")
        if run["first_growth"]:
            first = f"{growth_text({'where': 'operator', **run['first_growth']})}; {first}"
        gradients = "not replayed (no incoming gradient was captured)"
        if run.get("grads_replayed", True):
            gradients = "NON-FINITE" if run["grads_nonfinite"] else "finite"
        lines.append(f"  {label:>8}: outputs {'NON-FINITE' if run['outputs_nonfinite'] else 'finite'},"
                     f" gradients {gradients}; {first}")
    if result.get("fused"):
        lines.append(fused_text(result["fused"]))
    lines.append("Replay matches the module's own outputs saved in training:"
                 f" {'yes' if result['replay_matches_saved_outputs'] else 'no'}")
    changes = result["outputs_changed_after_return"]
    corrupted = not_updates(changes)
    if corrupted:
        lines.append(f"Training went on with other values: {changed_text(corrupted)}")
    lines += [updated_parameter_text(change) for change in changes if change["updated_parameter"] is not None]
    return printable_lines(lines)
