"""One watched module's calls, recorded so that a failure can be replayed offline (see ``gradnan.replay``),
and the contents of the bundle a chosen call becomes (``bundle_contents``).

A ``ModuleCapture`` watches a module while armed: each call's forward is recorded as an op trace
(``gradnan.trace``: the exact aten operations and the tensors they started from, parameters included),
with the RNG state before it, whether it was an activation-recompute pass, its outputs' non-finite
state, the gradients flowing back into its outputs and its parameters' gradients (a ``ModuleCall``).
Apart from ``capture`` (which modules are watched when, and when a call is written) because this is
what runs inside the training step, on every call of a watched module.

Modes:
- ``incident``: write the first call of a step in which anything was non-finite (armed after a
  detection: the failure recurs, the next occurrence is captured). Formerly ``on_nonfinite``, which
  clashed with the configuration field of that name (raise or continue): still accepted, with one
  deprecation warning;
- ``always``: write the first call of the step (explicit modules and steps from the configuration);
- ``retain``: keep the last call of every step and write it only when a detection happens in that
  same step, so the failing step itself is captured without a rerun.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ..events import ModuleHooks
from ..formats.trace import Trace, has_nonfinite, same_values, tensors_in
from ..log import logger
from .error_guard import ErrorGuard
from .frames import in_backward
from .recorder import OpRecorder

MODES = ("incident", "always", "retain")
RENAMED_MODES = {"on_nonfinite": "incident"}  # old spelling -> current name


_warned_renames: Set[str] = set()


def _current_mode_name(mode: str) -> str:
    """A capture mode under its current name; an old spelling still works, with one warning per process."""
    current = RENAMED_MODES.get(mode)
    if current is None:
        return mode
    if mode not in _warned_renames:
        _warned_renames.add(mode)
        logger.warning("capture mode %r is deprecated, use %r (%r is also the name of a configuration field)",
                       mode, current, mode)
    return current


@dataclass
class ModuleCall:
    """One forward of the watched module and what flowed back through it."""

    trace: Trace
    rng: Dict[str, torch.Tensor]
    recompute: bool
    grad_enabled: bool
    autocast: Dict[str, Any]
    call_index: int
    outputs: List[torch.Tensor] = field(default_factory=list)
    grad_outputs: Dict[int, torch.Tensor] = field(default_factory=dict)
    grad_inputs: Dict[int, torch.Tensor] = field(default_factory=dict)
    param_grads: Dict[str, torch.Tensor] = field(default_factory=dict)
    outputs_nonfinite: bool = False
    # what training went on with where it is not what the module returned: a forward hook's result
    # (``hooked``), and the returned tensors themselves with their version counters, to see an in-place
    # change made after the call
    hooked: Optional[List[torch.Tensor]] = None
    returned: List[Tuple[torch.Tensor, int]] = field(default_factory=list)
    # by output: the name of the module's parameter it is (``parameter_names``), else None
    output_params: List[Optional[str]] = field(default_factory=list)

    @property
    def nonfinite(self) -> bool:
        return (self.outputs_nonfinite or self.trace.first_nonfinite is not None
                or any(change["nonfinite"] for change in self.changed_after_return()[0]
                       if not self.is_parameter_update(change))
                or any(has_nonfinite(g) for g in self.grad_outputs.values())
                or any(has_nonfinite(g) for g in self.param_grads.values()))

    def changed_after_return(self) -> Tuple[List[Dict[str, Any]], Dict[int, torch.Tensor]]:
        """The outputs training went on with that differ from what the module's forward returned: by a
        forward hook (its result replaced the output) or changed in place after the call (its version
        counter moved and its values differ; a tensor whose storage was swapped, as Megatron's pipeline
        does to free a sent output, is not compared). Each as ``{"output", "by", "nonfinite"}``, and the
        values training used, by output number, none for a returned parameter's update (an output changed
        in place is the live tensor, not a copy: this is asked at each ``nonfinite``, and a bundle is
        written from it at once)."""
        changes: List[Dict[str, Any]] = []
        used: Dict[int, torch.Tensor] = {}
        if self.hooked is not None:
            hooked = [(i, t) for i, t in enumerate(self.hooked)
                      if i >= len(self.outputs) or not same_values(self.outputs[i], t)]
            changes += [{"output": i, "by": "forward_hook", "nonfinite": has_nonfinite(t)} for i, t in hooked]
            used.update(hooked)
        for i, (tensor, version) in enumerate(self.returned):
            if i in used or tensor._version == version or tensor.shape != self.outputs[i].shape:
                continue
            if not same_values(self.outputs[i], tensor):
                change = {"output": i, "by": "in_place", "nonfinite": has_nonfinite(tensor)}
                changes.append(change)
                if not self.is_parameter_update(change):  # a parameter's later value is its update's
                    used[i] = tensor.detach()
        return changes, used

    def is_parameter_update(self, change: Dict[str, Any]) -> bool:
        """Whether ``change`` is an output that is one of the module's parameters changed in place: the
        parameter's update (the optimizer step), which training did not go on with in this call."""
        output = change["output"]
        return change["by"] == "in_place" and output < len(self.output_params) and bool(
            self.output_params[output])


