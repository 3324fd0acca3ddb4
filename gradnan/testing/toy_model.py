"""The toy job's Megatron model: the TransformerConfig and GPTModel chunks of this pipeline rank,
the Megatron DDP wrapping, and the forward step with its loss function, as Megatron-LM's pretrain_gpt.py
builds them.

Apart from toy because these are the pieces that follow megatron-core's constructors across versions
(the chunk arguments of core 0.12, MoE, virtual pipeline stages); toy drives them through a step.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch

from .toy_job import TinyGPTJob


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
                       position_embedding_type=job.position_embedding,
                       share_embeddings_and_output_weights=job.tied_embeddings, **chunk(vp_stage))
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


def _forward_step(data_iterator, model, validate: bool = False, empty_micro_batches: Tuple[int, ...] = (),
                  calls: Optional[List[int]] = None, micro_batches: int = 1,
                  reported_before: Tuple[int, ...] = ()):
    """``empty_micro_batches``: the micro-batches (numbered by ``calls``, a counter shared by a step's
    passes, modulo ``micro_batches``) whose loss divides a zero sum by a zero token count; of them,
    ``reported_before``: those whose loss function reports (for logging) the finite sum before it divides,
    so that only the loss backward uses is NaN."""
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
            reported = no_token.sum() if micro_batch in reported_before else loss
        else:
            loss = reported = output_tensor.float().mean()
        if validate:  # as Megatron-LM's pretrain_gpt.py checks its loss
            from megatron.core.rerun_state_machine import get_rerun_state_machine

            get_rerun_state_machine().validate_result(result=loss, rejection_func=torch.isnan,
                                                      message="found NaN in local forward loss calculation",
                                                      tolerance=0.0, fatal=True)
        return loss, {"lm loss": reported.detach()}

    return output, loss_func
