"""The interface between the Megatron adapter (``gradnan.patches``) and the runtime (``gradnan.training``),
in both directions: below both, so that neither imports the other.

``ModelFacts``: what the runtime asks of the model and the job; the adapter supplies it
(``gradnan.patches.model.MEGATRON_FACTS``), a test or a custom loop may supply its own.
``Events``: the entry points the adapter's instrumentors call, with plain data (``ParamSlot`` lists and
gradient tensors); ``Runtime`` implements them. ``ModuleHooks``: how the runtime's capture, frame tracing
and rerun hook the model's modules, made by the adapter (``ModuleHooking``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple

import torch

from .config import GradnanConfig
from .formats.maps import ParamSlot

NamedModules = List[Tuple[str, torch.nn.Module]]
Grads = Sequence[Optional[torch.Tensor]]
DescribeBuckets = Callable[[Any, Sequence[int]], Tuple[List[ParamSlot], List[torch.Tensor], List[dict]]]
# a bucket group's buckets as the run-up file lists them: ``bucket``, ``numel``, ``params`` (global names)
DescribeContents = Callable[[Any], List[Dict[str, Any]]]


def _no_modules(chunks: Sequence[torch.nn.Module]) -> NamedModules:
    return []


def _plain_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return param.grad


def _no_facts(param: torch.nn.Parameter) -> Dict[str, Any]:
    return {}


def _no_loop() -> Optional[Dict[str, Any]]:
    return None


def _no_iteration() -> Optional[int]:
    return None


def _no_tracker() -> Optional[Any]:
    return None


@dataclass(frozen=True)
class ParamTensors:
    """One optimizer slot's tensors as the step began, read at an incident only: the model parameter, the
    copy the optimizer steps where it is a separate tensor (an fp32 main copy, or a distributed-optimizer
    shard of one; None where it steps the model parameter itself) and the optimizer's state of it
    (``exp_avg``, ``exp_avg_sq``, ... by name; the tensors shaped like the stepped copy)."""

    model: torch.Tensor
    main: Optional[torch.Tensor]
    state: Dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepState:
    """What the weights and the optimizer hold on this rank as a step begins: every model parameter by
    global name (``weights``: a distributed optimizer steps only its shard of them, and the others are
    gathered into this rank's copies), and the optimizer's slots with their stepped copies and state."""

    weights: List[Tuple[str, torch.Tensor]]
    slots: List[ParamSlot]
    stepped: List[ParamTensors]


def _no_group() -> Optional[Any]:
    return None


def _no_optimizer_tensors(optimizer: Any, chunks: Sequence[torch.nn.Module]) -> StepState:
    return StepState([], [], [])


@dataclass(frozen=True)
class ModelFacts:
    """coords: this rank's global rank, world size, parallel coordinates, host and device.
    versions: the library versions to write into maps and bundles.
    iteration: the training loop's own iteration for the step in progress (Megatron-LM's), or None.
    loop: the training loop running the step, as records name it (``formats.loop``), or None (a loop of the
    user's own).
    named_modules: every module of the model chunks with its global name.
    observed_grad: a parameter's gradient as the optimizer sees it (Megatron's ``main_grad``).
    param_facts: what a parameter is beyond its shape (its tensor-parallel partition).
    tensorboard: the training loop's own TensorBoard writer on this rank (Megatron-LM's), or None.
    wandb: the training loop's own W&B run on this rank (Megatron-LM's: the ``wandb`` module, initialised),
    or None.
    optimizer_tensors: the weights and an optimizer's state (``StepState``), read at an incident to tell a
    weight or an update gone bad from a bad step.
    replica_group: this rank's data-parallel process group (its peers hold the same weights), or None."""

    coords: Callable[[], Dict[str, Any]]
    versions: Callable[[], Dict[str, Any]]
    iteration: Callable[[], Optional[int]] = _no_iteration
    loop: Callable[[], Optional[Dict[str, Any]]] = _no_loop
    named_modules: Callable[[Sequence[torch.nn.Module]], NamedModules] = _no_modules
    observed_grad: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = _plain_grad
    param_facts: Callable[[torch.nn.Parameter], Dict[str, Any]] = _no_facts
    tensorboard: Callable[[], Optional[Any]] = _no_tracker
    wandb: Callable[[], Optional[Any]] = _no_tracker
    optimizer_tensors: Callable[[Any, Sequence[torch.nn.Module]], StepState] = _no_optimizer_tensors
    replica_group: Callable[[], Optional[Any]] = _no_group


