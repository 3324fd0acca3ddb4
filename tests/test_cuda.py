"""The CUDA path on a real GPU: real megatron-core on NCCL, one GPU, no CPU shim.

Skipped where no CUDA device is present (CI is CPU-only); run on a GPU machine with
``python -m pytest tests/test_cuda.py`` (docs/performance.md, "On a GPU", gives the machine and results).
- the scan and ``locate`` on CUDA tensors of every float dtype against the definition, past 2^31 elements;
- no host synchronization added on a healthy step: the synchronizations the CUDA runtime reports
  (``torch.cuda.set_sync_debug_mode``) per step, with and without the kit, are the same;
- losses, grad norms, step outcomes and final weights bitwise identical with and without the kit;
- planted faults (a NaN gradient, a bf16 and an fp16 forward overflow): the same rank, parameter, element,
  forward origin and conclusion on the GPU as the same job on the CPU; the bundle captured on CUDA replays
  on CUDA and on the CPU with the same verdict, and compared operator by operator (``--against``) with the
  digests taken in training;
- ``gradnan selftest`` on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from gradnan.offline.incident.read import read_run
from gradnan.offline.incident.report import build_report
from gradnan.testing.gloo import free_port
from gradnan.testing.toy import launch_many
from gradnan.testing.toy_job import Injection, TinyGPTJob
from gradnan.training.scan import find_nonfinite, locate, unravel

from .helpers import (
    environ_without_gradnan,
    map_names,
    records_by_rank,
    step_trace,
    weight_digests,
)
from .test_scan import (
    FLOAT_DTYPES,
    found_by_definition,
    gradient_lists,
    locate_by_definition,
    tensors_with_edge_values,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a GPU machine)")]

GPU = TinyGPTJob(world_size=1, device="cuda", steps=4, quiet=True)
STEP = 2
WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
OVERFLOW_WEIGHT = "decoder.layers.1.mlp.linear_fc1.weight"
SCENARIOS = {
    "nan_gradient_bf16": GPU.with_(dtype="bf16", distributed_optimizer=True, injections=(
        Injection(0, STEP, WEIGHT, "nan", where="backward", index=5),)),
    "forward_inf_bf16": GPU.with_(dtype="bf16", injections=(
        Injection(0, STEP, "decoder.layers.1.mlp", "inf", where="forward"),)),
    "overflow_fp16": GPU.with_(dtype="fp16", distributed_optimizer=True, injections=(
        Injection(0, STEP, OVERFLOW_WEIGHT, "60000", where="scale_to"),)),
}
OPTIONS = {"overflow_fp16": {"skip_warn_after": 1}}


@settings(max_examples=200, deadline=None)
@given(tensor=tensors_with_edge_values())
def test_locate_on_cuda_matches_the_definition(tensor):
    assert locate(tensor.cuda()) == locate_by_definition(tensor)


@settings(max_examples=200, deadline=None)
@given(tensors=gradient_lists())
def test_find_nonfinite_on_cuda_matches_the_definition(tensors):
    on_gpu = [None if tensor is None else tensor.cuda() for tensor in tensors]
    assert find_nonfinite(on_gpu) == found_by_definition(tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_locate_above_two_to_the_31_elements(dtype):
    """Flat indices past 2^31 stay exact: the first bad element, the counts and the largest finite value."""
    numel = 2**31 + 4096
    tensor = torch.zeros(numel, dtype=dtype, device="cuda")
    tensor[2**31 + 5] = float("nan")
    tensor[2**31 + 4000] = float("-inf")
    tensor[2**31 + 3] = -3.0
    found = locate(tensor)
    assert (found.nan, found.pos_inf, found.neg_inf) == (1, 0, 1)
    assert found.first_bad == 2**31 + 5 and found.abs_max_finite == 3.0
    tensor[7] = float("inf")
    assert locate(tensor).first_bad == 7 and locate(tensor).pos_inf == 1
    matrix = tensor.view(2**20 + 2, 2**11)
    assert unravel(locate(matrix[1:]).first_bad, matrix[1:].shape) == [2**20 - 1, 5]
    small = torch.ones(10, dtype=dtype, device="cuda")
    assert [index for index, _ in find_nonfinite([small, tensor, small])] == [1]
    del tensor, matrix
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_float_dtype_on_cuda(dtype):
    tensor = torch.arange(5000, dtype=torch.float32).to(dtype).cuda()
    tensor[4321] = float("nan")
    found = locate(tensor, chunk_elements=64)
    assert found == locate_by_definition(tensor.cpu()) and found.first_bad == 4321


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Healthy bf16 and fp16 jobs (distributed optimizer), with and without the kit, host syncs counted."""
    root = tmp_path_factory.mktemp("cuda_healthy")
    jobs = []
    for dtype in ("bf16", "fp16"):
        job = GPU.with_(dtype=dtype, distributed_optimizer=True, count_host_syncs=True)
        jobs += [job, job.with_(gradnan={"out_dir": str(root / dtype)})]
    outcomes = launch_many(jobs)
    return {dtype: (outcomes[2 * index], outcomes[2 * index + 1])
            for index, dtype in enumerate(("bf16", "fp16"))}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_no_synchronization_added_on_a_healthy_step(healthy, dtype):
    without, with_kit = healthy[dtype]
    counted = [step.host_syncs for step in without[0].steps]
    assert all(isinstance(count, int) for count in counted)
    assert [step.host_syncs for step in with_kit[0].steps] == counted


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_training_is_bitwise_identical_with_and_without_the_kit(healthy, dtype):
    without, with_kit = healthy[dtype]
    assert step_trace(with_kit) == step_trace(without)
    assert weight_digests(with_kit) == weight_digests(without)
    assert all(step.update_successful for step in with_kit[0].steps) or dtype == "fp16"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Each scenario on the GPU and the same job on the CPU (gloo, the shim)."""
    root = tmp_path_factory.mktemp("cuda_planted")
    runs = {}
    for device in ("cuda", "cpu"):
        jobs = [job.with_(device=device, gradnan={"out_dir": str(root / device / name),
                                                  **OPTIONS.get(name, {})})
                for name, job in SCENARIOS.items()]
        outcomes = launch_many(jobs)
        runs[device] = {name: (root / device / name, outcome) for name, outcome in zip(SCENARIOS, outcomes)}
    return runs


def _essentials(run_dir: Path):
    """What a user acts on: the step, the verdict, the origin ranks and their parameters, the forward origin
    and the rerun's conclusion. (Elements are checked where the fault put them: where a NaN spread, which
    element of a receiving parameter went bad first is the device's arithmetic.)"""
    incident = build_report(read_run(run_dir))["incident"]
    rerun = incident.get("rerun") or {}
    return {"step": incident["step"], "cause": incident["verdict"]["cause"],
            "origin": [(entry["global_rank"], [param["name"] for param in entry.get("params", [])])
                       for entry in incident["origin"]],
            "rerun": (rerun.get("module"), rerun.get("conclusion"))}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_planted_fault_gets_the_same_answer_on_the_gpu_as_on_the_cpu(planted, name):
    gpu, cpu = _essentials(planted["cuda"][name][0]), _essentials(planted["cpu"][name][0])
    assert gpu == cpu
    assert gpu["step"] == STEP


