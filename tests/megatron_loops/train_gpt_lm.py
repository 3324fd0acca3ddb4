"""A tiny GPT for Megatron-LM's own training loop (``megatron.training.pretrain`` of megatron-core 0.17+'s
wheel), shaped as Megatron-LM's pretrain_gpt.py (written here, not copied): a model provider, a forward
step and its loss, mock data. Run by tests/test_megatron_loops.py under ``-m gradnan.run``."""

import os
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from sitecustomize import now  # the plants' clock (tests/megatron_loops/sitecustomize.py)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection,
    )


_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator):
    """TP rank 0 reads the batch; the other TP ranks receive it by broadcast."""
    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    if mpu.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: data[k].cuda() for k in _KEYS}
    else:
        batch = {k: torch.empty(shape, dtype=torch.float32 if k == "loss_mask" else torch.int64,
                                device="cuda") for k in _KEYS}
    for k in _KEYS:
        torch.distributed.broadcast(batch[k], mpu.get_tensor_model_parallel_src_rank(),
                                    group=mpu.get_tensor_model_parallel_group())
    return batch


def loss_func(loss_mask, output_tensor):
    """pretrain_gpt.py's: the masked sum and the token count (the schedule divides one by the other), and
    Megatron's check of the loss. PLANT_LOSS_ITER=N: at the iteration the log prints as N every token is
    masked, as a batch of padding alone would be, and the loss divides by the token count itself (0/0): a loss
    function that a batch drives to NaN from a finite model output."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    planted = str(now()) == os.environ.get("PLANT_LOSS_ITER")
    if planted:
        loss_mask = torch.zeros_like(loss_mask)
    loss = torch.sum(losses * loss_mask)
    if planted:
        loss = loss / loss_mask.sum()
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(result=loss, rejection_func=torch.isnan,
                                                  message="found NaN in local forward loss calculation",
                                                  tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    b = get_batch(data_iterator)
    output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return output, partial(loss_func, b["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    print_rank_0("> building mock GPT datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, None), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