@dataclass(frozen=True)
class MegatronRerun:
    """Megatron's own rerun of the failing step (its result validation): ``job``, what its state machine
    concluded for the whole job ("reproducible" or "transient"); ``here``, this rank's own conclusion where
    its own validation failed in the failing pass (its rerun failed again, or not), else the job's. Under
    pipeline parallelism the stages may disagree."""

    job: str
    here: str


@dataclass(frozen=True)
class PipelineTransfer:
    """One point-to-point transfer between adjacent pipeline stages, as the schedule made it: the activation
    sent to the next stage and the gradient sent to the previous one, the activation received from the
    previous stage and the gradient received from the next one (None: not in this transfer). ``complete``:
    the received tensors are whole (False where the call returned before its requests finished)."""

    sent_forward: Optional[torch.Tensor]
    sent_backward: Optional[torch.Tensor]
    received_forward: Optional[torch.Tensor]
    received_backward: Optional[torch.Tensor]
    complete: bool = True


class RerunnableStep(Protocol):
    """A training step the adapter kept so that its forward pass can run again
    (``gradnan.training.rerun``)."""

    chunks: List[torch.nn.Module]

    def forward(self, on_reduction: Optional[Callable[[torch.Tensor], Callable[[torch.Tensor], None]]] = None
                ) -> Tuple[Optional[bool], Optional[int]]:
        """The step's forward pass again: same micro-batches, same starting RNG state, no gradients; leaves
        the RNG state as it found it. Returns what ``original_losses`` says of the training pass, for this
        pass's losses (the loss function runs again on the model's output). ``on_reduction(partial)``:
        called at each tensor-parallel reduction of a layer's partial sums in the pass (a row-parallel
        linear's, a vocabulary-parallel embedding's) before it reduces, and what it returns with the
        result after."""

    def original_losses(self) -> Tuple[Optional[bool], Optional[int]]:
        """Whether the training pass's losses were all finite (None: none here), and the first micro-batch
        whose loss was not."""

    def micro_batches(self) -> List[Any]:
        """What the data iterator yielded for each micro-batch of the step (empty without one)."""

    def samples(self, micro_batch: int) -> Optional[Dict[str, Any]]:
        """Where micro-batch ``micro_batch`` came from in the training data (the ``rerun`` record's
        ``samples``), where the adapter knows it (Megatron-LM's loop), else None."""

    def ended_early(self, micro_batch: int) -> None:
        """The training pass raised at micro-batch ``micro_batch`` (Megatron's loss check rejected its
        loss): a pass again covers the micro-batches up to that one, and its loss counts as non-finite."""

    def not_raised_together(self) -> Optional[str]:
        """Why the other ranks of this model-parallel group did not raise at a rejected loss with this one
        (pipeline parallelism: only the last stage computes the loss), or None."""

    def cannot_rerun(self, seen_by: Optional[FrozenSet[int]]) -> Optional[str]:
        """Why the forward pass cannot run again (FP8 state; peers outside this model-parallel group that
        are not known to meet this incident: not in ``seen_by``, the global ranks known to, None: every rank
        of the job), or None."""

    def deciding_group(self, seen_by: Optional[FrozenSet[int]]) -> str:
        """The group (an ``all_reduce`` group name) whose ranks decide together whether to run the step
        again: "forward" where its forward pass spans replicas and all of them are known to meet this
        incident (``seen_by``; None: every rank of the job), else "model"."""

    def leads_replica(self) -> bool:
        """Whether this rank is the first of its model-parallel group."""

    def all_reduce(self, values: Sequence[float], op: str, group: str) -> List[float]:
        """``values`` reduced ("max"/"min") over "tensor" (the tensor-parallel group), "model" (the
        model-parallel group: one data-parallel replica), "exchange" (the ranks whose activations meet inside
        a layer: the tensor-parallel group, with expert parallelism the expert tensor-and-model-parallel
        group) or "forward" (the ranks that run a forward pass together: the model-parallel group, with
        expert parallelism the expert tensor-model-pipeline group, which spans replicas)."""


