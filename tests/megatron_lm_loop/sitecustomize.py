"""Megatron-LM's training loop (``megatron.training``, megatron-core 0.17+'s wheel) on CPU, in the torchrun
workers of tests/test_megatron_lm_loop.py only (LOCAL_RANK set): what the loop asks of CUDA is faked,
then the project's CPU shim sends every CUDA device to the CPU. A test-only stand-in, never the product.

PLANT_ITER=N PLANT_RANK=R: on global rank R, where Megatron-LM's ``args.curr_iteration`` is N (the
iteration its log prints as N + 1), one element of layer 1's ``mlp.linear_fc1`` output becomes NaN (a
forward hook registered as the model is built): a forward operator that a batch drives to NaN.
PLANT_WEIGHT_ITER=N PLANT_RANK=R: on global rank R, as iteration N's forward begins, element [0, 7] of layer
0's ``mlp.linear_fc1.weight`` becomes NaN (a weight gone bad: a flipped bit, a bad update)."""

import os
import sys

if "LOCAL_RANK" in os.environ:
    import types

    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        major=9, minor=0, name="cpu", total_memory=128 << 30, multi_processor_count=16)
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"
    torch.cuda.empty_cache = lambda: None
    # torch.accelerator follows torch.cuda.is_available(): the loop's DataLoader(pin_memory=True) would
    # then ask for the device index ("Found no NVIDIA driver on your system")
    torch.accelerator.is_available = lambda: False
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *args, **kwargs: 0)

    from gradnan.testing.cpu_shim import SHIM

    SHIM.activate()

    # the wheel ships the compiled dataset helpers but not their Makefile: the start-up `make` fails
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None

    def _now() -> object:
        from megatron.training import get_args

        return getattr(get_args(), "curr_iteration", None)

    if os.environ.get("PLANT_WEIGHT_ITER"):
        from megatron.core.models.gpt import gpt_model

        weight_iteration, weight_rank = int(os.environ["PLANT_WEIGHT_ITER"]), int(os.environ["PLANT_RANK"])
        build_model = gpt_model.GPTModel.__init__

        def poison(module, inputs):
            weight = module.decoder.layers[0].mlp.linear_fc1.weight
            if _now() == weight_iteration and not torch.isnan(weight[0, 7]):
                with torch.no_grad():
                    weight[0, 7] = float("nan")
                print(f"planted a NaN weight at {weight_iteration}", file=sys.stderr, flush=True)

        def built_to_poison(self, *args, **kwargs):
            build_model(self, *args, **kwargs)
            if torch.distributed.get_rank() == weight_rank:
                self.register_forward_pre_hook(poison)

        gpt_model.GPTModel.__init__ = built_to_poison

    if os.environ.get("PLANT_ITER"):
        from megatron.core.models.gpt import gpt_model

        planted_iteration, planted_rank = int(os.environ["PLANT_ITER"]), int(os.environ["PLANT_RANK"])
        build = gpt_model.GPTModel.__init__

        def plant(module, inputs, output):
            if _now() != planted_iteration:
                return None
            value, bias = output
            value = value.clone()
            value.view(-1)[0] = float("nan")
            print(f"planted NaN at curr_iteration {planted_iteration}", file=sys.stderr, flush=True)
            return value, bias

        def built(self, *args, **kwargs):
            build(self, *args, **kwargs)
            if torch.distributed.get_rank() == planted_rank:
                self.decoder.layers[1].mlp.linear_fc1.register_forward_hook(plant)

        gpt_model.GPTModel.__init__ = built
