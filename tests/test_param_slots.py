"""The optimizer's slots are built once (50,000 parameters take a second) and the gradients read at every
call."""

from __future__ import annotations

import torch

from gradnan.patches.optimizer_params import param_slots
from gradnan.testing.synthetic import TorchOptimizer, many_tensor_model


def test_param_slots_are_built_once_per_optimizer_and_gradients_read_each_time():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = TorchOptimizer(model)
    slots, grads = param_slots(optimizer)
    assert [slot.name for slot in slots] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert grads == [None] * 4
    model(torch.ones(1, 3)).sum().backward()
    again, grads = param_slots(optimizer)
    assert again is slots, "built once"
    assert all(grad is param.grad for grad, param in zip(grads, model.parameters()))
    optimizer.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    rebuilt, grads = param_slots(optimizer)
    assert rebuilt is not slots and len(rebuilt) == len(grads) == 5 and rebuilt[4].name == "<unnamed #4>"
    assert param_slots(TorchOptimizer(model))[0] is not slots, "another optimizer, its own slots"


def test_layer_numbers_make_global_names():
    slots, _ = param_slots(TorchOptimizer(many_tensor_model(40, 2, layers=4)))
    assert [slot.name for slot in slots[:2]] == ["decoder.layers.0.mlp.experts.0.w1",
                                                 "decoder.layers.0.mlp.experts.0.w2"]
    assert slots[-1].name == "decoder.layers.3.mlp.experts.4.w2" and slots[-1].order == 39
