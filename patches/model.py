"""What gradnan reads from Megatron without patching it: rank coordinates, global parameter names, versions.

Kept here so that the rest of gradnan never touches a Megatron name.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..events import ModelFacts
from ..formats import loop
from ..formats.loop import LoopKind
from .bridge import BRIDGE_TRAIN, bridge_iteration, bridge_logger
from .instrumentor import installed_version, megatron_version
from .names import prefix_renamer

# Wrappers whose parameter names gain a ``module.`` prefix (Megatron DDP, Float16Module, FSDP flavours).
_WRAPPER_CLASS_NAMES = frozenset(
    {
        "DistributedDataParallel",
        "Float16Module",
        "FullyShardedDataParallel",
        "TorchFullyShardedDataParallel",
        "MegatronFSDP",
    }
)
_LAYER_PREFIX = re.compile(r"(^|\.)layers\.\d+$")


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    while type(chunk).__name__ in _WRAPPER_CLASS_NAMES:
        inner = getattr(chunk, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        chunk = inner
    return chunk


def _layer_prefix_renames(model: torch.nn.Module) -> Dict[str, str]:
    """Local ``...layers.<i>`` prefix -> global one, from ``TransformerLayer.layer_number`` (1-based, global),
    and local ``...local_experts.<i>`` prefix -> the global expert number (``_expert_prefix_renames``)."""
    renames = {}
    for name, module in model.named_modules():
        layer_number = getattr(module, "layer_number", None)
        if isinstance(layer_number, int) and _LAYER_PREFIX.search(name) and ".mtp." not in f".{name}.":
            head, _, _ = name.rpartition(".")
            renames[name + "."] = f"{head}.{layer_number - 1}."
    return {**renames, **_expert_prefix_renames(model, renames)}


def _expert_prefix_renames(model: torch.nn.Module, layer_renames: Dict[str, str]) -> Dict[str, str]:
    """Megatron numbers an MoE layer's experts locally on every expert-parallel rank (``local_experts.0`` is
    global expert ``ep_rank * num_local_experts`` there): the layer's ``local_expert_indices`` (every
    release since 0.12) give the global numbers, as its checkpoints count them. Grouped-GEMM experts hold
    all local experts in one weight: unchanged."""
    renames = {}
    rename_layer = prefix_renamer(layer_renames)
    for name, module in model.named_modules():
        indices = getattr(module, "local_expert_indices", None)
        experts = getattr(getattr(module, "experts", None), "local_experts", None)
        if not isinstance(experts, torch.nn.ModuleList) or not isinstance(indices, list):
            continue
        head = rename_layer(f"{name}.experts.")
        for local, global_index in enumerate(indices[:len(experts)]):
            renames[f"{name}.experts.local_experts.{local}."] = f"{head}local_experts.{global_index}."
    return renames


def global_named_parameters(chunks: Iterable[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    """Every parameter of the model chunks with its global name: wrapper prefixes stripped, global layer
    numbers under pipeline (and virtual pipeline) parallelism."""
    named = []
    seen = set()
    for chunk in chunks:
        model = unwrap_model(chunk)
        rename = prefix_renamer(_layer_prefix_renames(model))
        for name, param in model.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                named.append((rename(name), param))
    return named


def global_named_modules(chunks: Iterable[torch.nn.Module]) -> List[Tuple[str, torch.nn.Module]]:
    """Every module of the model chunks with its global name (as ``global_named_parameters``)."""
    named = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        rename = prefix_renamer(_layer_prefix_renames(model))
        named += [(rename(name + ".")[:-1], module) for name, module in model.named_modules()]
    return named


def model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """A model parameter's gradient as Megatron's optimizer sees it: ``main_grad`` (DDP buffer), else
    ``grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else param.grad


def tensor_parallel_facts(param: torch.nn.Parameter) -> Dict[str, object]:
    """How a parameter is split across tensor-parallel ranks (Megatron's attributes on it), if it is."""
    if not getattr(param, "tensor_model_parallel", False):
        return {"tensor_parallel": False}
    return {"tensor_parallel": True, "partition_dim": getattr(param, "partition_dim", None),
            "partition_stride": getattr(param, "partition_stride", None)}


def _call_or_none(getter_name: str) -> Optional[int]:
    from megatron.core import parallel_state

    getter = getattr(parallel_state, getter_name, None)
    if getter is None:
        return None
    try:
        value = getter()
    except (AssertionError, RuntimeError, AttributeError, TypeError):
        return None
    return value if isinstance(value, int) else None


def _device_name() -> str:
    if torch.cuda.is_available():
        try:
            return f"cuda:{torch.cuda.current_device()}"
        except RuntimeError:
            return "cuda:?"
    return "cpu"


