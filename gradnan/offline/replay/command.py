"""``gradnan replay BUNDLE``: rerun a captured module call offline and say whether the failure reproduces.

One process, CPU or a GPU, no Megatron and no process group needed: the bundle holds the call's exact
computation as an op trace (``gradnan.trace``) with its inputs, parameters, RNG state, the gradient that
flowed into its outputs, and what training saw. The replay runs forward and backward three times: in
the captured dtype, in float32 and in float64, each under a watch that names the first operator whose
inputs were finite and whose output was not. The verdict:

- ``inputs_nonfinite``: the inputs or parameters were already bad when the module ran: look upstream;
- ``inputs_out_of_line``: the inputs were finite but already out of line (grown upstream, as the bundle's
  frames show, or near the dtype's limit) and the module only finished what that growth started: look
  upstream, at the module named (rather than at the operator that overflowed);
- ``incoming_gradient_nonfinite``: the gradient flowing into the module was already bad: look downstream;
- ``kernel_bug``: a fused kernel (a custom autograd Function outside the dispatcher, ``fused`` in the trace)
  turned finite inputs non-finite while the kit's reference math for it is finite in the captured dtype;
- ``precision``: reproduces in the captured dtype, not in float64: overflow or underflow at that operator
  (at a fused kernel: its reference math overflows in the captured dtype too, not wider: numerics);
- ``bad_operator_or_input``: reproduces in every precision at that operator;
- ``changed_after_return``: the module's own outputs are finite (the replay agrees), but training went on
  with a non-finite output changed after the module returned: by a forward hook on it, or in place by an
  operation outside it (the bundle's ``outputs_changed``, the values in ``used_out.N``); an output that is
  one of the module's parameters changed in place is that parameter's update, not such a change;
- ``not_reproduced``: from the same inputs the module computes finite values: what training saw came
  from elsewhere (a transient device fault: run ``gradnan selftest``; or a corruption after this
  computation, e.g. in the gradient buffer);
- ``healthy``: nothing non-finite was captured, and the replay agrees.

Next to the first non-finite operator each run names the first one whose output grew out of line over its
inputs before it (``first_growth``: the magnitude path, ``gradnan.formats.magnitude``), and ``growth``
says where the value first grew: at that operator, or upstream of the module.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ...errors import InputError, UsageError
from ...formats import bundle
from ...formats.layout import MANIFEST
from ...formats.magnitude import first_grown_frame, grew, near_limit
from ...formats.replay import SCHEMA, ReplayVerdict
from ...formats.rerun_record import is_growth
from ...formats.trace import REPLAY_PRECISIONS, Trace, has_nonfinite, is_fused, same_values, tensors_in
from ...formats.trace_ops import TraceError, op_inputs, refs, returns_uninitialized
from .text import changed_text, growth_text, not_updates, operator_text
from .trace import output_tree, replay

# The module's own inputs; other leaves are tensors made outside the traced ops (e.g. Megatron's
# uninitialised global memory buffer, written before it is read), not inputs to judge.
MODULE_INPUTS = ("args.", "kwargs.", "param.", "buffer.")


def _run(trace: Trace, dtype: Optional[torch.dtype], grads: Dict[int, torch.Tensor],
         grad_leaves: List[str], device: torch.device, rng: Optional[torch.Tensor],
         max_ops: Optional[int], digests: bool = False,
         uninitialized_fill: Optional[int] = None) -> Dict[str, Any]:
    """Forward and backward with the captured incoming gradients, the capture's RNG state restored
    first so dropout draws the same; ``digests``: with the digests of the forward's ops;
    ``uninitialized_fill``: see ``trace.replay``."""
    grad_outputs = output_tree(trace, grads.get) if grads else None
    if rng is not None:
        torch.set_rng_state(rng)
    result = replay(trace, dtype=dtype, grad_outputs=grad_outputs, grad_leaves=grad_leaves, device=device,
                    max_ops=max_ops, digests=digests, uninitialized_fill=uninitialized_fill)
    outputs = tensors_in(result.outputs)
    return {
        "outputs_nonfinite": any(has_nonfinite(t) for t in outputs),
        "grads_nonfinite": any(has_nonfinite(g) for g in result.grads.values()),
        "grads_replayed": grad_outputs is not None,
        "first_nonfinite": result.first_nonfinite,
        "first_growth": result.first_growth,
        "_outputs": outputs,
        "_grads": result.grads,
        "_digests": result.digests,
        "_references": result.reference_digests,
    }


def checked_device_name(name: Optional[str]) -> Optional[str]:
    """``--device`` as written: cpu, cuda or cuda:N (or None: the default)."""
    if name is not None and not re.fullmatch(r"cpu|cuda(:\d{1,4})?", name):
        raise UsageError(f"--device {name!r}: replay runs on cpu, cuda or cuda:N")
    return name


def replay_device(name: Optional[str]) -> torch.device:
    """The device ``--device`` names: the CPU or a CUDA device present here (default: cuda if any)."""
    checked_device_name(name)
    target = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if target.type == "cuda" and (not torch.cuda.is_available()
                                  or (target.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"--device {name}: no such CUDA device here")
    return target


def replay_bundle(path: Path, device: Optional[str] = None, max_ops: Optional[int] = None,
                  digests: bool = False) -> Dict[str, Any]:
    """Replay a bundle in three precisions and judge, in this process (``gradnan replay`` runs it in a
    child process with limits: ``isolation.replay_isolated``); raises InputError for an unusable bundle
    or an op the checks refuse (``checks``). ``max_ops``: see ``trace.replay``. ``digests``: the result
    also holds ``digests``, what ``comparison`` compares: each op of the trace with the digests of its
    outputs in the capture (where the bundle has them) and in this replay in the captured dtype."""
    manifest, tensors = bundle.load(Path(path))
    bundle.check_replayable(manifest, tensors, str(Path(path) / MANIFEST))
    leaf_names = list(manifest["trace"].get("leaves", {}))
    missing = [name for name in leaf_names if name not in tensors]
    if missing:
        raise InputError(f"{path}: tensors.pt lacks the trace inputs {missing[:3]}")
    try:
        trace = Trace.from_json(manifest["trace"], {name: tensors[name] for name in leaf_names})
    except TraceError as exc:
        raise InputError(f"{path}: {exc}") from None
    target = replay_device(device)
    grads = {int(key.split(".", 1)[1]): t.to(target) for key, t in tensors.items()
             if key.startswith("grad_out.")}
    grad_leaves = [name for name in leaf_names
                   if name.startswith(("param.", "args.", "kwargs.")) and tensors[name].is_floating_point()]
    try:
        runs = {label: _run(trace, dtype, grads, grad_leaves, target, tensors.get("rng.cpu"), max_ops,
                            digests and label == "captured")
                for label, dtype in REPLAY_PRECISIONS}
        # the forward again, what ``empty`` returns filled with something else than NaN: what changes
        # depends on what the allocator held, which is compared nowhere
        refilled = (_run(trace, None, {}, [], target, tensors.get("rng.cpu"), max_ops, True,
                         uninitialized_fill=_SECOND_FILL)["_digests"] if digests else None)
    except (TraceError, RuntimeError) as exc:  # an op that cannot run here, a device that is not here
        raise InputError(f"{path}: cannot replay:"
                         f" {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    seen = manifest.get("seen", {})
    captured = runs["captured"]
    saved_outputs = [tensors[f"out.{i}"] for i in range(manifest.get("outputs", 0)) if f"out.{i}" in tensors]
    matches = len(saved_outputs) == len(captured["_outputs"]) and all(
        same_values(saved.to(target), replayed.detach())
        for saved, replayed in zip(saved_outputs, captured["_outputs"]))
    inputs = _largest_input(tensors, leaf_names)
    growth = _growth(manifest, runs["captured"]["first_growth"], inputs)
    changes = _changes(manifest, trace)
    judgement = {**_judge(seen, runs, tensors, leaf_names, grads, growth, changes), "growth": growth,
                 "fused": (captured["first_nonfinite"] or {}).get("fused")}
    if judgement["verdict"] == ReplayVerdict.NOT_REPRODUCED and seen.get("outputs_nonfinite") and not matches:
        judgement["summary"] += ("; its own computation is finite, so the non-finite output came in from"
                                 " outside it (a collective with other ranks, e.g. a tensor-parallel"
                                 " all-reduce)")
    return {
        **SCHEMA.header(),
        **({"digests": op_digests(trace, captured["_digests"], captured["_references"],
                                  garbage_dependent(trace, captured["_digests"], refilled))}
           if refilled is not None else {}),
        "bundle": str(path),
        "module": manifest["module"],
        "step": manifest.get("step"),
        "rank": {key: manifest["rank"].get(key)
                 for key in ("global_rank", "tp", "pp", "dp", "host", "device")},
        "recompute": manifest.get("recompute"),
        "seen_in_training": seen,
        "replay_matches_saved_outputs": matches,
        "outputs_changed_after_return": changes,
        "runs": {label: {k: v for k, v in run.items() if not k.startswith("_")}
                 for label, run in runs.items()},
        **judgement,
    }


def _changes(manifest: Dict[str, Any], trace: Trace) -> List[Dict[str, Any]]:
    """The manifest's ``outputs_changed``, each with ``updated_parameter``: where the output is one of the
    module's parameters changed in place, that parameter's name (its update after the call, e.g. the
    bias a linear layer built with ``skip_bias_add`` returns), else None. Which output is a parameter: the
    manifest's ``outputs_parameters``; a bundle written before it existed, the trace's outputs that are a
    ``param.`` leaf itself."""
    parameters = manifest.get("outputs_parameters")
    if parameters is None:
        parameters = [ref[len("param."):] if ref.startswith("param.") else None
                      for ref in refs(trace.outputs)]
    return [{**change, "updated_parameter": parameters[change["output"]]
             if change["by"] == "in_place" and change["output"] < len(parameters) else None}
            for change in manifest.get("outputs_changed", [])]


# what ``empty``-like ops return in the second forward (``garbage_dependent``): finite, unlike the NaN of
# the first, so that any value computed from it differs
_SECOND_FILL = 1


def garbage_dependent(trace: Trace, replayed: List[List[Dict[str, Any]]],
                      refilled: List[List[Dict[str, Any]]]) -> List[bool]:
    """For each op, whether its outputs hold what an ``empty``-like op returned, or values computed from
    it: they differ between two forwards whose ``empty`` returned NaN and ``_SECOND_FILL``, and the op
    returns uninitialized memory or takes a tensor that did (a view of it, or a result computed from
    it; an operator that wrote it, ``copy_`` or ``baddbmm(..., beta=0)`` into it, makes it whole again).
    At capture these values were whatever the allocator held: they can be compared with nothing."""
    tainted: Set[str] = set()
    found = []
    for op, first, second in zip(trace.ops, replayed, refilled):
        uninitialized = not is_fused(op) and returns_uninitialized(op["op"])
        reads_garbage = uninitialized or not tainted.isdisjoint(refs(op_inputs(op)))
        differs = [one["hash"] for one in first] != [other["hash"] for other in second]
        depends = reads_garbage and differs
        (tainted.update if depends else tainted.difference_update)(refs(op["out"]))
        found.append(depends)
    return found


def op_digests(trace: Trace, replayed: List[List[Dict[str, Any]]],
               references: Dict[int, Optional[List[Dict[str, Any]]]],
               uninitialized: List[bool]) -> Dict[str, Any]:
    """What a comparison needs of one replay: the capture's first non-finite op (as validated with the
    trace), and each op of the trace with its name, whether it is a collective (identity at replay) or
    holds uninitialized memory (``garbage_dependent``), the digests of its outputs at capture (null where the
    bundle has none) and at this replay, and, for a fused entry, its class and its reference math's
    digests in the captured dtype here (null without a reference)."""
    captured: Sequence[Optional[List[Dict[str, Any]]]] = (trace.digests if trace.digests
                                                          else [None] * len(trace.ops))
    return {"first_nonfinite": trace.first_nonfinite,
            "ops": [{"op": op["op"], "collective": bool(op.get("collective")),
                     "uninitialized": garbage,
                     "fused": op["fused"]["class"] if is_fused(op) else None,
                     "captured": taken, "replayed": again, "reference": references.get(index)}
                    for index, (op, taken, again, garbage)
                    in enumerate(zip(trace.ops, captured, replayed, uninitialized))]}


def _largest_input(tensors: Dict[str, torch.Tensor], leaf_names: List[str]) -> Optional[Dict[str, Any]]:
    """The module's input (an ``args.``/``kwargs.`` leaf) of the largest finite magnitude: its name,
    abs-max and dtype."""
    found = [(float(tensors[name].detach().abs().max()), name) for name in leaf_names
             if name.startswith(("args.", "kwargs.")) and tensors[name].is_floating_point()
             and tensors[name].numel() > 0]
    finite = [(value, name) for value, name in found if math.isfinite(value)]
    if not finite:
        return None
    value, name = max(finite)
    return {"leaf": name, "abs_max": value, "dtype": str(tensors[name].dtype)}


def _upstream(manifest: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Where the manifest shows a value grew out of line before this module's call: the rerun's
    ``grew_in``, else the first grown frame among the frames it carries; None where that is this module."""
    module = manifest["module"]["path"]
    grown = manifest.get("grew_in")
    if not is_growth(grown):
        frames = manifest.get("frames")
        found = first_grown_frame(frames) if isinstance(frames, list) else None
        grown = None if found is None else {"module": str(found[0].get("module")),
                                            "class": str(found[0].get("class")), **found[1].to_json()}
    return grown if grown is not None and grown["module"] != module else None


