"""Faults planted by cause, as megatron-core's ``RerunErrorInjector`` plants them by diagnosis: a ``Plant``
names the cause it stands for and where (a job layout, a coordinate, a parameter or module, a step, a
micro-batch); it makes the ``Injection``s that produce that cause on real megatron-core, and says what a
right report answers (``expected``), computed from the plant, never written per case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

from ..formats.incident import Cause
from .toy_job import Injection, TinyGPTJob

Coordinate = Tuple[int, int, int]  # (tp, pp, dp)


def global_rank(job: TinyGPTJob, tp: int, pp: int, dp: int) -> int:
    """Megatron's default rank order (tp fastest, then dp, then pp; no cp here). Expert parallelism splits
    the data-parallel ranks: ``dp % ep`` is the expert-parallel rank, ``dp // ep`` the expert-data-parallel
    one (its expert order tp-ep-dp-pp, with expert tensor parallelism as tensor parallelism)."""
    dp_size = job.world_size // (job.tp * job.pp)
    return tp + job.tp * (dp + dp_size * pp)


def coordinates(job: TinyGPTJob) -> List[Coordinate]:
    dp_size = job.world_size // (job.tp * job.pp)
    return [(tp, pp, dp) for pp in range(job.pp) for dp in range(dp_size) for tp in range(job.tp)]


def expert_of(name: str) -> Optional[int]:
    """The global expert number a parameter or module name holds (``...experts.local_experts.<e>...``, as
    gradnan's maps number them), None outside an expert."""
    _, found, rest = name.partition(".experts.local_experts.")
    return int(rest.split(".")[0]) if found else None


def holds(job: TinyGPTJob, coordinate: Coordinate, name: str) -> bool:
    """Whether the rank at ``coordinate`` holds parameter or module ``name``: an expert only on its
    expert-parallel rank (``experts // ep`` consecutive experts each)."""
    expert = expert_of(name)
    return expert is None or coordinate[2] % job.ep == expert // (job.experts // job.ep)


LINKS = ("link:forward", "link:backward")  # a pipeline link's plant: what arrives at the stage ``stage``
LEARNING_RATE = "learning_rate"  # an optimizer-update plant's target: the schedule's rate, on every rank


def stage_of(job: TinyGPTJob, name: str) -> int:
    """The pipeline stage that holds a parameter or module, by its global name (none: the loss's, the
    last; with model chunks, layer l's virtual stage l // layers-per-chunk runs on stage that mod pp)."""
    if name.startswith("embedding") or name == LEARNING_RATE:  # the rate: every stage's, the first named
        return 0
    if not name or name.startswith(("output_layer", "decoder.final_layernorm")):
        return job.pp - 1
    layer = int(name.split(".")[2])
    return (layer // (job.num_layers // (job.pp * job.vpp))) % job.pp


def sender_stage(job: TinyGPTJob, link: str, receiver: int) -> int:
    """The stage that sends what a link plant's receiver gets: the previous stage's activation, the next
    stage's gradient (a rank's model chunks wrap around: the last stage's chunk feeds the first's next)."""
    return (receiver + (-1 if link == "link:forward" else 1)) % job.pp


@dataclass(frozen=True)
class Expected:
    """What a right report says: the cause; origin coordinates that must all be named (``must``) and that
    may be (``may``: a transient fault names its whole replica, whose ranks all failed with it); and the
    parameter or module named (the parameter for weights, optimizer state, gradients and collectives; the
    module for a forward operator; None where nothing is named)."""

    cause: Cause
    must: FrozenSet[Coordinate]
    may: FrozenSet[Coordinate]
    named: Optional[str]


@dataclass(frozen=True)
class Plant:
    """``cause`` at ``where`` (tp, dp; the pipeline stage follows from ``target``), at ``step``:
    - WEIGHTS: ``target`` (a parameter) non-finite before ``step``, on every data-parallel replica where
      ``step`` is 1 (a checkpoint), else on the one replica ``where`` names; with ``row``, that row of the
      2-D ``target`` set to 1e30 instead (a token's row of the vocabulary's weights, finite, far out of
      range);
    - OPTIMIZER_UPDATE: ``target``'s ``exp_avg_sq`` made negative before the update of ``step``, on the
      rank(s) whose optimizer holds the element (the whole replica ``where`` names without the
      distributed optimizer; its shard owner with it): the failure comes at ``step + 1``; with ``target``
      ``LEARNING_RATE``, every rank's learning rate made Inf for that update (a broken schedule): every
      rank's weights go bad;
    - FORWARD_OP: ``target`` (a module)'s output made Inf on the rank ``where`` names, again when run again;
    - LOSS: micro-batch ``micro_batch``'s loss divides by zero on the replica ``where`` names (with
      ``after_report``, after the loss function reported a finite value: only backward's loss is NaN);
    - BACKWARD_OP: ``target`` (a parameter)'s gradient made NaN in backward;
    - COLLECTIVE: a link ``target`` (``LINKS``) delivering a NaN to pipeline stage ``stage`` from a sender
      whose tensor was finite; a parameter ``target``'s reduced gradient made NaN after the data-parallel
      collective (with the distributed optimizer, in the shard of the replica that owns the element); a module
      ``target``'s tensor-parallel reduction made to deliver an Inf from finite partial sums;
    - DEVICE: ``target`` (a module)'s output made Inf in the step's first pass only (a glitch);
    - NORM_OVERFLOW: ``target``'s gradient made 1e30 (finite; its square overflows float32) in backward;
    - LOSS_SCALE: fp16's dynamic loss scale set to +Inf on every rank before ``step`` (``where`` unused);
    - REPLICA_DIVERGENCE: one exponent bit of ``target``'s element 3 flipped on the rank ``where`` names,
      finite, with the replica check at every step: found at ``step`` or the next (an fp32 main copy's flip
      reaches the model parameter with the update); with two replicas both are named (no majority).
    An expert's parameter or module is planted only where it is held (``holds``): ``where``'s data-parallel
    rank must be one of its expert-parallel rank's."""

    cause: Cause
    job: TinyGPTJob
    target: str
    where: Tuple[int, int] = (0, 0)
    step: int = 2
    micro_batch: int = 0
    row: Optional[int] = None
    after_report: bool = False
    stage: int = 0  # a link plant's receiving stage

    @property
    def coordinate(self) -> Coordinate:
        stage = self.stage if self.target in LINKS else stage_of(self.job, self.target)
        return (self.where[0], stage, self.where[1])

    @property
    def sender(self) -> Coordinate:
        """A link plant's sending rank."""
        tp, pp, dp = self.coordinate
        return (tp, sender_stage(self.job, self.target, pp), dp)

    @property
    def rank(self) -> int:
        return global_rank(self.job, *self.coordinate)

    def _replica(self, dp: int, pp: Optional[int] = None) -> List[Coordinate]:
        return [c for c in coordinates(self.job) if c[2] == dp and (pp is None or c[1] == pp)]

    def injections(self) -> Tuple[Injection, ...]:
        tp, pp, dp = self.coordinate
        cause, target, step = self.cause, self.target, self.step
        if cause is Cause.LOSS_SCALE:  # the scaler's scale is one value on every rank
            return tuple(Injection(global_rank(self.job, *c), step, "", "inf", where="loss_scale")
                         for c in coordinates(self.job))
        if cause is Cause.WEIGHTS:
            holders = [c for c in coordinates(self.job) if c[:2] == (tp, pp) and (step == 1 or c[2] == dp)
                       and holds(self.job, c, target)]
            planted = ("nan", "weight", 3) if self.row is None else ("1e30", "row", self.row)
            return tuple(Injection(global_rank(self.job, *c), step, target, planted[0], where=planted[1],
                                   index=planted[2]) for c in holders)
        if cause is Cause.OPTIMIZER_UPDATE and target == LEARNING_RATE:
            return tuple(Injection(global_rank(self.job, *c), step, "", "inf", where="learning_rate")
                         for c in coordinates(self.job))
        if cause is Cause.OPTIMIZER_UPDATE:
            return tuple(Injection(global_rank(self.job, *c), step, target, "-1", where="optimizer_state",
                                   index=3) for c in coordinates(self.job) if c[:2] == (tp, pp)
                         and (self.job.distributed_optimizer or c[2] == dp) and holds(self.job, c, target))
        if cause is Cause.REPLICA_DIVERGENCE:
            return (Injection(self.rank, step, target, "exponent", where="bit_flip", index=3),)
        if target in LINKS:
            return (Injection(self.rank, step, "", "nan", where=target.replace("link:", "p2p_"), index=3),)
        if cause is Cause.COLLECTIVE and not target.endswith((".weight", ".bias")):
            return (Injection(self.rank, step, target, "inf", where="tp_reduction", index=3),)
        if cause is Cause.COLLECTIVE and self.job.distributed_optimizer:
            return tuple(Injection(global_rank(self.job, *c), step, target, "nan", where="main_grad", index=3)
                         for c in coordinates(self.job) if c[:2] == (tp, pp) and holds(self.job, c, target))
        if cause is Cause.LOSS:
            where = "loss_after_report" if self.after_report else "loss"
            return tuple(Injection(global_rank(self.job, *c), step, "", where=where, index=self.micro_batch)
                         for c in self._replica(dp, self.job.pp - 1))
        plain = {Cause.FORWARD_OP: ("inf", "forward", False), Cause.DEVICE: ("inf", "forward", True),
                 Cause.BACKWARD_OP: ("nan", "backward", False), Cause.COLLECTIVE: ("nan", "main_grad", False),
                 Cause.NORM_OVERFLOW: ("1e30", "backward", False)}
        value, where, transient = plain[cause]
        index = 3 if where == "forward" else None
        return (Injection(self.rank, step, target, value, where=where, index=index, transient=transient),)

    def planted_job(self, out_dir: str) -> TinyGPTJob:
        steps = max(self.job.steps, self.step + 1 + (self.cause is Cause.OPTIMIZER_UPDATE))
        checked = {"replica_check_every": 1} if self.cause is Cause.REPLICA_DIVERGENCE else {}
        return dataclasses.replace(self.job, steps=steps, injections=self.injections(),
                                   gradnan={**(self.job.gradnan or {}), "out_dir": out_dir, **checked})

    def expected(self, applied: FrozenSet[int]) -> Expected:
        """``applied``: the global ranks where an injection took effect (``WorkerResult.injected``)."""
        tp, pp, dp = self.coordinate
        by_rank = {global_rank(self.job, *c): c for c in coordinates(self.job)}
        parameter = self.target.endswith((".weight", ".bias"))
        if self.cause in (Cause.WEIGHTS, Cause.OPTIMIZER_UPDATE) or (
                self.cause is Cause.COLLECTIVE and parameter):
            planted = frozenset(by_rank[rank] for rank in applied)
            return Expected(self.cause, planted, planted, self.target)
        if self.target in LINKS:
            ends = frozenset({self.sender, self.coordinate})
            return Expected(self.cause, ends, ends, None)
        if self.cause is Cause.LOSS_SCALE:
            every = frozenset(coordinates(self.job))
            return Expected(self.cause, every, every, None)
        if self.cause is Cause.LOSS:
            last = frozenset(self._replica(dp, self.job.pp - 1))
            return Expected(self.cause, last, last, None)
        if self.cause is Cause.DEVICE:
            return Expected(self.cause, frozenset({self.coordinate}), frozenset(self._replica(dp)), None)
        if self.cause is Cause.REPLICA_DIVERGENCE and self.job.world_size // (self.job.tp * self.job.pp) == 2:
            peers = frozenset(c for c in coordinates(self.job) if c[:2] == (tp, pp))
            return Expected(self.cause, peers, peers, self.target)
        return Expected(self.cause, frozenset({self.coordinate}), frozenset({self.coordinate}), self.target)

    @property
    def failing_step(self) -> int:
        return self.step + (self.cause is Cause.OPTIMIZER_UPDATE)

    def label(self) -> str:
        experts = f"-ep{self.job.ep}x{self.job.experts}" if self.job.experts else ""
        layout = (f"tp{self.job.tp}pp{self.job.pp}dp{self.job.world_size // (self.job.tp * self.job.pp)}"
                  f"{f'vpp{self.job.vpp}' if self.job.vpp > 1 else ''}"
                  f"-{self.job.dtype}{'-distopt' if self.job.distributed_optimizer else ''}"
                  f"{'-' + self.job.rerun_mode if self.job.rerun_mode else ''}"
                  f"-mb{self.job.micro_batches}{experts}")
        where = (f"tp{self.where[0]}{f'pp{self.stage}' if self.target in LINKS else ''}dp{self.where[1]}"
                 f"-s{self.step}-mb{self.micro_batch}"
                 + ("" if self.row is None else f"-row{self.row}")
                 + ("-after_report" if self.after_report else ""))
        return f"{self.cause.value}@{self.target or 'loss'}@{where}-{layout}"
