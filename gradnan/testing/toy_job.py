"""What a toy job is and what it returns: the TinyGPTJob spec, the Injections it plants, and each
rank's WorkerResult.

Kept apart from the job's machinery (toy, toy_model, toy_data, toy_faults) so that a test,
a plant (plants) or the demo can describe a job and read its outcome without reading how it is run; the
other toy modules all build on these plain dataclasses, which import nothing of Megatron.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Injection:
    """Put ``value`` on global ``rank`` at ``step`` into what ``target`` names (a global name).

    ``where`` says how:
    - ``"main_grad"``: into parameter ``target``'s reduced gradient right before ``optimizer.step()``
      (a corruption after the data-parallel collective);
    - ``"backward"``: into parameter ``target``'s gradient as backward produces it, before any
      collective (what a bad card or a bad kernel does to one weight gradient);
    - ``"module_backward"``: into the output gradient of module ``target`` during backward, so every
      gradient computed from it (that module's and all earlier layers') is poisoned;
    - ``"forward"``: into the output of module ``target`` in the forward pass (an activation overflow);
    - ``"scale_to"``: rescale parameter ``target`` so its largest magnitude is ``value`` (a number), once,
      before the step's forward: drives a later operator to overflow for as long as the weight stays;
    - ``"fails_without_grad"``: module ``target`` raises in any forward pass made without gradients (as
      the rerun of a failing step is): shows that a rerun that fails leaves training as it was;
    - ``"memory_buffer"``: fill Megatron's global memory buffer (the ``torch.empty`` scratch its attention
      hands ``baddbmm`` with ``beta=0``, never written) with ``value`` before the step's forward, as
      uninitialized memory may hold it (``target`` is not used).
    - ``"weight"``: set element ``index`` of parameter ``target`` before the step's forward, in the model
      parameter and in every copy the optimizer steps (its fp32 main copy, or this rank's
      distributed-optimizer shard where it holds the element), as a corrupted checkpoint or a bad write
      leaves a weight;
    - ``"bit_flip"``: flip bit ``value`` (a number, or "exponent": the lowest exponent bit, which doubles or
      halves the value) of element ``index`` of parameter ``target`` before the step's forward, in the copy
      data-parallel replicas share that outlives the step (a mixed-precision optimizer's fp32 main copy
      without a distributed optimizer, else the model parameter): a silent, finite corruption of one
      replica's weights;
    - ``"row"``: as ``"weight"``, every element of row ``index`` of the 2-D parameter ``target`` (a token's
      row of the word embedding or the output layer; row ``index`` of this rank's vocabulary shard);
    - ``"optimizer_state"``: set element ``index`` (default 0) of the optimizer's ``state`` tensor
      (``exp_avg_sq``, ``exp_avg``) of parameter ``target`` right before ``optimizer.step()``, where this
      rank's optimizer holds that element: the update then writes a bad weight from finite gradients (a
      step after the first: Adam builds its state at its first step);
    - ``"tp_reduction"``: the result of module ``target``'s tensor-parallel reduction (a row-parallel
      linear's all-reduce of its partial sums) on this rank: what a faulty transfer or reduction delivers
      from finite partial sums;
    - ``"p2p_forward"``, ``"p2p_backward"``: element ``index`` of every activation this rank receives from
      the previous pipeline stage (forward), or of every gradient it receives from the next one (backward),
      after the point-to-point transfer: what a faulty link delivers from the sender's finite tensor
      (``target`` is not used);
    - ``"learning_rate"``: every param group's learning rate set to ``value`` right before
      ``optimizer.step()`` (and left so), as a broken schedule does (``target`` is not used);
    - ``"loss_scale"``: fp16's dynamic loss scale set to ``value`` on every sub-optimizer before the step's
      forward, and left so (+Inf stays +Inf at each halving): a broken scaler (``target`` is not used);
    - ``"loss"``: the loss function of micro-batch ``index`` (default 0) divides a zero sum by a zero
      count, as a micro-batch without a valid token does: NaN from a finite model output (``target``
      is not used; the rank is any of the replica's last pipeline stage);
    - ``"loss_after_report"``: as ``"loss"``, but the loss function reports (for logging) the finite zero
      sum before it divides: the loss backward uses is NaN, the one reported finite.
    ``index`` is a flat element index; None picks the first element this rank's optimizer steps.
    ``transient``: a ``"forward"`` or ``"backward"`` fault that fires in the step's first pass only, as a
    glitch would: a rerun of the same step (``gradnan``'s, or Megatron's own) does not meet it again.
    """

    rank: int
    step: int
    target: str
    value: str = "nan"
    where: str = "main_grad"
    index: Optional[int] = None
    transient: bool = False
    state: str = "exp_avg_sq"

    def number(self) -> float:
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(self.value) or float(self.value)


@dataclass(frozen=True)
class TinyGPTJob:
    world_size: int = 2
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved schedule when > 1)
    dtype: str = "fp32"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    check_for_nan_in_grad: bool = False
    steps: int = 3
    micro_batches: int = 1
    num_layers: int = 2
    hidden_size: int = 32
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    recompute: bool = False
    position_embedding: str = "learned_absolute"
    vocab_size: int = 64
    tied_embeddings: bool = False  # the output layer reads the word embedding's (no output_layer.weight)
    seq_length: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    injections: Tuple[Injection, ...] = ()
    # install() options; strict=True unless given: an internal error fails the job
    gradnan: Optional[Dict[str, Any]] = None
    quiet: bool = False
    count_host_syncs: bool = False
    experts: int = 0  # MoE: experts per MLP (0: dense), spread over ``ep`` expert-parallel ranks
    ep: int = 1
    # Megatron's grad norm as a one-element tensor, as core 0.18+ with TE returns it
    norm_as_tensor: bool = False
    # core 0.19+: bf16 gradient buffers, every parameter's main_grad accumulated locally in fp32 and copied
    # into the buffer inside start_grad_sync (``param_name_patterns_for_fp32_local_accumulation=("all",)``)
    fp32_local_accumulation: bool = False
    initial_loss_scale: float = 2.0**12  # fp16: Megatron-LM's default is 2**32
    # hidden and attention dropout: steps draw from the RNG (torch's and Megatron's tracker)
    dropout: float = 0.0
    # Megatron's RerunStateMachine in this mode ("disabled", "validate_results", "report_determinism_stats"),
    # as Megatron-LM's train_step drives it, its loss_func validating every loss (torch.isnan, fatal);
    # None: no state machine, no loss check. "disabled" raises at a NaN loss; "validate_results" runs the
    # step again in place, then the job checkpoints and exits (here: stops training) before the update
    rerun_mode: Optional[str] = None
    # "cpu": gloo and the CPU shim; "cuda": NCCL and one real GPU per rank (the GPU machine's tests)
    device: str = "cpu"
    # "module:function", called as function(job, rank) in each job process before the model is built: what
    # a test puts in place there that a CI machine lacks (a stand-in for pynvml, Megatron-LM's TensorBoard
    # writer where Megatron-LM's loop would hold it)
    prepare: Optional[str] = None
    # "module:function", called as function(job, rank) in each job process after its last step: what
    # Megatron-LM's loop does at its end (it finishes its W&B run, whose records reach disk only then)
    finish: Optional[str] = None
    # "random": random token batches; "mock_gpt": megatron-core's MockGPTDataset, read as Megatron-LM's
    # training loop reads it (``MegatronLMData``), with its arguments where Megatron-LM keeps them
    data: str = "random"
    # global sample indices of the mock data whose token at ``poison_position`` is the poisoned token: one the
    # data never holds otherwise, whose embedding row is finite but so large (``POISON_ROW``) that the first
    # layer norm's variance overflows to NaN: data that fails wherever it is read, every weight finite
    poisoned_samples: Tuple[int, ...] = ()
    poison_position: int = 3
    # a directory to save the model and the optimizer into after every step with megatron-core's
    # dist_checkpointing.save, as Megatron-LM names its checkpoints (``iter_NNNNNNN``, the steps completed),
    # and at a validate_results exit as Megatron-LM's exit save (labelled with the steps completed before the
    # failing one)
    checkpoint_dir: Optional[str] = None

    def with_(self, **changes: Any) -> "TinyGPTJob":
        return dataclasses.replace(self, **changes)


@dataclass
class StepResult:
    step: int
    loss: Optional[float]
    grad_norm: Optional[float]
    update_successful: bool
    # count_host_syncs: on CPU the tensor calls that would make the host wait; on CUDA the synchronizations
    # the CUDA runtime itself reports (torch.cuda.set_sync_debug_mode)
    host_syncs: Optional[int] = None


@dataclass
class WorkerResult:
    rank: int
    steps: List[StepResult] = field(default_factory=list)
    injected: List[Dict[str, Any]] = field(default_factory=list)
    bucket_groups: int = 0
    exit_code: Optional[int] = None  # Megatron's result validation asked the job to exit (validate_results)
    param_digest: Optional[str] = None  # SHA-256 of every parameter's bytes after the last step


class JobFailed(RuntimeError):
    """A job's process raised; ``errors`` holds each failing rank's own error (``job<n>_rank<r>``)."""

    def __init__(self, errors: Dict[str, str]) -> None:
        super().__init__("; ".join(f"{where}: {error}" for where, error in errors.items())
                         or "a process failed")
        self.errors = errors
