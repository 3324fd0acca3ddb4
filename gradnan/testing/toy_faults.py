"""The toy job's fault injection: how each Injection.where is planted on one rank at one step (gradient
and forward hooks, a poisoned tensor-parallel reduction, weights, optimizer state, main grads, Megatron's
memory buffer), and the lookups by global parameter or module name they share.

Apart from toy because this is the one place that corrupts a healthy run on purpose: a reader checking
what a test's Injection really does to Megatron reads it here, without the model or the training loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from ..training.scan import integer_view
from .toy_job import Injection, TinyGPTJob


def _param_by_global_name(chunks, name: str):
    from gradnan.patches.model import global_named_parameters

    return next((param for param_name, param in global_named_parameters(chunks) if param_name == name), None)


def _module_by_global_name(chunks, name: str):
    from gradnan.patches.model import global_named_modules

    return next((module for module_name, module in global_named_modules(chunks) if module_name == name), None)


def _poisoned(tensor: torch.Tensor, index: int, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[index] = value
    return tensor


def _poison_first(outputs: Any, index: int, value: float) -> Any:
    """Poison the first tensor of a module's output(s) (Megatron layers return ``(output, bias)``)."""
    if isinstance(outputs, torch.Tensor):
        return _poisoned(outputs, index, value)
    return (_poisoned(outputs[0], index, value), *outputs[1:])


def _due(job: TinyGPTJob, rank: int, step: int, where: str):
    for injection in job.injections:
        if injection.rank == rank and injection.step == step and injection.where == where:
            yield injection


def _resolve(injection: Injection, chunks, optimizer) -> Tuple[Any, int]:
    from gradnan.patches.optimizer_params import owned_start

    param = _param_by_global_name(chunks, injection.target)
    if param is None:
        raise ValueError(f"no parameter named {injection.target} on this rank")
    index = injection.index if injection.index is not None else owned_start(optimizer, param)
    return param, index


def _fails_without_grad(module, args):
    if not torch.is_grad_enabled():
        raise RuntimeError("injected failure in a forward pass without gradients")


def _gradient_fault(index: int, value: float, transient: bool):
    fired: List[bool] = []

    def hook(grad):
        if transient and fired:
            return grad
        fired.append(True)
        return _poisoned(grad, index, value)

    return hook


def _forward_fault(index: int, value: float, transient: bool):
    fired: List[bool] = []

    def hook(_module, _args, outputs):
        if transient and fired:
            return outputs
        fired.append(True)
        return _poison_first(outputs, index, value)

    return hook


class _ReductionFault:
    """Poisons the result of the tensor-parallel reductions made inside ``module``'s forward (Megatron's
    ``reduce_from_tensor_model_parallel_region``, as ``tensor_parallel.layers`` calls it); ``remove``
    undoes it."""

    def __init__(self, module, index: int, value: float) -> None:
        from megatron.core.tensor_parallel import layers

        self._layers, self._original = layers, layers.reduce_from_tensor_model_parallel_region
        inside: List[bool] = []

        def reduction(partial, *args, **kwargs):
            reduced = self._original(partial, *args, **kwargs)
            return _poisoned(reduced, index, value) if inside else reduced

        self._handles = [module.register_forward_pre_hook(lambda *_: inside.append(True)),
                         module.register_forward_hook(lambda *_: inside.clear())]
        layers.reduce_from_tensor_model_parallel_region = reduction

    def remove(self) -> None:
        self._layers.reduce_from_tensor_model_parallel_region = self._original
        for handle in self._handles:
            handle.remove()


class _LinkFault:
    """Poisons what this rank receives over the pipeline's point-to-point link (``where`` "p2p_forward": the
    activation from the previous stage; "p2p_backward": the gradient from the next one), under
    ``p2p_communication._communicate`` (its transfer functions, looked up when it runs), once the transfer
    finished: the sender's tensor was finite, what arrived is not. ``remove`` undoes it."""

    _RECEIVED = {"p2p_forward": "tensor_recv_prev", "p2p_backward": "tensor_recv_next"}

    def __init__(self, where: str, index: int, value: float) -> None:
        from megatron.core.pipeline_parallel import p2p_communication

        self._module = p2p_communication
        self._originals = {name: getattr(p2p_communication, name)
                           for name in ("_batched_p2p_ops", "_p2p_ops")}
        received = self._RECEIVED[where]

        def poisoning(original):
            def transfer(**kwargs):
                requests = original(**kwargs)
                for request in (requests.values() if isinstance(requests, dict) else requests):
                    request.wait()
                if kwargs.get(received) is not None:
                    with torch.no_grad():
                        kwargs[received].view(-1)[index] = value
                return type(requests)()

            return transfer

        for name, original in self._originals.items():
            setattr(p2p_communication, name, poisoning(original))

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(self._module, name, original)


