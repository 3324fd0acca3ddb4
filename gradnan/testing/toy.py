"""A tiny real Megatron-Core GPT trained on CPU with gloo: the demo's job, the tests' and benchmarks' harness.

Everything Megatron here is the real library (``GPTModel``, Megatron DDP, ``get_megatron_optimizer``, the
pipeline schedules); only CUDA is replaced by the CPU shim, or, with ``device="cuda"`` on a GPU machine, not
even that (NCCL, one GPU per rank). Faults are injected on purpose, through ``Injection``, into one named
parameter's gradient on one rank at one step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import math
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .gloo import free_port, gloo_process, one_job


@dataclass(frozen=True)
class Injection:
    """Put ``value`` on global ``rank`` at ``step`` into what ``target`` names (a global name).

    ``where`` says how:
    - ``"main_grad"``: into parameter ``target``'s reduced gradient right before ``optimizer.step()``
      (a corruption after the data-parallel collective);
    - ``"backward"``: into parameter ``target``'s gradient as backward produces it, before any
      collective (what a bad card or a bad kernel does to one weight gradient);
    - ``"module_backward"``: into the output gradient of module ``target`` during backward, so every
      gradient computed from it (that module's and all earlier layers') is poisoned;
    - ``"forward"``: into the output of module ``target`` in the forward pass (an activation overflow);
    - ``"scale_to"``: rescale parameter ``target`` so its largest magnitude is ``value`` (a number), once,
      before the step's forward: drives a later operator to overflow for as long as the weight stays;
    - ``"fails_without_grad"``: module ``target`` raises in any forward pass made without gradients (as
      the rerun of a failing step is): shows that a rerun that fails leaves training as it was;
    - ``"memory_buffer"``: fill Megatron's global memory buffer (the ``torch.empty`` scratch its attention
      hands ``baddbmm`` with ``beta=0``, never written) with ``value`` before the step's forward, as
      uninitialized memory may hold it (``target`` is not used).
    - ``"weight"``: set element ``index`` of parameter ``target`` before the step's forward, in the model
      parameter and in every copy the optimizer steps (its fp32 main copy, or this rank's
      distributed-optimizer shard where it holds the element), as a corrupted checkpoint or a bad write
      leaves a weight;
    - ``"optimizer_state"``: set element ``index`` (default 0) of the optimizer's ``state`` tensor
      (``exp_avg_sq``, ``exp_avg``) of parameter ``target`` right before ``optimizer.step()``, where this
      rank's optimizer holds that element: the update then writes a bad weight from finite gradients (a
      step after the first: Adam builds its state at its first step);
    - ``"tp_reduction"``: the result of module ``target``'s tensor-parallel reduction (a row-parallel
      linear's all-reduce of its partial sums) on this rank: what a faulty transfer or reduction delivers
      from finite partial sums;
    - ``"loss"``: the loss function of micro-batch ``index`` (default 0) divides a zero sum by a zero
      count, as a micro-batch without a valid token does: NaN from a finite model output (``target``
      is not used; the rank is any of the replica's last pipeline stage).
    ``index`` is a flat element index; None picks the first element this rank's optimizer steps.
    ``transient``: a ``"forward"`` or ``"backward"`` fault that fires in the step's first pass only, as a
    glitch would: a rerun of the same step (``gradnan``'s, or Megatron's own) does not meet it again.
    """

    rank: int
    step: int
    target: str
    value: str = "nan"
    where: str = "main_grad"
    index: Optional[int] = None
    transient: bool = False
    state: str = "exp_avg_sq"

    def number(self) -> float:
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(self.value) or float(self.value)


@dataclass(frozen=True)
class TinyGPTJob:
    world_size: int = 2
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved schedule when > 1)
    dtype: str = "fp32"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    check_for_nan_in_grad: bool = False
    steps: int = 3
    micro_batches: int = 1
    num_layers: int = 2
    hidden_size: int = 32
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    recompute: bool = False
    position_embedding: str = "learned_absolute"
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    injections: Tuple[Injection, ...] = ()
    # install() options; strict=True unless given: an internal error fails the job
    gradnan: Optional[Dict[str, Any]] = None
    quiet: bool = False
    count_host_syncs: bool = False
    experts: int = 0  # MoE: experts per MLP (0: dense), spread over ``ep`` expert-parallel ranks
    ep: int = 1
    # Megatron's grad norm as a one-element tensor, as core 0.18+ with TE returns it
    norm_as_tensor: bool = False
    # core 0.19+: bf16 gradient buffers, every parameter's main_grad accumulated locally in fp32 and copied
    # into the buffer inside start_grad_sync (``param_name_patterns_for_fp32_local_accumulation=("all",)``)
    fp32_local_accumulation: bool = False
    initial_loss_scale: float = 2.0**12  # fp16: Megatron-LM's default is 2**32
    # hidden and attention dropout: steps draw from the RNG (torch's and Megatron's tracker)
    dropout: float = 0.0
    # Megatron's RerunStateMachine in this mode ("disabled", "validate_results", "report_determinism_stats"),
    # as Megatron-LM's train_step drives it, its loss_func validating every loss (torch.isnan, fatal);
    # None: no state machine, no loss check. "disabled" raises at a NaN loss; "validate_results" runs the
    # step again in place, then the job checkpoints and exits (here: stops training) before the update
    rerun_mode: Optional[str] = None
    # "cpu": gloo and the CPU shim; "cuda": NCCL and one real GPU per rank (the GPU machine's tests)
    device: str = "cpu"
    # "module:function", called as function(job, rank) in each job process before the model is built: what
    # a test puts in place there that a CI machine lacks (a stand-in for pynvml, Megatron-LM's TensorBoard
    # writer where Megatron-LM's loop would hold it)
    prepare: Optional[str] = None
    # "module:function", called as function(job, rank) in each job process after its last step: what
    # Megatron-LM's loop does at its end (it finishes its W&B run, whose records reach disk only then)
    finish: Optional[str] = None
    # "random": random token batches; "mock_gpt": megatron-core's MockGPTDataset, read as Megatron-LM's
    # training loop reads it (``MegatronLMData``), with its arguments where Megatron-LM keeps them
    data: str = "random"
    # global sample indices of the mock data whose token at ``poison_position`` is the poisoned token: one the
    # data never holds otherwise, whose embedding row is finite but so large (``POISON_ROW``) that the first
    # layer norm's variance overflows to NaN: data that fails wherever it is read, every weight finite
    poisoned_samples: Tuple[int, ...] = ()
    poison_position: int = 3

    def with_(self, **changes: Any) -> "TinyGPTJob":
        return dataclasses.replace(self, **changes)


@dataclass
class StepResult:
    step: int
    loss: Optional[float]
    grad_norm: Optional[float]
    update_successful: bool
    # count_host_syncs: on CPU the tensor calls that would make the host wait; on CUDA the synchronizations
    # the CUDA runtime itself reports (torch.cuda.set_sync_debug_mode)
    host_syncs: Optional[int] = None


@dataclass
class WorkerResult:
    rank: int
    steps: List[StepResult] = field(default_factory=list)
    injected: List[Dict[str, Any]] = field(default_factory=list)
    bucket_groups: int = 0
    exit_code: Optional[int] = None  # Megatron's result validation asked the job to exit (validate_results)
    param_digest: Optional[str] = None  # SHA-256 of every parameter's bytes after the last step


class JobFailed(RuntimeError):
    """A job's process raised; ``errors`` holds each failing rank's own error (``job<n>_rank<r>``)."""

    def __init__(self, errors: Dict[str, str]) -> None:
        super().__init__("; ".join(f"{where}: {error}" for where, error in errors.items())
                         or "a process failed")
        self.errors = errors


def _build_chunks(job: TinyGPTJob):
    """The model config and this pipeline rank's model chunks (``job.vpp`` of them)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.dtype]
    config = TransformerConfig(
        num_layers=job.num_layers,
        hidden_size=job.hidden_size,
        ffn_hidden_size=job.ffn_hidden_size or 4 * job.hidden_size,
        num_attention_heads=job.num_heads,
        use_cpu_initialization=True,
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=job.dtype == "bf16",
        fp16=job.dtype == "fp16",
        hidden_dropout=job.dropout,
        attention_dropout=job.dropout,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if job.recompute else {}),
        # MoE: experts without biases (core 0.13/0.14 assert it)
        **({"num_moe_experts": job.experts, "expert_model_parallel_size": job.ep, "moe_router_topk": 2,
            "moe_token_dispatcher_type": "allgather", "add_bias_linear": False} if job.experts else {}),
        **({"virtual_pipeline_model_parallel_size": job.vpp} if job.vpp > 1 else {}),
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    def chunk(vp_stage: int):
        if job.vpp == 1:
            return {"pre_process": pp_rank == 0, "post_process": pp_rank == job.pp - 1}
        if "vp_stage" not in inspect.signature(parallel_state.is_pipeline_first_stage).parameters:
            # core 0.12: the chunk being built is a global of parallel_state, not an argument
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
            return {"pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False),
                    "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False)}
        return {"vp_stage": vp_stage,
                "pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                      vp_stage=vp_stage),
                "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                      vp_stage=vp_stage)}

    chunks = [GPTModel(config=config,
                       transformer_layer_spec=get_gpt_layer_local_spec(num_experts=job.experts or None),
                       vocab_size=job.vocab_size, max_sequence_length=job.seq_length,
                       position_embedding_type=job.position_embedding, **chunk(vp_stage))
              for vp_stage in range(job.vpp)]
    return config, chunks


def _wrap_model(job: TinyGPTJob, config, model, bucketing: bool = True):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if job.dtype != "fp32":
        model = Float16Module(config, model)
    local_accumulation = {"param_name_patterns_for_fp32_local_accumulation": ("all",)} \
        if job.fp32_local_accumulation else {}
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=job.dtype != "fp32" and not job.fp32_local_accumulation, **local_accumulation,
        overlap_grad_reduce=job.overlap_grad_reduce,
        overlap_param_gather=job.overlap_param_gather,
        use_distributed_optimizer=job.distributed_optimizer,
        check_for_nan_in_grad=job.check_for_nan_in_grad,
        bucket_size=job.bucket_size,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                   disable_bucketing=not bucketing)


def _batches(job: TinyGPTJob, dp_rank: int):
    """The same micro-batches on every device: drawn on the CPU, then moved to the job's device."""
    generator = torch.Generator().manual_seed(job.seed + 7919 * dp_rank)
    mask = torch.triu(torch.ones(job.seq_length, job.seq_length, dtype=torch.bool), diagonal=1)
    position_ids = torch.arange(job.seq_length).unsqueeze(0).expand(job.micro_batch_size, -1)
    while True:
        tokens = torch.randint(
            0, job.vocab_size, (job.micro_batch_size, job.seq_length + 1), generator=generator
        )
        yield {name: tensor.to(job.device) for name, tensor in {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": position_ids,
            "attention_mask": mask.view(1, 1, job.seq_length, job.seq_length),
        }.items()}


POISON_TOKEN_FROM_END = 1  # the poisoned token is the model's last vocabulary entry
POISON_ROW = 1e38


class _TinyTokenizer:
    """What megatron-core's GPT datasets read of a tokenizer."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, 0, 1
        self.unique_identifiers = {"class": "TinyTokenizer", "vocab_size": vocab_size}


class PoisonedSamples(torch.utils.data.Dataset):
    """``dataset`` with the token at ``position`` of each sample in ``poisoned`` replaced by ``token``."""

    def __init__(self, dataset: Any, poisoned: Tuple[int, ...], position: int, token: int) -> None:
        self.dataset, self.poisoned, self.position, self.token = dataset, set(poisoned), position, token

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = self.dataset[index]
        # megatron-core before 0.13 counts mock tokens up past any vocabulary (0.13+ wraps them at the
        # tokenizer's, which is below the poisoned token): wrapped there, the same data on every version
        sample = {**sample, "tokens": sample["tokens"] % self.token, "labels": sample["labels"] % self.token}
        if index in self.poisoned:
            sample["tokens"][self.position] = self.token
        return sample


def _pretraining_sampler(consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Megatron-LM's ``MegatronPretrainingSampler`` (``--dataloader-type single``) as its ``__iter__``
    walks the indices: rounds of ``micro_batch_size * dp_size``, this rank's block of each."""
    batch = []
    for index in range(consumed, 1 << 62):
        batch.append(index)
        if len(batch) == micro_batch_size * dp_size:
            yield batch[dp_rank * micro_batch_size:(dp_rank + 1) * micro_batch_size]
            batch = []


class MegatronLMData:
    """Megatron-LM's data path on megatron-core's real ``MockGPTDataset``: a torch ``DataLoader`` over it
    with Megatron-LM's pretraining sampler, and its arguments (``consumed_train_samples``,
    ``curr_iteration``, ...) in ``megatron.training.global_vars._GLOBAL_ARGS``, counted as its training
    loop counts them (Megatron-LM itself is not installable here)."""

    def __init__(self, job: "TinyGPTJob", dp_rank: int, dp_size: int) -> None:
        import sys
        import types

        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

        config = GPTDatasetConfig(random_seed=job.seed, sequence_length=job.seq_length,
                                  tokenizer=_TinyTokenizer(job.vocab_size - POISON_TOKEN_FROM_END),
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  split="1,0,0")
        dataset, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [None, None, None], lambda: True,
                                                      config).build()
        self.dataset = PoisonedSamples(dataset, job.poisoned_samples, job.poison_position,
                                       job.vocab_size - POISON_TOKEN_FROM_END)
        self.job, self.dp_rank, self.dp_size = job, dp_rank, dp_size
        self.args = types.SimpleNamespace(consumed_train_samples=0, curr_iteration=0,
                                          dataloader_type="single", micro_batch_size=job.micro_batch_size)
        module = types.ModuleType("megatron.training.global_vars")
        module._GLOBAL_ARGS = self.args
        self._saved = sys.modules.get(module.__name__)
        sys.modules[module.__name__] = module

    def iterator(self) -> Iterator[Any]:
        sampler = _pretraining_sampler(self.args.consumed_train_samples, self.job.micro_batch_size,
                                       self.dp_rank, self.dp_size)
        return iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler))

    def iteration_done(self) -> None:
        self.args.curr_iteration += 1
        self.args.consumed_train_samples += self.dp_size * self.job.micro_batch_size * self.job.micro_batches

    def close(self) -> None:
        import sys

        sys.modules.pop("megatron.training.global_vars", None)
        if self._saved is not None:
            sys.modules["megatron.training.global_vars"] = self._saved