def rank_coordinates() -> Dict[str, object]:
    """Global rank, world size, tp/pp/dp/cp/ep/vpp ranks and sizes, host and device of this process."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    coords: Dict[str, object] = {
        "global_rank": dist.get_rank() if initialized else int(os.environ.get("RANK", 0)),
        "world_size": dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "host": socket.gethostname(),
        "device": _device_name(),
        "pid": os.getpid(),
    }
    for axis, rank_getter, size_getter in (
        ("tp", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
        ("pp", "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
        ("dp", "get_data_parallel_rank", "get_data_parallel_world_size"),
        ("cp", "get_context_parallel_rank", "get_context_parallel_world_size"),
        ("ep", "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size"),
    ):
        coords[axis] = _call_or_none(rank_getter) if initialized else 0
        coords[f"{axis}_size"] = _call_or_none(size_getter) if initialized else 1
    return coords


def _megatron_lm_global(name: str) -> Any:
    """One of Megatron-LM's globals (``megatron.training.global_vars``) when its training loop runs in this
    process, else None. Only looks at modules already imported: never imports Megatron-LM."""
    return getattr(sys.modules.get("megatron.training.global_vars"), name, None)


def megatron_lm_args() -> Any:
    """Megatron-LM's parsed arguments when its training loop runs in this process, else None."""
    return _megatron_lm_global("_GLOBAL_ARGS")


def integer_or_none(value: Any) -> Optional[int]:
    """``value`` where it is an integer (not a bool), else None: a count read from Megatron-LM's arguments."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def megatron_lm_iteration() -> Optional[int]:
    """The iteration Megatron-LM's training loop logs for the step in progress (``args.curr_iteration``
    counts completed iterations, the log line says one more), when that loop is running in this
    process; else Megatron-Bridge's (``bridge.bridge_iteration``) while its ``train_step`` runs; None
    otherwise."""
    iteration = integer_or_none(getattr(megatron_lm_args(), "curr_iteration", None))
    return bridge_iteration() if iteration is None else iteration + 1


def training_loop() -> Optional[Dict[str, Any]]:
    """The loop running this process, as records name it (``formats.loop``): Megatron-Bridge's where its
    training module is imported (it leaves Megatron-LM's arguments unset), Megatron-LM's where its
    arguments are parsed, with megatron-core's release (Megatron-LM's ``megatron/training`` is released
    with it: core_v0.17.0 changed how ``--iterations-to-skip`` counts); None for a loop of the user's own.
    Only looks at modules already imported."""
    if BRIDGE_TRAIN in sys.modules and megatron_lm_args() is None:
        bridge = _bridge_release()
        return loop.to_json(LoopKind.MEGATRON_BRIDGE, None if bridge is None else str(bridge))
    if megatron_lm_args() is not None:
        core = megatron_version()
        return loop.to_json(LoopKind.MEGATRON_LM, None if core is None else str(core))
    return None


def _bridge_release() -> Optional[Any]:
    version = getattr(sys.modules.get("megatron.bridge.package_info"), "__version__", None)
    return version if isinstance(version, str) else installed_version("megatron-bridge")


def megatron_lm_tensorboard() -> Optional[object]:
    """The training loop's TensorBoard writer: Megatron-LM's (``--tensorboard-dir``; it makes one on the last
    rank), else Megatron-Bridge's (``logger.tensorboard_dir``); None otherwise."""
    return _megatron_lm_global("_GLOBAL_TENSORBOARD_WRITER") or bridge_logger("tensorboard")


def megatron_lm_wandb() -> Optional[object]:
    """The training loop's W&B writer: Megatron-LM's (``--wandb-project``; on the last rank, the ``wandb``
    module once its run is initialised), else Megatron-Bridge's (``logger.wandb_project``, the same
    module); None otherwise."""
    return _megatron_lm_global("_GLOBAL_WANDB_WRITER") or bridge_logger("wandb")


def versions() -> Dict[str, Optional[str]]:
    megatron = megatron_version()
    return {"torch": torch.__version__, "megatron_core": str(megatron) if megatron else None}


def seed_rng_tracker(seed: int) -> Optional[str]:
    """Reseed Megatron's model-parallel RNG tracker (dropout and weight init inside tensor-parallel regions
    draw from it, not from torch's default generator); return why it was skipped, or None."""
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    except ImportError:
        return "megatron-core is not importable"
    if not parallel_state.model_parallel_is_initialized():
        return "Megatron model parallel state is not initialized"
    model_parallel_cuda_manual_seed(seed)
    return None


def destroy_model_parallel() -> None:
    """``parallel_state.destroy_model_parallel()``, plus the globals megatron-core 0.12 forgets to reset
    (a later layout in the same process would otherwise see the last one's position-embedding ranks)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if hasattr(parallel_state, "_POSITION_EMBEDDING_GLOBAL_RANKS"):
        parallel_state._POSITION_EMBEDDING_GLOBAL_RANKS = None


def optimizer_tensors(optimizer: Any, chunks: Sequence[torch.nn.Module]):
    """``optimizer_params.param_tensors`` (imported here: that module imports this one)."""
    from .optimizer_params import param_tensors

    return param_tensors(optimizer, chunks)


def data_parallel_group() -> Optional[Any]:
    """Megatron's data-parallel group (without context parallelism), once its parallel state is set up."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group()


MEGATRON_FACTS = ModelFacts(coords=rank_coordinates, versions=versions, iteration=megatron_lm_iteration,
                            loop=training_loop,
                            named_modules=global_named_modules, observed_grad=model_grad,
                            param_facts=tensor_parallel_facts, tensorboard=megatron_lm_tensorboard,
                            wandb=megatron_lm_wandb, optimizer_tensors=optimizer_tensors,
                            replica_group=data_parallel_group)