def _arm_hook_injections(job, rank, step, chunks, optimizer, result) -> List[Any]:
    """Register this step's backward, module_backward and forward injections; return their handles."""
    handles = []
    for injection in _due(job, rank, step, "backward"):
        param, index = _resolve(injection, chunks, optimizer)
        handles.append(param.register_hook(_gradient_fault(index, injection.number(), injection.transient)))
        result.injected.append({**dataclasses.asdict(injection), "index": index})
    for injection in _due(job, rank, step, "fails_without_grad"):
        module = _module_by_global_name(chunks, injection.target)
        handles.append(module.register_forward_pre_hook(_fails_without_grad))
        result.injected.append(dataclasses.asdict(injection))
    for injection in _due(job, rank, step, "tp_reduction"):
        module = _module_by_global_name(chunks, injection.target)
        handles.append(_ReductionFault(module, injection.index or 0, injection.number()))
        result.injected.append(dataclasses.asdict(injection))
    for where in _LinkFault._RECEIVED:
        for injection in _due(job, rank, step, where):
            handles.append(_LinkFault(where, injection.index or 0, injection.number()))
            result.injected.append(dataclasses.asdict(injection))
    for where in ("module_backward", "forward"):
        for injection in _due(job, rank, step, where):
            module = _module_by_global_name(chunks, injection.target)
            if module is None:
                raise ValueError(f"no module named {injection.target} on this rank")
            index, value = injection.index or 0, injection.number()
            if where == "forward":
                handles.append(module.register_forward_hook(
                    _forward_fault(index, value, injection.transient)))
            else:
                handles.append(module.register_full_backward_pre_hook(
                    lambda _m, grads, index=index, value=value: _poison_first(grads, index, value)))
            result.injected.append({**dataclasses.asdict(injection), "index": index})
    return handles


def _apply_scale_injections(job, rank, step, chunks, result) -> None:
    for injection in _due(job, rank, step, "scale_to"):
        param = _param_by_global_name(chunks, injection.target)
        if param is None:
            raise ValueError(f"no parameter named {injection.target} on this rank")
        with torch.no_grad():
            # a Python number: a 0-dim CUDA tensor would be cast to the parameter's dtype first (1e6 is
            # fp16 Inf), where a CPU scalar is applied in float32
            param.mul_(injection.number() / float(param.abs().max()))
            main = getattr(param, "main_param", None)  # the fp32 copy a Float16 optimizer steps
            if main is not None and main.shape == param.shape:
                main.copy_(param.float())
        result.injected.append(dataclasses.asdict(injection))


def _apply_memory_buffer_injections(job, rank, step, result) -> None:
    from megatron.core import parallel_state

    for injection in _due(job, rank, step, "memory_buffer"):
        for scratch in parallel_state.get_global_memory_buffer().buffer.values():
            scratch.fill_(injection.number())
        result.injected.append(dataclasses.asdict(injection))


def _stepped_copies(optimizer, param) -> List[Tuple[torch.Tensor, Dict[str, torch.Tensor], int, int]]:
    """``(copy the optimizer steps, its state, first and end flat index of the model parameter it holds)``
    for each copy of ``param`` this rank's optimizer steps (the parameter itself where it steps that)."""
    from gradnan.patches.optimizer_params import param_tensors

    held = param_tensors(optimizer)
    return [(tensors.main if tensors.main is not None else tensors.model, tensors.state,
             *(slot.shard or (0, param.numel()))) for slot, tensors in zip(held.slots, held.stepped)
            if tensors.model is param]


def _apply_weight_injections(job, rank, step, chunks, optimizer, result) -> None:
    """``"weight"``: one element; ``"row"``: every element of row ``index`` (a 2-D parameter's)."""
    for injection in [*_due(job, rank, step, "weight"), *_due(job, rank, step, "row")]:
        param = _param_by_global_name(chunks, injection.target)
        if param is None:
            raise ValueError(f"no parameter named {injection.target} on this rank")
        index = injection.index or 0
        width = param.shape[-1] if injection.where == "row" else 1
        with torch.no_grad():
            for element in range(index * width, (index + 1) * width):
                param.view(-1)[element] = injection.number()
                for copy, _, start, end in _stepped_copies(optimizer, param):
                    if start <= element < end and copy is not param:
                        copy.view(-1)[element - start] = injection.number()
        result.injected.append({**dataclasses.asdict(injection), "index": index})