def test_a_nan_gradient_names_its_rank_parameter_and_element(planted):
    run_dir, outcome = planted["cuda"]["nan_gradient_bf16"]
    [injected] = outcome[0].injected
    at_step = {record["kind"]: record for record in records_by_rank(run_dir)[0] if record["step"] == STEP}
    for kind in ("pre_reduction", "nonfinite_grad_norm"):  # the rank's own gradients, then the norm's
        [found] = at_step[kind]["params"]
        assert (found["name"], found["first_bad_flat"], found["nan"], found["inf"]) == (
            WEIGHT, injected["index"], 1, 0)
    norm = at_step["nonfinite_grad_norm"]
    assert norm["rank"]["device"] == "cuda:0" and map_names(norm["map"])[norm["params"][0]["id"]] == WEIGHT
    essentials = _essentials(run_dir)
    # one rank and a forward pass that runs clean again: born in backward
    assert essentials["cause"] == "backward_op" and essentials["rerun"] == (None, "backward")


def test_a_bf16_forward_overflow_is_traced_to_its_module(planted):
    essentials = _essentials(planted["cuda"]["forward_inf_bf16"][0])
    assert essentials["rerun"] == ("decoder.layers.1.mlp", "reproducible")
    assert essentials["cause"] == "forward_op"


