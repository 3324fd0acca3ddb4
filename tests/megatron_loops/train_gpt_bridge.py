"""A tiny GPT through Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain.pretrain``
with Bridge's GPT forward step), TP=2, fp32, mock data, a torch_dist save every 2 iterations into
``$BRIDGE_CHECKPOINTS``. Trailing ``KEY=VALUE`` arguments are Hydra overrides of the config, applied as
Bridge's ``scripts/training/run_recipe.py`` applies them (``process_config_with_overrides``): the form
gradnan's report gives its options in. Run by tests/test_megatron_loops.py under ``-m gradnan.run``."""

import os
import sys

import torch
from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
from megatron.bridge.training import gpt_step
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.bridge.training.pretrain import pretrain
from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
from sitecustomize import BRIDGE_STEP  # the plants' clock (tests/megatron_loops/sitecustomize.py)

SEQUENCE = 32


def config() -> ConfigContainer:
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, seq_length=SEQUENCE,
        vocab_size=128, make_vocab_size_divisible_by=1, transformer_layer_spec=local_layer_spec,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, bf16=False, fp16=False,
        params_dtype=torch.float32, attention_backend="local", masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=6, global_batch_size=2, micro_batch_size=1),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.0, bf16=False,
                                  fp16=False, use_distributed_optimizer=False, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.0,
                                  end_weight_decay=0.0, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                          overlap_param_gather=False, use_distributed_optimizer=False),
        dataset=MockGPTDatasetConfig(seq_length=SEQUENCE, random_seed=1234, split="1,0,0",
                                     reset_position_ids=False, reset_attention_mask=False,
                                     eod_mask_loss=False, dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=127),
        checkpoint=CheckpointConfig(save=os.environ["BRIDGE_CHECKPOINTS"], save_interval=2,
                                    ckpt_format="torch_dist", async_save=False),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=None)


def forward_step(state, data_iterator, model, return_schedule_plan=False):
    """Bridge's GPT forward step; the step count it is handed, for the plants."""
    BRIDGE_STEP["completed"] = state.train_state.step
    return gpt_step.forward_step(state, data_iterator, model, return_schedule_plan)


if __name__ == "__main__":
    pretrain(process_config_with_overrides(config(), cli_overrides=sys.argv[1:]), forward_step)
