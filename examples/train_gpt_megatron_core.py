"""A plain Megatron-Core training loop (no gradnan in it): the script `gradnan.run` launches unchanged.

    torchrun --nproc_per_node 2 -m gradnan.run examples/train_gpt_megatron_core.py --tp 2 --steps 3
    torchrun --nproc_per_node 2 -m gradnan.run examples/train_gpt_megatron_core.py --inject-nan 1:2

On a machine without CUDA it runs on the CPU through gradnan's CPU shim (gloo). ``--inject-nan R:S``
puts a NaN into one gradient on rank R at step S, as a bad device would, so there is something to find.
"""

import argparse
import os

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, VOCAB = 16, 2, 64


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--inject-nan", default=None, metavar="RANK:STEP")
    return parser.parse_args()


def main():
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl")
    else:
        from gradnan.testing.cpu_shim import SHIM  # CPU only: megatron-core is wired to CUDA

        SHIM.activate()
        torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, tensor_model_parallel_size=args.tp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])

    rank = torch.distributed.get_rank()
    bad_rank, bad_step = (int(x) for x in args.inject_nan.split(":")) if args.inject_nan else (-1, -1)
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)

    def forward_step(data_iterator, model):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        output = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
        return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

    for step in range(1, args.steps + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        hook = None
        if (rank, step) == (bad_rank, bad_step):
            weight = model.module.decoder.layers[0].mlp.linear_fc1.weight
            hook = weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None,
                                             model=[model], num_microbatches=1, seq_length=SEQ,
                                             micro_batch_size=BATCH)
        if hook is not None:
            hook.remove()
        _, grad_norm, _ = optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {float(losses[0]['lm loss']):.4f} grad norm {grad_norm}", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