def parameter_names(module: torch.nn.Module, tensors: List[torch.Tensor]) -> List[Optional[str]]:
    """For each tensor, the name of ``module``'s parameter it is (that tensor, or one on all of its data:
    same data pointer, shape, dtype and device), else None. A linear layer built with ``skip_bias_add``
    returns its bias this way, and the optimizer changes it in place after the call."""
    params = list(module.named_parameters())

    def name_of(tensor: torch.Tensor) -> Optional[str]:
        return next((name for name, param in params if tensor is param or (
            tensor.shape == param.shape and tensor.dtype == param.dtype and tensor.device == param.device
            and tensor.numel() > 0 and tensor.data_ptr() == param.data_ptr())), None)
    return [name_of(tensor) for tensor in tensors]


def _rng_states() -> Dict[str, torch.Tensor]:
    states = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["rng.cuda"] = torch.cuda.get_rng_state()
    return states


def _autocast() -> Dict[str, Any]:
    state = {"cpu": torch.is_autocast_enabled("cpu"), "cpu_dtype": str(torch.get_autocast_dtype("cpu"))}
    if torch.cuda.is_available():
        state.update(cuda=torch.is_autocast_enabled("cuda"), cuda_dtype=str(torch.get_autocast_dtype("cuda")))
    return state