class ModuleHooks(Protocol):
    """One owner's changes to the model's modules (a capture, a frame tracer, a rerun pass), all undone
    by ``remove()``: a swapped ``forward``, forward hooks and pre-hooks, gradient hooks on parameters."""

    def replace_forward(self, module: torch.nn.Module, forward: Callable[..., Any]) -> None: ...

    def after_forward(self, module: torch.nn.Module, hook: Callable[..., Any]) -> None: ...

    def before_forward(self, module: torch.nn.Module, hook: Callable[..., Any]) -> None: ...

    def on_gradient(self, param: torch.nn.Parameter, hook: Callable[[torch.Tensor], Any]) -> None: ...

    def remove(self) -> None: ...


@dataclass
class ModuleHooking:
    """Whether capture, frame tracing and the rerun may hook the model's modules: ``new()`` gives one owner
    its ``ModuleHooks``. The adapter's ``module_hooks`` patch sets it; without that patch (disabled, or
    not installed) it stays None and no module is hooked."""

    new: Optional[Callable[[], ModuleHooks]] = None


class Events(Protocol):
    """What an instrumentor may call. Every call is made through ``guarded`` (an internal error is
    logged once and training goes on, unless ``config.strict``)."""

    config: GradnanConfig
    module_hooking: ModuleHooking

    def guarded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    def register_chunks(self, chunks: Sequence[torch.nn.Module]) -> None: ...

    def known_chunks(self) -> List[torch.nn.Module]: ...

    def ids_by_name(self) -> Dict[str, int]: ...

    def stepping_optimizer(self) -> Optional[Any]: ...

    def optimizer_built(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None: ...

    def begin_step(self, optimizer: Any, slots: Callable[[], Sequence[ParamSlot]]) -> None: ...

    def end_step(self, optimizer: Any, skipped: Optional[bool]) -> None: ...

    def grad_norm_tensor(self, norm: torch.Tensor, on_nonfinite: Callable[[float], None]) -> None: ...

    def gradients_zeroing(self) -> None: ...

    def host_waited(self) -> None: ...

    def keeps_steps(self) -> bool: ...

    def step_kept(self, kept: RerunnableStep) -> None: ...

    def megatron_reran(self, conclusion: MegatronRerun) -> None: ...

    def loss_rejected(self, message: str, loss: float, micro_batch: Optional[int]) -> None: ...

    def schedule_raised(self, kept: Optional[RerunnableStep]) -> None: ...

    def checkpoint_saved(self, iteration: Optional[int], path: Optional[str]) -> None: ...

    def nonfinite_grad_norm(self, optimizer: Any, norm: float, slots: Sequence[ParamSlot],
                            grads: Grads, seen_by: FrozenSet[int] = frozenset()) -> None:
        """``seen_by``: the global ranks known to see the same non-finite norm (Megatron reduced it, or
        one chained member's part of it, over them), so to meet this incident with this rank."""

    def loss_scale_overflow(self, optimizer: Any, leaf: int, scale: Optional[float],
                            min_scale: Optional[float], slots: Sequence[ParamSlot], grads: Grads) -> None: ...

    def first_sync_of_step(self, group: Any) -> bool: ...

    def pre_reduction_flags(self, group: Any, maxima: torch.Tensor, describe: DescribeBuckets,
                            mode: str) -> bool: ...

    def defer_pre_reduction_flags(self, group: Any, maxima: torch.Tensor,
                                  describe: DescribeBuckets) -> None: ...

    def keep_runup(self, group: Any, maxima: torch.Tensor, contents: DescribeContents) -> None: ...

    def pipeline_transfer(self, transfer: PipelineTransfer) -> None: ...

    def bucket_maxima(self, buckets: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """Each bucket's largest local gradient magnitude over the tensors that hold them (NaN/Inf carried
        through), stacked, on the device."""