EXPONENT_LOWEST_BIT = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _kept_shared_copy(optimizer, param) -> torch.Tensor:
    """The copy of ``param`` that data-parallel replicas share and that outlives the step: the whole fp32
    main copy a mixed-precision optimizer steps (without a distributed optimizer; it writes the model
    parameter at each update), else the model parameter itself (fp32 training; the distributed optimizer's
    gathered parameter, until its next gather)."""
    from gradnan.patches.optimizer_params import param_tensors

    held = param_tensors(optimizer)
    return next((tensors.main for slot, tensors in zip(held.slots, held.stepped)
                 if tensors.model is param and tensors.main is not None and slot.shard is None), param)


def _apply_bit_flip_injections(job, rank, step, chunks, optimizer, result) -> None:
    """Flip bit ``value`` ("exponent": its exponent's lowest, which doubles or halves a finite value) of
    element ``index`` (default 0) of the kept shared copy of parameter ``target`` (``_kept_shared_copy``)
    before the step's forward: a silent corruption of one replica's weights, finite."""
    for injection in _due(job, rank, step, "bit_flip"):
        param = _param_by_global_name(chunks, injection.target)
        if param is None:
            raise ValueError(f"no parameter named {injection.target} on this rank")
        copy, index = _kept_shared_copy(optimizer, param), injection.index or 0
        bit = EXPONENT_LOWEST_BIT[copy.dtype] if injection.value == "exponent" else int(injection.value)
        with torch.no_grad():
            bits = integer_view(copy).view(-1)
            bits[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(bits.dtype)
        result.injected.append({**dataclasses.asdict(injection), "index": index,
                                "copy": "model" if copy is param else "main"})


def _apply_learning_rate_injections(job, rank, step, optimizer, result) -> None:
    """Every param group's learning rate set to the injection's value for this step's update on (and
    after) it, as a broken schedule would: ``target`` is not used."""
    for injection in _due(job, rank, step, "learning_rate"):
        for group in optimizer.param_groups:
            group["lr"] = injection.number()
        result.injected.append(dataclasses.asdict(injection))


def _apply_loss_scale_injections(job, rank, step, optimizer, result) -> None:
    """fp16's dynamic loss scale set to the injection's value before the step's forward (and left so: the
    scaler halves it at each skip, and half of +Inf is +Inf), as a bad resume of the scaler's state or a
    broken scaler leaves it: ``target`` is not used."""
    for injection in _due(job, rank, step, "loss_scale"):
        for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            leaf.grad_scaler._scale.fill_(injection.number())
        result.injected.append(dataclasses.asdict(injection))


def _apply_optimizer_state_injections(job, rank, step, chunks, optimizer, result) -> None:
    """A rank whose optimizer does not hold the element (another rank's distributed-optimizer shard) plants
    nothing and lists nothing in ``result.injected``: plant on every rank to corrupt the owner's."""
    for injection in _due(job, rank, step, "optimizer_state"):
        param = _param_by_global_name(chunks, injection.target)
        if param is None:
            raise ValueError(f"no parameter named {injection.target} on this rank")
        index = injection.index or 0
        for _, state, start, end in _stepped_copies(optimizer, param):
            if start <= index < end and injection.state in state:
                with torch.no_grad():
                    state[injection.state].view(-1)[index - start] = injection.number()
                result.injected.append({**dataclasses.asdict(injection), "index": index})


def _apply_main_grad_injections(job, rank, step, chunks, optimizer, result) -> None:
    """An explicit ``index`` outside what this rank's optimizer steps (another rank's distributed-optimizer
    shard, which it never reads) plants nothing and lists nothing: plant on every replica to hit the
    owner."""
    for injection in _due(job, rank, step, "main_grad"):
        param, index = _resolve(injection, chunks, optimizer)
        if injection.index is not None and not any(start <= index < end for _, _, start, end
                                                   in _stepped_copies(optimizer, param)):
            continue
        param.main_grad.view(-1)[index] = injection.number()
        result.injected.append({**dataclasses.asdict(injection), "index": index})