class ModuleCapture:
    """Hooks on one module, through ``hooks`` (its ``forward`` replaced on the instance, gradient hooks on
    its parameters); ``detach()`` removes every one of them. Capture runs inside the training step: a
    failure (out of memory while cloning, say) goes through ``guard``: that call is not captured, the
    error is logged once per kind and training goes on, unless ``strict``."""

    def __init__(self, name: str, module: torch.nn.Module, mode: str, guard: ErrorGuard, hooks: ModuleHooks,
                 confirm: Optional[Callable[[], bool]] = None) -> None:
        """``confirm``: asked at the module's first call whether this step is to be captured at all (the
        step is not known yet when the capture is armed); if not, the module runs untouched this step."""
        mode = _current_mode_name(mode)
        if mode not in MODES:
            raise ValueError(f"capture mode must be one of {MODES}, got {mode!r}")
        self.name, self.module, self.mode, self._guard, self._hooks = name, module, mode, guard, hooks
        self._confirm, self._passing = confirm, False
        self.only_when: Optional[Callable[[], bool]] = None  # asked at each call: record this one?
        self.calls: List[ModuleCall] = []
        self.steps_watched = 0
        self.context: Dict[str, Any] = {}
        self._original_forward = module.forward
        self._calls_this_step = 0
        self._returned_by_forward: Optional[ModuleCall] = None

    def attach(self) -> "ModuleCapture":
        self._hooks.replace_forward(self.module, self._forward)
        self._hooks.after_forward(self.module, self._after_hooks)
        for param_name, param in self.module.named_parameters():
            if param.requires_grad:
                self._hooks.on_gradient(param, self._param_hook(param_name))
        return self

    def detach(self) -> None:
        self._hooks.remove()

    def _param_hook(self, param_name: str):
        def hook(grad: torch.Tensor) -> None:
            if self.calls:
                current = self.calls[-1].param_grads
                self._guard("capture of a parameter gradient", lambda: current.__setitem__(
                    param_name, grad.detach().clone() + current.get(param_name, 0)))
        return hook

    def _prepare(self, recorder: OpRecorder, args: Any, kwargs: Any) -> Dict[str, torch.Tensor]:
        """Name the call's inputs, parameters and buffers for the trace; the RNG state before the call."""
        recorder.mark_inputs(list(args), "args")
        recorder.mark_inputs(kwargs, "kwargs")
        recorder.mark_inputs(dict(self.module.named_parameters()), "param")
        recorder.mark_inputs(dict(self.module.named_buffers()), "buffer")
        return _rng_states()

    def _submodule_names(self) -> Dict[int, str]:
        """Module id -> global name of the module and its submodules (where a fused Function ran)."""
        return {id(module): f"{self.name}.{local}" if local else self.name
                for local, module in self.module.named_modules()}

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._confirm is not None:
            confirm, self._confirm = self._confirm, None
            self._passing = not self._guard("capture", confirm)
        if self._passing or (self.only_when is not None and not self.only_when()):
            return self._original_forward(*args, **kwargs)
        recorder = OpRecorder(self._submodule_names)
        rng = self._guard("capture", self._prepare, recorder, args, kwargs)
        if rng is None:
            return self._original_forward(*args, **kwargs)
        with recorder:
            outputs = self._original_forward(*args, **kwargs)
        self._guard("capture", self._keep, recorder, rng, outputs, args, kwargs)
        return outputs

    def _keep(self, recorder: OpRecorder, rng: Dict[str, torch.Tensor], outputs: Any, args: Any,
              kwargs: Any) -> None:
        call = ModuleCall(trace=recorder.result(outputs), rng=rng, recompute=in_backward(),
                          grad_enabled=torch.is_grad_enabled(), autocast=_autocast(),
                          call_index=self._calls_this_step)
        self._calls_this_step += 1
        produced = tensors_in(outputs)
        call.outputs = [t.detach().clone() for t in produced]
        call.returned = [(t, t._version) for t in produced]
        call.output_params = parameter_names(self.module, produced)
        call.outputs_nonfinite = any(has_nonfinite(t) for t in produced)
        self._returned_by_forward = call
        # hooks on activations only: a hook on a leaf (a Parameter returned as bias, a tied weight passed
        # in) would outlive the call and this capture
        for position, tensor in enumerate(produced):
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(self._grad_hook(call.grad_outputs, position))
        for position, tensor in enumerate(tensors_in((args, kwargs))):
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(self._grad_hook(call.grad_inputs, position))
        if self.mode == "retain":
            self.calls = [call]
        else:
            self.calls.append(call)

    def _after_hooks(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """What the forward hooks registered before this capture made of the call's output: kept where
        it is not what the forward returned (``ModuleCall.changed_after_return``)."""
        call, self._returned_by_forward = self._returned_by_forward, None
        if call is not None:
            self._guard("capture of a hooked output", lambda: setattr(
                call, "hooked", [t.detach().clone() for t in tensors_in(output)]))

    def _grad_hook(self, store: Dict[int, torch.Tensor], position: int):
        def hook(grad: torch.Tensor) -> None:
            self._guard("capture of a gradient", lambda: store.__setitem__(position, grad.detach().clone()))
        return hook

    def chosen_call(self) -> Optional[ModuleCall]:
        """The call worth a bundle this step, by mode (recompute passes replace the first pass)."""
        tracked = [c for c in self.calls if c.grad_enabled] or self.calls
        if self.mode == "incident":
            return next((c for c in tracked if c.nonfinite), None)
        return tracked[0] if self.mode == "always" and tracked else (tracked[-1] if tracked else None)

    def end_step(self) -> None:
        self.calls = [] if self.mode != "retain" else self.calls
        self._calls_this_step = 0
        self.steps_watched += 1


def bundle_contents(capture: ModuleCapture, call: ModuleCall, observed: Dict[str, Optional[torch.Tensor]],
                    context: Dict[str, Any], param_facts: Callable[[torch.nn.Parameter], Dict[str, Any]]
                    ) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The manifest fields and tensors of a bundle for one captured call (the caller adds rank, run...).

    ``observed``: gradients as the optimizer saw them at the detection (e.g. ``main_grad``), by parameter
    name, to compare with what the replay computes. ``param_facts``: what a parameter is beyond its
    shape (its tensor-parallel partition, for a shard)."""
    tensors: Dict[str, torch.Tensor] = dict(call.trace.leaves)
    tensors.update(call.rng)
    tensors.update({f"out.{i}": t for i, t in enumerate(call.outputs)})
    changes, used = call.changed_after_return()
    tensors.update({f"used_out.{i}": t for i, t in used.items()})
    tensors.update({f"grad_out.{i}": g for i, g in call.grad_outputs.items()})
    tensors.update({f"grad_in.{i}": g for i, g in call.grad_inputs.items()})
    tensors.update({f"param_grad.{name}": g for name, g in call.param_grads.items()})
    tensors.update({f"observed.{name}": g for name, g in observed.items() if g is not None})
    manifest = {
        "created": time.time(),
        "module": {"path": capture.name, "class": type(capture.module).__qualname__,
                   "class_module": type(capture.module).__module__},
        "mode": capture.mode,
        "call_index": call.call_index,
        "recompute": call.recompute,
        "grad_enabled": call.grad_enabled,
        "autocast": call.autocast,
        "trace": call.trace.to_json(),
        "outputs": len(call.outputs),
        "outputs_changed": changes,
        "outputs_parameters": call.output_params,
        "grad_outputs": sorted(call.grad_outputs),
        "grad_inputs": sorted(call.grad_inputs),
        "params": {name: {"shape": list(param.shape), "dtype": str(param.dtype), **param_facts(param)}
                   for name, param in capture.module.named_parameters()},
        "param_grads": sorted(call.param_grads),
        "observed_grads": sorted(name for name, g in observed.items() if g is not None),
        "seen": {"outputs_nonfinite": call.outputs_nonfinite,
                 "grad_outputs_nonfinite": any(has_nonfinite(g) for g in call.grad_outputs.values()),
                 "grad_inputs_nonfinite": any(has_nonfinite(g) for g in call.grad_inputs.values()),
                 "param_grads_nonfinite": any(has_nonfinite(g) for g in call.param_grads.values()),
                 "observed_nonfinite": any(has_nonfinite(g) for g in observed.values()),
                 "first_nonfinite_op": call.trace.first_nonfinite},
        "rng": sorted(call.rng),
        **context,
    }
    return manifest, tensors
