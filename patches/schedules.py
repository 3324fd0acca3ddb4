"""The training step's forward-backward schedule: ``megatron.core.pipeline_parallel.schedules``' three
``forward_backward_*`` functions (what ``get_forward_backward_func()`` returns, looked up at each call).

While a rerun may still be wanted (``Events.keeps_steps``), each training call (not ``forward_only``) keeps
what it takes to run the same step's forward pass again: a reference to every micro-batch its data
iterators yield, the RNG states it started from (torch's, CUDA's and Megatron's model-parallel tracker),
the losses it returned (what the loss function reported for logging) and the losses backward used (what
``forward_step_calc_loss`` returned, told by ``result_validation``'s wrapper of it: a loss function may
report a finite value and hand backward a NaN). No tensor is copied and nothing is read from the device.
``KeptStep.forward`` is that second pass, made at a detection before the optimizer applies anything.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
from datetime import timedelta
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeGuard,
)

import torch

from ..events import Events
from ..formats.layout import rank_ranges
from .data import micro_batch_samples
from .instrumentor import Instrumentor
from .undo_log import Patcher, patch_scope

SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
             "forward_backward_pipelining_with_interleaving")


class KeepingIterator:
    """Yields what ``source`` yields and keeps a reference to each item (the step's micro-batches)."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.items: List[Any] = []

    def __iter__(self) -> "KeepingIterator":
        return self

    def __next__(self) -> Any:
        item = next(self.source)
        self.items.append(item)
        return item


def _keeping(data_iterator: Any) -> Any:
    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):
        return [_keeping(it) for it in data_iterator]
    return KeepingIterator(data_iterator)


def _replaying(kept: Any) -> Any:
    if kept is None:
        return None
    if isinstance(kept, list):
        return [_replaying(it) for it in kept]
    return iter(list(kept.items))


def rng_states() -> Dict[str, Any]:
    """Every generator a forward pass may draw from: torch's CPU and CUDA ones, Megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states: Dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["cpu"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


class _PreHooked(Protocol):
    """A Megatron DDP chunk's switch for its forward pre-hooks."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None: ...

    def enable_forward_pre_hook(self) -> None: ...


def _pre_hooked(chunk: torch.nn.Module) -> TypeGuard[_PreHooked]:
    """Whether the chunk is a Megatron DDP with forward pre-hooks (``overlap_param_gather``)."""
    return bool(getattr(chunk, "remove_forward_pre_hook_handles", None))


