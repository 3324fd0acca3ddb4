"""A tiny real Megatron-Core GPT trained on CPU with gloo: the demo's job, the tests' and benchmarks' harness.

Everything Megatron here is the real library (``GPTModel``, Megatron DDP, ``get_megatron_optimizer``, the
pipeline schedules); only CUDA is replaced by the CPU shim, or, with ``device="cuda"`` on a GPU machine, not
even that (NCCL, one GPU per rank). Faults are injected on purpose, through ``Injection``, into one named
parameter's gradient on one rank at one step.

This module runs a job: ``TinyGPT`` (the model, optimizer and data on one process group, one training step
at a time, as Megatron-LM's ``train_step`` drives them) and ``launch``/``launch_many`` (the gloo
processes and their results). What a job is lives in ``toy_job``; the model it builds in ``toy_model``, its
data in ``toy_data`` and the faults it plants in ``toy_faults``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

from .gloo import free_port, gloo_process, one_job
from .toy_data import POISON_TOKEN_FROM_END, MegatronLMData, _batches, _poison_token_row
from .toy_faults import (
    _apply_bit_flip_injections,
    _apply_learning_rate_injections,
    _apply_loss_scale_injections,
    _apply_main_grad_injections,
    _apply_memory_buffer_injections,
    _apply_optimizer_state_injections,
    _apply_scale_injections,
    _apply_weight_injections,
    _arm_hook_injections,
    _due,
)
from .toy_job import JobFailed, StepResult, TinyGPTJob, WorkerResult
from .toy_model import _build_chunks, _forward_step, _wrap_model


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
        unreported = tuple(injection.index or 0
                           for injection in _due(self.job, self.rank, step, "loss_after_report"))
        return self.forward_backward(
            forward_step_func=functools.partial(_forward_step, validate=self.validation is not None,
                                                empty_micro_batches=empty + unreported,
                                                reported_before=unreported, calls=[0],
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
        _apply_bit_flip_injections(job, rank, step, chunks, optimizer, self.result)
        _apply_memory_buffer_injections(job, rank, step, self.result)
        _apply_loss_scale_injections(job, rank, step, optimizer, self.result)
        hooks = _arm_hook_injections(job, rank, step, chunks, optimizer, self.result)
        self.result.injected += [dataclasses.asdict(injection) for where in ("loss", "loss_after_report")
                                 for injection in _due(job, rank, step, where)]
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
            _apply_learning_rate_injections(job, rank, step, optimizer, self.result)
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

    def save(self, checkpoint_dir: str) -> None:
        """The model's and the optimizer's distributed checkpoint, as Megatron-LM saves them, labelled with
        the steps completed (Megatron-LM's ``iter_NNNNNNN``)."""
        from megatron.core import dist_checkpointing

        directory = Path(checkpoint_dir) / f"iter_{len(self.result.steps):07d}"
        directory.mkdir(parents=True, exist_ok=True)
        state: Dict[str, Any] = {}
        for number, chunk in enumerate(self.chunks):
            state.update(chunk.sharded_state_dict(prefix=f"model{number}."))
        dist_checkpointing.save({"model": state, "optimizer": self.optimizer.sharded_state_dict(state)},
                                str(directory))

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
                if job.checkpoint_dir is not None:
                    model.save(job.checkpoint_dir)
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