def _growth(manifest: Dict[str, Any], operator: Optional[Dict[str, Any]],
            inputs: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Where the value first grew out of line: ``upstream`` of the module where its inputs were already
    out of line (themselves above 2^20, or near the dtype's limit) and the manifest shows where they grew
    (``module`` named; else only near the limit says so, ``module`` null), else at an ``operator`` of the
    module (the captured run's ``first_growth``), else None."""
    if inputs is not None and grew(None, inputs["abs_max"], inputs["dtype"]) is not None:
        upstream = _upstream(manifest)
        if upstream is not None or near_limit(inputs["abs_max"], inputs["dtype"]):
            return {"where": "upstream", "inputs": inputs,
                    "module": None if upstream is None else upstream["module"],
                    "class": None if upstream is None else upstream["class"],
                    "inputs_abs_max": None if upstream is None else upstream["inputs_abs_max"],
                    "output_abs_max": None if upstream is None else upstream["output_abs_max"]}
    if operator is not None:
        return {"where": "operator", **operator}
    return None


def _judge(seen: Dict[str, Any], runs: Dict[str, Dict[str, Any]], tensors: Dict[str, torch.Tensor],
           leaf_names: List[str], grads: Dict[int, torch.Tensor],
           growth: Optional[Dict[str, Any]], changes: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The forward first (its inputs are the module's own); the backward only where the forward is
    finite, since it starts from the incoming gradient, which may already be bad. A forward that goes
    non-finite from inputs already out of line is the upstream growth's (``_growth``), not the operator's
    that overflowed. A finite forward whose output training went on with non-finite, changed after the
    module returned (``changes``: a forward hook, an in-place operation), is that change's."""
    captured, wide = runs["captured"], runs["float64"]
    bad_leaves = [name for name in leaf_names
                  if name.startswith(MODULE_INPUTS) and has_nonfinite(tensors[name])]
    operator = captured["first_nonfinite"]
    where = f" at {operator_text(operator)} ({operator.get('phase', 'forward')})" if operator else ""
    if growth is not None and growth["where"] == "operator":
        where = f" ({growth_text(growth)}; first non-finite{where or ' output'})"
    if bad_leaves:
        return {"verdict": ReplayVerdict.INPUTS_NONFINITE.value, "reproduces": True,
                "summary": "the module's inputs or parameters were already non-finite"
                           f" ({', '.join(bad_leaves[:3])}): look upstream (an earlier module, or the update"
                           " of the previous step)"}
    if captured["outputs_nonfinite"] and growth is not None and growth["where"] == "upstream":
        return {"verdict": ReplayVerdict.INPUTS_OUT_OF_LINE.value, "reproduces": True,
                "summary": f"{growth_text(growth)}; it went non-finite here{where}, which only finished what"
                           " that growth started: look upstream, at where the value grew"}
    if captured["outputs_nonfinite"] and operator is not None and "finding" in operator.get("fused", {}):
        return _fused_verdict(operator)
    if captured["outputs_nonfinite"]:
        if not wide["outputs_nonfinite"]:
            # a value that grew out of line (here, or in float64 where it stays finite) overflowed; else it
            # may as well have underflowed (0/0)
            grew = (growth is not None and growth["where"] == "operator") or bool(wide.get("first_growth"))
            return {"verdict": ReplayVerdict.PRECISION.value, "reproduces": True,
                    "summary": "reproduces in the captured dtype, not in float64:"
                               f" {'an overflow' if grew else 'overflow or underflow'}{where}"}
        return {"verdict": ReplayVerdict.BAD_OPERATOR_OR_INPUT.value, "reproduces": True,
                "summary": f"reproduces in every precision{where}: a genuinely bad input for it,"
                           " or a bug in it"}
    corrupted = not_updates(changes)
    if any(change["nonfinite"] for change in corrupted):
        return {"verdict": ReplayVerdict.CHANGED_AFTER_RETURN.value, "reproduces": False,
                "summary": "the module's own outputs are finite, and the replay agrees; training went on"
                           f" with {changed_text(corrupted)}: look at what changed it"}
    if seen.get("outputs_nonfinite"):
        return {"verdict": ReplayVerdict.NOT_REPRODUCED.value, "reproduces": False,
                "summary": "does not reproduce: the output was non-finite in training but the module computes"
                           " finite values from the same inputs"}
    if any(has_nonfinite(g) for g in grads.values()):
        return {"verdict": ReplayVerdict.INCOMING_GRADIENT_NONFINITE.value, "reproduces": True,
                "summary": "the forward is finite but the gradient flowing into the module's outputs was"
                           " already non-finite: look downstream (the modules after it)"}
    if captured["grads_nonfinite"]:
        precision = not wide["grads_nonfinite"]
        verdict = ReplayVerdict.PRECISION if precision else ReplayVerdict.BAD_OPERATOR_OR_INPUT
        return {"verdict": verdict.value, "reproduces": True,
                "summary": (f"the backward reproduces in the captured dtype, not in float64{where}"
                            if precision else f"the backward reproduces in every precision{where}")}
    if any(bool(value) for value in seen.values()):
        return {"verdict": ReplayVerdict.NOT_REPRODUCED.value, "reproduces": False,
                "summary": "does not reproduce: from the same inputs the module computes finite values; what"
                           " training saw came from elsewhere: a transient device fault (run gradnan"
                           " selftest) or a corruption after this computation"}
    return {"verdict": ReplayVerdict.HEALTHY.value, "reproduces": False,
            "summary": "nothing non-finite was captured, and the replay agrees" + _still_grew(growth)}


_FINDINGS = {
    "kernel_bug": (ReplayVerdict.KERNEL_BUG,
                   "reference math on the same inputs is finite in the captured dtype: a bug in the kernel"),
    "numerics": (ReplayVerdict.PRECISION,
                 "its reference math overflows in the captured dtype too, not in {wider}: numerics"
                 " (overflow or underflow in the captured dtype)"),
    "bad_input": (ReplayVerdict.BAD_OPERATOR_OR_INPUT,
                  "its reference math is non-finite in every precision too: a genuinely bad input for it"),
    "opaque": (ReplayVerdict.BAD_OPERATOR_OR_INPUT,
               "no reference math is known for it (opaque): it cannot tell a kernel bug from numerics"),
}


def _fused_verdict(operator: Dict[str, Any]) -> Dict[str, Any]:
    """The verdict where the first non-finite step is a fused kernel: its reference math decides."""
    fused = operator["fused"]
    verdict, reason = _FINDINGS[fused["finding"]]
    wider = " or ".join(label for label, bad in (fused["reference_nonfinite"] or {}).items()
                        if label != "captured" and not bad)
    return {"verdict": verdict.value, "reproduces": True,
            "summary": f"{operator_text(operator)} turned finite inputs into Inf/NaN"
                       f" (op #{operator['index']}); {reason.format(wider=wider)}"}


def _still_grew(growth: Optional[Dict[str, Any]]) -> str:
    """What a healthy replay adds where a value grew out of line all the same (the culprit's own call,
    captured apart from the call that went non-finite)."""
    if growth is None:
        return ""
    return f"; but {'a value ' if growth['where'] == 'operator' else ''}{growth_text(growth)}"