@contextlib.contextmanager
def _forward_pre_hooks_off(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Megatron DDP's forward pre-hooks (``overlap_param_gather``) finish or start parameter all-gathers:
    off for a diagnostic pass, without a parameter sync (nothing has been updated), as Megatron-LM
    turns them off around evaluation."""
    hooked = [chunk for chunk in chunks if _pre_hooked(chunk)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook(param_sync=False)
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def _no_validation(*args: Any, **kwargs: Any) -> None:
    return None


def _never_large(*args: Any, **kwargs: Any) -> bool:
    return False


@contextlib.contextmanager
def diagnostic_pass(config: Any, chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """What a diagnostic forward pass must not touch in Megatron: its result validation (the
    ``RerunStateMachine``: a NaN loss met again would raise or change its state), its timers, the
    parameter all-gathers of ``overlap_param_gather``. Set aside on the instances, through the undo log."""
    from megatron.core import rerun_state_machine

    machine = rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE  # None until a run creates it
    with patch_scope() as patcher:
        if machine is not None:
            patcher.set(machine, "validate_result", _no_validation)
            patcher.set(machine, "is_unexpectedly_large", _never_large)
        for name in ("timers", "param_sync_func"):
            if getattr(config, name, None) is not None:
                patcher.set(config, name, None)
        with _forward_pre_hooks_off(chunks):
            yield


TENSOR_PARALLEL_REDUCTIONS = ("reduce_from_tensor_model_parallel_region",
                              "reduce_scatter_to_sequence_parallel_region")


@contextlib.contextmanager
def _reductions_watched(
        on_reduction: Optional[Callable[[torch.Tensor], Callable[[torch.Tensor], None]]]) -> Iterator[None]:
    """For one diagnostic pass: the reductions of partial sums that ``megatron.core.tensor_parallel.layers``
    makes (row-parallel linear, vocabulary-parallel embedding) report their input and output. Without
    tensor parallelism there is no reduction (the partial sum is the result), and nothing is watched."""
    from megatron.core import parallel_state

    if on_reduction is None or parallel_state.get_tensor_model_parallel_world_size() == 1:
        yield
        return
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")

    def watching(original):
        def reduction(partial, *args, **kwargs):
            done = on_reduction(partial)  # before: the all-reduce writes its result into its input
            reduced = original(partial, *args, **kwargs)
            done(reduced)
            return reduced

        return reduction

    with patch_scope() as patcher:
        for name in TENSOR_PARALLEL_REDUCTIONS:
            if hasattr(layers, name):
                patcher.wrap(layers, name, watching)
        yield


class _LossesUsed(threading.local):
    """Where this thread's schedule call keeps the losses backward uses (None: no kept call runs)."""

    into: Optional[List[torch.Tensor]] = None


_LOSSES_USED = _LossesUsed()


def loss_used(loss: Any) -> None:
    """``forward_step_calc_loss`` returned ``loss`` for a micro-batch (what backward runs from): kept, as a
    detached reference, by the kept schedule call running on this thread, if any (no host read)."""
    if _LOSSES_USED.into is not None and isinstance(loss, torch.Tensor):
        _LOSSES_USED.into.append(loss.detach())


@contextlib.contextmanager
def _keeping_losses_used(into: List[torch.Tensor]) -> Iterator[None]:
    before, _LOSSES_USED.into = _LOSSES_USED.into, into
    try:
        yield
    finally:
        _LOSSES_USED.into = before


def loss_state(store: Any, used: Sequence[torch.Tensor] = ()) -> Tuple[Optional[bool], Optional[int]]:
    """Whether every loss of a schedule call is finite, and the first micro-batch whose loss is not (one
    host read); (None, None) where it had none (not the last pipeline stage). A micro-batch's losses are
    what the schedule returned for it (the loss function's report) and what backward used (``used``, in
    micro-batch order, where known)."""
    reported = [[value for value in (item.values() if isinstance(item, dict) else [item])
                 if isinstance(value, torch.Tensor) and value.is_floating_point()]
                for item in store or []]
    count = max(len(reported), len(used))
    per_micro_batch = [(reported[index] if index < len(reported) else [])
                       + ([used[index]] if index < len(used) and used[index].is_floating_point() else [])
                       for index in range(count)]
    flat = [tensor for tensors in per_micro_batch for tensor in tensors]
    if not flat:
        return None, None
    finite = torch.stack([torch.isfinite(t.detach().float()).all() for t in flat]).tolist()
    position = 0
    for micro_batch, tensors in enumerate(per_micro_batch):
        if not all(finite[position:position + len(tensors)]):
            return False, micro_batch
        position += len(tensors)
    return True, None


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


class KeptStep:
    """One training call of a schedule, kept to run its forward pass again (``events.RerunnableStep``)."""

    def __init__(self, schedule: Callable[..., Any], kwargs: Dict[str, Any]) -> None:
        self._schedule = schedule
        self._kept_iterator = _keeping(kwargs.get("data_iterator"))
        self.kwargs = {**kwargs, "data_iterator": self._kept_iterator}
        self.rng = rng_states()
        self._losses: Any = None
        self._losses_used: List[torch.Tensor] = []
        self._rejected_micro_batch: Optional[int] = None
        model: Any = kwargs.get("model")  # a chunk or a list of chunks: a required keyword of the schedule
        self.chunks: List[torch.nn.Module] = list(model) if isinstance(model, list) else [model]

    def run(self) -> Any:
        with _keeping_losses_used(self._losses_used):
            self._losses = self._schedule(**self.kwargs)
        return self._losses

    def original_losses(self) -> Tuple[Optional[bool], Optional[int]]:
        """The training pass's losses: all finite?, and the first micro-batch whose loss was not."""
        if self._rejected_micro_batch is not None:
            return False, self._rejected_micro_batch
        return loss_state(self._losses, self._losses_used)

    def ended_early(self, micro_batch: int) -> None:
        """The pass raised at ``micro_batch``: a pass again runs the micro-batches up to that one."""
        self._rejected_micro_batch = micro_batch
        self.kwargs = {**self.kwargs, "num_microbatches": micro_batch + 1}

    def not_raised_together(self) -> Optional[str]:
        """Why this model-parallel group's other ranks did not raise with this one at a rejected loss. Its
        tensor-parallel ranks compute the same loss and raise together, each within moments; a rank whose
        own loss went bad alone (a device fault on it) finds the others gone on to backward: they never
        join this rank's collectives, so it waits for them at most ``RAISED_TOGETHER_SECONDS``, not for the
        job's collective timeout."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            return ("pipeline parallelism: only the last stage computes the loss, the other stages wait in"
                    " their point-to-point exchange and cannot run the step again with it")
        peers = _ranks(self._group("model"))
        if len(peers) == 1:
            return None
        if not _raised_with(peers):
            return (f"the other ranks of this model-parallel group did not raise with this one within"
                    f" {RAISED_TOGETHER_SECONDS:.0f} s: their loss was finite, this rank's went bad alone")
        return None

    def micro_batches(self) -> List[Any]:
        """The items the first data iterator yielded this step, in order (empty without one)."""
        first = self._first_iterator()
        return list(first.items) if first is not None else []

    def _first_iterator(self) -> Optional[KeepingIterator]:
        return self._kept_iterator[0] if isinstance(self._kept_iterator, list) else self._kept_iterator

    def samples(self, micro_batch: int) -> Optional[Dict[str, Any]]:
        """Where micro-batch ``micro_batch`` came from in the data (``data.micro_batch_samples``)."""
        first = self._first_iterator()
        return micro_batch_samples(micro_batch, first.source if first is not None else None)

    def forward(self, on_reduction: Optional[Callable[[torch.Tensor], Callable[[torch.Tensor], None]]] = None
                ) -> Tuple[Optional[bool], Optional[int]]:
        """The step's forward pass again: same micro-batches, from the RNG state the step started with,
        without gradients; the RNG state is put back as it was. Its losses as ``loss_state`` reads them
        (the schedule runs the loss function in a forward-only pass too). ``on_reduction``: see
        ``events.RerunnableStep.forward``."""
        from megatron.core.utils import get_model_config

        before = rng_states()
        set_rng_states(self.rng)
        used: List[torch.Tensor] = []
        try:
            with torch.no_grad(), diagnostic_pass(get_model_config(self.chunks[0]), self.chunks), \
                    _reductions_watched(on_reduction), _keeping_losses_used(used):
                losses = self._schedule(**{**self.kwargs, "data_iterator": _replaying(self._kept_iterator),
                                           "forward_only": True})
        finally:
            set_rng_states(before)
        return loss_state(losses, used)

    def cannot_rerun(self, seen_by: Optional[FrozenSet[int]]) -> Optional[str]:
        """Why the forward pass cannot run again here, or None. ``seen_by``: the global ranks known to meet
        this incident (None: every rank of the job). Expert parallelism runs again where every rank of the
        expert tensor-model-pipeline group is among them (the experts' part of the grad norm is reduced over
        that group, so an expert's non-finite gradient brings the whole group in together), and where that
        group holds each member's model-parallel group (expert tensor parallelism as tensor parallelism)."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        if getattr(get_model_config(self.chunks[0]), "fp8", None):
            return "FP8 keeps scaling history that a second forward pass would change"
        if parallel_state.get_context_parallel_world_size() > 1 and seen_by is not None:
            return ("context parallelism: the forward pass needs ranks of other data-parallel replicas, which"
                    " did not all see this incident")
        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return None
        forward, exchange = (_ranks(self._group(name)) for name in ("forward", "exchange"))
        if not (_ranks(self._group("model")) <= forward and _ranks(self._group("tensor")) <= exchange):
            return ("expert parallelism with expert tensor parallelism other than tensor parallelism: the"
                    " ranks whose activations meet are not one group")
        missing = forward - seen_by if seen_by is not None else frozenset()
        if missing:
            return (f"expert parallelism: the forward pass needs ranks {rank_ranges(missing)} of other"
                    " data-parallel replicas, not known to have met this incident (only a non-finite experts'"
                    " part of the grad norm brings them all in)")
        return None

    def deciding_group(self, seen_by: Optional[FrozenSet[int]]) -> str:
        """The group whose ranks decide together whether to run the step again: "forward" where the forward
        pass spans replicas (expert parallelism) and every rank of it is known to meet this incident (in
        ``seen_by``; None: the whole job), else "model"."""
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return "model"
        return "forward" if seen_by is None or _ranks(self._group("forward")) <= seen_by else "model"

    def leads_replica(self) -> bool:
        """Whether this rank is the first of its model-parallel group (one data-parallel replica)."""
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group().rank() == 0

    def all_reduce(self, values: Sequence[float], op: str, group: str) -> List[float]:
        """``values`` reduced ("max" or "min") over a group ``events.RerunnableStep.all_reduce`` names."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.MIN
        torch.distributed.all_reduce(tensor, op=reduce_op, group=self._group(group))
        return tensor.tolist()

    @staticmethod
    def _group(name: str) -> Any:
        from megatron.core import parallel_state

        experts = parallel_state.get_expert_model_parallel_world_size() > 1
        if name == "exchange":
            name = "expert_exchange" if experts else "tensor"
        if name == "forward":
            name = "expert_forward" if experts else "model"
        return {"tensor": parallel_state.get_tensor_model_parallel_group,
                "model": parallel_state.get_model_parallel_group,
                "expert_exchange": parallel_state.get_expert_tensor_and_model_parallel_group,
                "expert_forward": parallel_state.get_expert_tensor_model_pipeline_parallel_group}[name]()


RAISED_TOGETHER_SECONDS = 30.0  # ranks that raise together at a rejected loss do so within moments
_ASKS = itertools.count(1)  # this process's asks, each under keys of its own in the store


def _raised_with(peers: FrozenSet[int]) -> bool:
    """Whether every rank of ``peers`` raised with this one: each says so in the job's rendezvous store
    and waits for the others' word, at most ``RAISED_TOGETHER_SECONDS``. A store, not a collective: a
    collective that a peer never joins stays pending and keeps this process from exiting."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    key = f"gradnan/raised/{next(_ASKS)}/"
    store.set(key + str(torch.distributed.get_rank()), "1")
    try:
        store.wait([key + str(rank) for rank in sorted(peers)], timedelta(seconds=RAISED_TOGETHER_SECONDS))
    except RuntimeError:  # the store's timeout (DistStoreError is one)
        return False
    return True


def _ranks(group: Any) -> FrozenSet[int]:
    return frozenset(torch.distributed.get_process_group_ranks(group))


def megatron_reruns_in_place() -> bool:
    """Whether this call is Megatron's own rerun of the step (``RerunStateMachine`` in its
    ``RERUNNING_IN_PLACE`` state): the step kept from its first call stays kept, with the failing pass's
    losses (the rerun's may be finite) and the same micro-batches (Megatron rewinds its data iterators)."""
    from megatron.core import rerun_state_machine

    machine = rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE  # None until a run creates it
    return getattr(getattr(machine, "state", None), "name", "") == "RERUNNING_IN_PLACE"


class ScheduleInstrumentor(Instrumentor):
    name = "schedules"
    description = "forward-backward schedules (megatron.core.pipeline_parallel.schedules.forward_backward_*)"
    without = "no in-place rerun of the failing step"

    def _apply(self, patcher: Patcher, runtime: Events) -> None:
        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")

        def make_wrapper(original):
            def wrapper(*args, **kwargs):
                if (args or kwargs.get("forward_only") or not runtime.keeps_steps()
                        or megatron_reruns_in_place()):
                    return original(*args, **kwargs)
                kept = runtime.guarded("rerun", KeptStep, original, kwargs)
                try:
                    if kept is None:
                        return original(*args, **kwargs)
                    result = kept.run()
                except Exception:
                    # Megatron's loss check may have raised (--rerun-mode disabled): gradnan's incident
                    # first, then the very same exception goes on to the user
                    runtime.guarded("rerun", runtime.schedule_raised, kept)
                    raise
                runtime.guarded("rerun", runtime.step_kept, kept)
                return result

            return wrapper

        for name in SCHEDULES:
            patcher.wrap(schedules, name, make_wrapper)