def _poison_token_row(chunks, token: int) -> None:
    """The poisoned token's embedding row ``POISON_ROW`` (on the stage that embeds)."""
    weight = _param_by_global_name(chunks, "embedding.word_embeddings.weight")
    if weight is not None:
        with torch.no_grad():
            weight[token] = POISON_ROW


def _forward_step(data_iterator, model, validate: bool = False, empty_micro_batches: Tuple[int, ...] = (),
                  calls: Optional[List[int]] = None, micro_batches: int = 1):
    """``empty_micro_batches``: the micro-batches (numbered by ``calls``, a counter shared by a step's
    passes, modulo ``micro_batches``) whose loss divides a zero sum by a zero token count."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    micro_batch = None
    if calls is not None:
        micro_batch = calls[0] % micro_batches
        calls[0] += 1

    def loss_func(output_tensor):
        if micro_batch in empty_micro_batches:
            no_token = output_tensor.float() * 0
            loss = no_token.sum() / no_token.count_nonzero()
        else:
            loss = output_tensor.float().mean()
        if validate:  # as Megatron-LM's pretrain_gpt.py checks its loss
            from megatron.core.rerun_state_machine import get_rerun_state_machine

            get_rerun_state_machine().validate_result(result=loss, rejection_func=torch.isnan,
                                                      message="found NaN in local forward loss calculation",
                                                      tolerance=0.0, fatal=True)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


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
    fired = []

    def hook(grad):
        if transient and fired:
            return grad
        fired.append(True)
        return _poisoned(grad, index, value)

    return hook


def _forward_fault(index: int, value: float, transient: bool):
    fired = []

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
        inside = []

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
    for injection in _due(job, rank, step, "weight"):
        param = _param_by_global_name(chunks, injection.target)
        if param is None:
            raise ValueError(f"no parameter named {injection.target} on this rank")
        index = injection.index or 0
        with torch.no_grad():
            param.view(-1)[index] = injection.number()
            for copy, _, start, end in _stepped_copies(optimizer, param):
                if start <= index < end and copy is not param:
                    copy.view(-1)[index - start] = injection.number()
        result.injected.append({**dataclasses.asdict(injection), "index": index})


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


class _ResultValidation:
    """Megatron's ``RerunStateMachine`` in ``mode``, driven as Megatron-LM's ``train_step`` drives it: data
    through ``RerunDataIterator``s (rewound for a rerun), RNG state saved and restored."""

    def __init__(self, batches: List[Iterator[Any]], mode: str) -> None:
        from megatron.core.rerun_state_machine import (
            RerunDataIterator,
            RerunMode,
            initialize_rerun_state_machine,
        )

        from gradnan.patches.schedules import rng_states, set_rng_states

        initialize_rerun_state_machine(state_save_func=rng_states, state_restore_func=set_rng_states,
                                       mode=RerunMode(mode))
        self.iterators = [RerunDataIterator(batch) for batch in batches]
        self.exit_code: Optional[int] = None

    def run(self, forward_backward) -> Any:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine, losses = get_rerun_state_machine(), None
        while machine.should_run_forward_backward(self.iterators):
            losses = forward_backward()
        _, should_exit, exit_code = machine.should_checkpoint_and_exit()
        if should_exit:
            self.exit_code = exit_code
        return losses

    @staticmethod
    def close() -> None:
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        destroy_rerun_state_machine()


class TinyGPT:
    """The model, optimizer and data of a job on this (already initialised) process group.

    ``install`` is called between building the model and building the optimizer, as a user would
    call ``gradnan.install()``; ``step`` runs one full training step and returns its outcome."""

    def __init__(self, job: TinyGPTJob, rank: int, install=None) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.job, self.rank = job, rank
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=job.tp, pipeline_model_parallel_size=job.pp,
            expert_model_parallel_size=job.ep,
            **({"virtual_pipeline_model_parallel_size": job.vpp} if job.vpp > 1 else {}),
        )
        torch.manual_seed(job.seed)
        model_parallel_cuda_manual_seed(job.seed)
        config, models = _build_chunks(job)
        if job.device == "cuda":  # built on the CPU (the same initial weights everywhere), trained on the GPU
            models = [model.cuda() for model in models]
        # as Megatron-LM does: only the first chunk's gradients are bucketed
        self.chunks = [_wrap_model(job, config, model, bucketing=index == 0)
                       for index, model in enumerate(models)]
        self.data = (MegatronLMData(job, parallel_state.get_data_parallel_rank(),
                                    parallel_state.get_data_parallel_world_size())
                     if job.data == "mock_gpt" else None)
        if self.data is not None:  # before the optimizer copies the weights it steps
            _poison_token_row(self.chunks, job.vocab_size - POISON_TOKEN_FROM_END)
        config.finalize_model_grads_func = finalize_model_grads
        no_sync = [chunk.no_sync for chunk in self.chunks]
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        if install is not None:
            install()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                clip_grad=1.0,
                bf16=job.dtype == "bf16",
                fp16=job.dtype == "fp16",
                params_dtype=config.params_dtype,
                use_distributed_optimizer=job.distributed_optimizer,
                initial_loss_scale=job.initial_loss_scale,
            ),
            self.chunks,
        )
        config.grad_scale_func = self.optimizer.scale_loss
        # one iterator per chunk (the interleaved schedule takes a list), each drawing the same micro-batches
        if self.data is not None:
            self.batches = [self.data.iterator() for _ in self.chunks]
        else:
            self.batches = [_batches(job, parallel_state.get_data_parallel_rank()) for _ in self.chunks]
        self.validation = _ResultValidation(self.batches, job.rerun_mode) if job.rerun_mode else None
        if self.validation is not None:
            self.batches = self.validation.iterators
        self.forward_backward = get_forward_backward_func()
        self.result = WorkerResult(rank=rank, bucket_groups=sum(
            len(chunk.bucket_groups) + len(chunk.expert_parallel_bucket_groups) for chunk in self.chunks))

    @property
    def chunk(self):
        """The first model chunk (the only one without virtual pipeline stages)."""
        return self.chunks[0]

    def step(self) -> StepResult:
        if not self.job.count_host_syncs:
            return self._step()
        from gradnan.testing.measure import CudaSyncCounter, HostSyncCounter

        with (CudaSyncCounter() if self.job.device == "cuda" else HostSyncCounter()) as counter:
            outcome = self._step()
        outcome.host_syncs = counter.total
        return outcome

    def _forward_backward(self, step: int):
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        empty = tuple(injection.index or 0 for injection in _due(self.job, self.rank, step, "loss"))
        return self.forward_backward(
            forward_step_func=functools.partial(_forward_step, validate=self.validation is not None,
                                                empty_micro_batches=empty, calls=[0],
                                                micro_batches=self.job.micro_batches),
            data_iterator=self.batches if len(self.chunks) > 1 else self.batches[0],
            model=self.chunks,
            num_microbatches=self.job.micro_batches,
            seq_length=self.job.seq_length,
            micro_batch_size=self.job.micro_batch_size,
            forward_only=False,
        )

    def _step(self) -> StepResult:
        job, rank, chunks, optimizer = self.job, self.rank, self.chunks, self.optimizer
        step = len(self.result.steps) + 1
        _apply_scale_injections(job, rank, step, chunks, self.result)
        _apply_weight_injections(job, rank, step, chunks, optimizer, self.result)
        _apply_memory_buffer_injections(job, rank, step, self.result)
        hooks = _arm_hook_injections(job, rank, step, chunks, optimizer, self.result)
        self.result.injected += [dataclasses.asdict(injection) for injection in _due(job, rank, step, "loss")]
        try:  # the faults stay until the step is over: a rerun of its forward pass meets them again
            if self.validation is None:
                losses = self._forward_backward(step)
            else:
                losses = self.validation.run(functools.partial(self._forward_backward, step))
                if self.validation.exit_code is not None:  # Megatron-LM checkpoints and exits here
                    self.result.exit_code = self.validation.exit_code
                    return StepResult(step, None, None, False)
            _apply_main_grad_injections(job, rank, step, chunks, optimizer, self.result)
            _apply_optimizer_state_injections(job, rank, step, chunks, optimizer, self.result)
            update_successful, grad_norm, _ = optimizer.step()
        finally:
            for hook in hooks:
                hook.remove()
        loss = float(sum(item["lm loss"] for item in losses) / len(losses)) if losses else None
        grad_norm = float(grad_norm) if isinstance(grad_norm, torch.Tensor) else grad_norm
        outcome = StepResult(step, loss, grad_norm, bool(update_successful))
        self.result.steps.append(outcome)
        if self.data is not None:
            self.data.iteration_done()
        return outcome

    def param_digest(self) -> str:
        """SHA-256 over every parameter's raw bytes, chunk by chunk in name order: equal digests mean the
        weights are bitwise equal."""
        digest = hashlib.sha256()
        for chunk in self.chunks:
            for name, param in sorted(chunk.named_parameters()):
                digest.update(name.encode())
                digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


@contextmanager
def _grad_norm_as_tensor() -> Iterator[None]:
    """Megatron's optimizers get their grad norm back as a one-element tensor, as ``get_grad_norm_fp32``
    returns it from core 0.18 with Transformer Engine (0.16's returns a float). Without Transformer Engine
    the clip cannot scale by a tensor (0.17+ asserts so): it is given the number, as a TE build's clip
    reads it on the device."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from gradnan.patches.undo_log import Patcher

    def norm_as_tensor(original):
        def as_tensor(*args, **kwargs):
            return torch.tensor([original(*args, **kwargs)], dtype=torch.float32)

        return as_tensor

    def clip_by_number(original):
        def clip(parameters, max_norm, total_norm, *args, **kwargs):
            number = float(total_norm) if isinstance(total_norm, torch.Tensor) else total_norm
            return original(parameters, max_norm, number, *args, **kwargs)

        return clip

    patcher = Patcher()
    patcher.wrap(megatron_optimizer, "get_grad_norm_fp32", norm_as_tensor)
    patcher.wrap(megatron_optimizer, "clip_grad_by_total_norm_fp32", clip_by_number)
    try:
        yield
    finally:
        patcher.undo()


def train(job: TinyGPTJob, rank: int) -> WorkerResult:
    """Build the model on this (already initialised) process group and train ``job.steps`` steps."""
    import gradnan

    _call_hook(job.prepare, job, rank)
    with one_job(), ExitStack() as stack:
        if job.norm_as_tensor:
            stack.enter_context(_grad_norm_as_tensor())
        model = TinyGPT(job, rank, install=(lambda: gradnan.install(**{"strict": True, **job.gradnan}))
                        if job.gradnan is not None else None)
        try:
            for _ in range(job.steps):
                model.step()
                if model.result.exit_code is not None:
                    break
        finally:
            if model.validation is not None:
                model.validation.close()
            if model.data is not None:
                model.data.close()
        model.result.param_digest = model.param_digest()
    _call_hook(job.finish, job, rank)
    return model.result


def _call_hook(spec: Optional[str], job: TinyGPTJob, rank: int) -> None:
    """A job's ``prepare`` or ``finish``: "module:function", called as function(job, rank)."""
    if spec:
        module, _, function = spec.partition(":")
        getattr(importlib.import_module(module), function)(job, rank)


def _worker(rank: int, jobs: List[TinyGPTJob], port: int, results_dir: str) -> None:
    number = 0
    try:  # every rank's own error, not only the first the launcher sees (a taken port included)
        with gloo_process(rank, jobs[0].world_size, port, quiet=jobs[0].quiet, device=jobs[0].device):
            for number, job in enumerate(jobs):
                result = train(job, rank)
                path = Path(results_dir) / f"job{number}_rank{rank}.json"
                path.write_text(json.dumps(dataclasses.asdict(result)))
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        (Path(results_dir) / f"job{number}_rank{rank}.error").write_text(
            f"{type(exc).__name__}: {first_line}")
        raise


def launch_many(jobs: List[TinyGPTJob]) -> List[Dict[int, WorkerResult]]:
    """Run the jobs one after another in one set of ``world_size`` gloo processes (start-up paid once)."""
    import torch.multiprocessing as mp

    world_size = jobs[0].world_size
    if any((job.world_size, job.device) != (world_size, jobs[0].device) for job in jobs):
        raise ValueError("launch_many needs jobs of one world size and one device")
    with tempfile.TemporaryDirectory(prefix="gradnan-job-") as scratch:
        try:
            mp.spawn(_worker, args=(jobs, free_port(), scratch), nprocs=world_size, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            errors = {path.stem: path.read_text() for path in sorted(Path(scratch).glob("*.error"))}
            raise JobFailed(errors) from exc
        outcome = []
        for number in range(len(jobs)):
            per_rank = {}
            for rank in range(world_size):
                raw = json.loads((Path(scratch) / f"job{number}_rank{rank}.json").read_text())
                raw["steps"] = [StepResult(**step) for step in raw["steps"]]
                per_rank[rank] = WorkerResult(**raw)
            outcome.append(per_rank)
        return outcome


def launch(job: TinyGPTJob) -> Dict[int, WorkerResult]:
    """Run ``job`` in ``job.world_size`` gloo processes; return each rank's losses and grad norms."""
    return launch_many([job])[0]
