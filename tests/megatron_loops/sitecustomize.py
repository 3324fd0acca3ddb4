"""Megatron-LM's and Megatron-Bridge's own training loops on CPU, in the torchrun workers of
tests/test_megatron_loops.py only (LOCAL_RANK set): what the loops ask of CUDA is faked, then the
project's CPU shim sends every CUDA device to the CPU; under MEGATRON_LOOP=bridge, Bridge's CUDA-only
imports get stand-ins (bridge_standins.py). Test-only, never the product.

Plants, each at the iteration the loop's log prints (``now()``), on global rank PLANT_RANK:
- PLANT_ITER=N: one element of layer 1's ``mlp.linear_fc1`` output becomes NaN (a forward hook): a forward
  operator that a batch drives to NaN;
- PLANT_WEIGHT_ITER=N: as the model's forward begins, element [0, 7] of layer 0's ``mlp.linear_fc1.weight``
  becomes NaN (a weight gone bad: a flipped bit, a bad update).
"""

import os
import sys

BRIDGE_STEP = {"completed": None}  # Bridge's train_state.step, set by train_gpt_bridge.py's forward step


def now():
    """The iteration the loop's log prints for the step in progress."""
    if os.environ.get("MEGATRON_LOOP") == "bridge":
        completed = BRIDGE_STEP["completed"]
    else:
        from megatron.training import get_args

        completed = getattr(get_args(), "curr_iteration", None)
    return None if completed is None else completed + 1


def _plant_forward_nan(model, iteration):
    def plant(module, inputs, output):
        if now() != iteration:
            return None
        value, bias = output
        value = value.clone()
        value.view(-1)[0] = float("nan")
        print(f"planted NaN at iteration {iteration}", file=sys.stderr, flush=True)
        return value, bias

    model.decoder.layers[1].mlp.linear_fc1.register_forward_hook(plant)


def _plant_nan_weight(model, iteration):
    import torch

    def poison(module, inputs):
        weight = module.decoder.layers[0].mlp.linear_fc1.weight
        if now() == iteration and not torch.isnan(weight[0, 7]):
            with torch.no_grad():
                weight[0, 7] = float("nan")
            print(f"planted a NaN weight at iteration {iteration}", file=sys.stderr, flush=True)

    model.register_forward_pre_hook(poison)


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

    if os.environ.get("MEGATRON_LOOP") == "bridge":
        # Bridge's start-up warms up torch.compile'd kernels (initialize.py, _warmup_jit_function): with
        # CUDA faked, inductor asks triton for the NVIDIA driver ("libcuda.so cannot found")
        import torch._dynamo

        torch._dynamo.config.disable = True
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bridge_standins

        bridge_standins.install()

    plants = [(variable, plant) for variable, plant in (("PLANT_ITER", _plant_forward_nan),
                                                        ("PLANT_WEIGHT_ITER", _plant_nan_weight))
              if os.environ.get(variable)]
    if plants:
        from megatron.core.models.gpt import gpt_model

        build = gpt_model.GPTModel.__init__

        def built(self, *args, **kwargs):
            build(self, *args, **kwargs)
            if torch.distributed.get_rank() == int(os.environ["PLANT_RANK"]):
                for variable, plant in plants:
                    plant(self, int(os.environ[variable]))

        gpt_model.GPTModel.__init__ = built