def _replay(bundle: Path, device: str):
    result = subprocess.run([sys.executable, "-m", "gradnan", "replay", str(bundle), "--json",
                             "--device", device], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_fp16_overflow_bundle_captured_on_cuda_replays_on_cuda_and_on_cpu(planted):
    run_dir = planted["cuda"]["overflow_fp16"][0]
    assert _essentials(run_dir)["rerun"][0].startswith("decoder.layers.1.mlp")
    [bundle, *_] = sorted((run_dir / "bundles").glob("rank00000_*/*"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["module"]["path"].startswith("decoder.layers.1.mlp")
    on_gpu, on_cpu = _replay(bundle, "cuda"), _replay(bundle, "cpu")
    assert on_gpu["verdict"] == on_cpu["verdict"] == "precision"
    first = [replayed["runs"]["captured"]["first_nonfinite"]["op"] for replayed in (on_gpu, on_cpu)]
    assert first[0] == first[1]
    assert on_gpu["replay_matches_saved_outputs"]


def _compared(bundle: Path, device: str):
    command = [sys.executable, "-m", "gradnan", "replay", str(bundle), "--json", "--device", device,
               "--against", sys.executable]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_cuda_bundle_compared_operator_by_operator_on_cuda_and_on_the_cpu(planted):
    """``--against``: each operator's outputs against the digests the capture took in training on the GPU.
    Replayed on the GPU the kernels are the capture's, so nothing differs; on the CPU the first operator that
    differs is named (a CPU kernel's rounding), and both replays reach the same first non-finite operator."""
    [bundle, *_] = sorted((planted["cuda"]["overflow_fp16"][0] / "bundles").glob("rank00000_*/*"))
    on_gpu, on_cpu = _compared(bundle, "cuda"), _compared(bundle, "cpu")
    assert on_gpu["capture_has_digests"] and on_cpu["capture_has_digests"]
    assert on_gpu["first_difference"] is None, on_gpu["first_difference"]
    first = [document["environments"][1]["first_nonfinite"]["op"] for document in (on_gpu, on_cpu)]
    assert first[0] == first[1]


def test_selftest_on_the_gpu(tmp_path):
    environment = {key: value for key, value in environ_without_gradnan().items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
               str(free_port()), "-m", "gradnan", "selftest", "--repeats", "3", "--timeout", "120",
               "--out", str(tmp_path)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = list((tmp_path / "selftest").glob("selftest-*.json"))
    document = json.loads(path.read_text())
    assert document["pass"] is True and document["skipped"] == []
    assert document["ranks"][0]["device"] == "cuda:0" and document["ranks"][0]["device_name"]
    arithmetic = [check for check in document["checks"] if check["kind"] == "arithmetic"]
    assert {check["name"] for check in arithmetic} == {
        f"{op}_{dtype}" for op in ("matmul", "softmax", "layer_norm") for dtype in ("fp32", "bf16", "fp16")}
    # one device, three repeats: the GPU gives the same bits every time
    assert all(len(check["majority_checksums"]) == 1 and check["pass"] for check in arithmetic)
