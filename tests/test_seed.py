"""``seed_all`` reseeds every generator a training step draws from: plain draws repeat, bad arguments are
refused before anything changes, and two real Megatron runs with dropout are bitwise identical."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import numpy
import pytest
import torch

from gradnan.config import ConfigError
from gradnan.testing.gloo import free_port
from gradnan.training.seed import seed_all

pytestmark = pytest.mark.slow  # real gloo jobs or subprocesses: `pytest -m "not slow"` skips them

TP = 2  # world size too: one tensor-parallel group, so the tracker's tensor-parallel stream is used
VOCAB, SEQ, MICRO_BATCH, STEPS = 64, 16, 2, 3


@pytest.fixture
def global_state(monkeypatch):
    """Put back every process-wide setting ``seed_all`` changes, so later tests see none of it."""
    for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"):
        monkeypatch.delenv(name, raising=False)  # records the original value for monkeypatch to restore
    states = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    flags = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    torch.set_rng_state(states[2])
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]


def _draws(seed: int) -> List[Any]:
    seed_all(seed)
    return [random.random(), numpy.random.rand(), torch.rand(3).tolist()]


def test_same_seed_repeats_every_generator_and_another_seed_does_not(global_state):
    first = _draws(7)
    random.random(), numpy.random.rand(), torch.rand(5)  # move every generator on
    again = _draws(7)
    other = _draws(8)
    assert again == first
    for component in range(3):  # each generator on its own, so one left unseeded is caught
        assert other[component] != first[component]
    assert os.environ["PYTHONHASHSEED"] == "8"


def test_reports_what_it_seeded_and_skips_megatron_outside_a_parallel_run(global_state):
    assert seed_all(7) == {
        "seed": 7, "python": True, "numpy": True, "torch": True, "megatron_tracker": False,
        "megatron_skipped": "Megatron model parallel state is not initialized", "deterministic": False,
    }


def test_deterministic_mode_turns_on_deterministic_algorithms(global_state):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    assert seed_all(3)["deterministic"] is False
    assert not torch.are_deterministic_algorithms_enabled()  # False leaves the setting alone
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ

    assert seed_all(3, deterministic=True)["deterministic"] is True
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "NCCL_ALGO" not in os.environ  # the launcher's business


def test_deterministic_mode_keeps_a_cublas_workspace_already_chosen(global_state, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    seed_all(3, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("kwargs, name", [
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": 7.0}, "seed"),
    ({"seed": 7, "deterministic": "yes"}, "deterministic"),
    ({"seed": 7, "deterministic": 1}, "deterministic"),
])
def test_bad_arguments_are_refused_before_anything_changes(global_state, kwargs, name):
    before = random.getstate(), torch.get_rng_state()
    with pytest.raises(ConfigError) as raised:
        seed_all(**kwargs)
    message = str(raised.value)
    assert f"{name} must be" in message and "\n" not in message
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert "PYTHONHASHSEED" not in os.environ


def test_largest_seed_is_accepted(global_state):
    assert seed_all(2**32 - 1)["seed"] == 2**32 - 1


# --- two real Megatron runs -------------------------------------------------------------------------------


def _scramble(junk: int) -> None:
    """Leave every generator, the Megatron tracker included, somewhere different before each run: a
    generator ``seed_all`` forgot would then make the runs differ instead of agreeing by luck."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(junk)
    numpy.random.seed(junk)
    torch.manual_seed(junk)
    model_parallel_cuda_manual_seed(junk)


def _batch() -> Dict[str, torch.Tensor]:
    """Tokens from NumPy shifted by an offset from Python's ``random``, so both generators feed the data."""
    offset = random.randrange(VOCAB)
    tokens = torch.from_numpy((numpy.random.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1)) + offset) % VOCAB)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1),
        "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ),
    }


def _checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _train(seed: int, junk: int) -> Dict[str, Any]:
    """Build a tiny GPT with dropout and train it; ``seed_all`` is the only seeding."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gradnan.patches.model import destroy_model_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        _scramble(junk)
        seeded = seed_all(seed)
        config = TransformerConfig(
            num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            tensor_model_parallel_size=TP, hidden_dropout=0.2, attention_dropout=0.2,
            use_cpu_initialization=False,  # tensor-parallel weights then initialise from the tracker's stream
        )
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="learned_absolute")
        initial = _checksum(model)
        chunk = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(),
                                        module=model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [chunk])
        losses = []
        for _ in range(STEPS):
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss = chunk(**_batch()).float().mean()
            loss.backward()
            finalize_model_grads([chunk])
            assert optimizer.step()[0]
            losses.append(loss.item())
        batch = _batch()
        with torch.no_grad():  # after the checksum's parameters are final: dropout really draws masks
            dropout_live = not torch.equal(chunk(**batch), chunk(**batch))
        return {"seeded": seeded, "initial": initial, "final": _checksum(model), "losses": losses,
                "dropout_live": dropout_live}
    finally:
        destroy_model_parallel()


def _worker(rank: int, port: int, runs: List[List[int]], out_dir: str) -> None:
    from gradnan.testing.gloo import gloo_process

    with gloo_process(rank, TP, port, quiet=False):
        results = [_train(seed, junk) for seed, junk in runs]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))  # floats round-trip exactly


@pytest.fixture(scope="module")
def runs():
    """Seeds 11, 11 and 12, one after another in one pair of processes; per run, each rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gradnan-seed-") as out_dir:
        mp.spawn(_worker, args=(free_port(), [[11, 101], [11, 202], [12, 303]], out_dir), nprocs=TP,
                 join=True)
        per_rank = [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(TP)]
    return [[per_rank[rank][run] for rank in range(TP)] for run in range(3)]


def test_seed_all_makes_two_megatron_runs_bitwise_identical(runs):
    """Caught here if Python, NumPy or the tracker go unseeded. torch's own generator is not: on the CPU shim
    the tracker's ``torch.cuda.manual_seed`` reseeds it too, so the unit test above covers that one."""
    first, second, other = runs
    assert all(result["seeded"]["megatron_tracker"] for result in first)
    assert all(result["dropout_live"] for result in first)
    assert first == second  # parameters at init and after training, and every loss, on every rank
    assert first[0]["initial"] != first[1]["initial"]  # the ranks hold different shards
    for rank in range(TP):
        assert other[rank]["initial"] != first[rank]["initial"]
        assert other[rank]["final"] != first[rank]["final"]
        assert other[rank]["losses"] != first[rank]["losses"]
