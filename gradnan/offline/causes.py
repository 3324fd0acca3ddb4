"""Where the non-finite value was born, decided once: typed ``Evidence`` (the facts the analysis read from
every rank's records) and one declared, ordered rule table (``RULES``); the first rule whose predicate
holds decides the cause, the origin ranks and the summary. Nothing else in gradnan decides a cause: the
report's text, ``--json``, the plot and TensorBoard only render the ``Decision``.

Adding a cause: its evidence (a field here, filled by ``evidence.evidence_of``, and where it is new, its
collector on the training side), one ``Rule`` in ``RULES`` with its wording, its ``Cause`` member and next
actions (``formats.incident``), a test in ``tests/test_causes_unit.py`` and a row in docs/how-it-works.md
(``tests/test_docs_rules.py`` fails when the table and ``RULES`` differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..formats.incident import (
    Cause,
    Conclusion,
    OriginBasis,
    OwnFailure,
    grew_text,
    norm_overflow_summary,
    rejected_loss_summary,
)
from ..formats.text import untrusted


@dataclass(frozen=True)
class BadWeight:
    """A weight already non-finite when the failing step began (a ``state`` record's param)."""

    rank: int
    name: str
    copy: str  # "model": the model parameter; "main": the copy the optimizer steps
    index: Tuple[int, ...]
    nan: int
    inf: int

    def text(self) -> str:
        where = f"[{', '.join(map(str, self.index))}]"
        copy = "" if self.copy == "model" else " (the optimizer's main copy)"
        return f"{untrusted(self.name)}{where}{copy}: {self.nan} NaN, {self.inf} Inf"


@dataclass(frozen=True)
class StateFault:
    """An optimizer-state tensor holding a NaN/Inf, or a second moment below zero (a ``state`` record)."""

    rank: int
    name: str
    state: str
    nan: int
    inf: int
    negative: int

    def text(self) -> str:
        counts = [f"{count} {what}" for count, what in ((self.nan, "NaN"), (self.inf, "Inf"),
                                                        (self.negative, "negative")) if count]
        return f"{untrusted(self.state)} of {untrusted(self.name)} ({', '.join(counts)})"


@dataclass(frozen=True)
class Evidence:
    """Every fact a rule may use, read once from the failing step's records (``evidence.evidence_of``).
    Ranks are global ranks; ``labels`` names each one for the wording ("rank 3 (tp1 pp0 dp1) on h cpu")."""

    step: int
    iteration: Optional[int]
    labels: Mapping[int, str]
    dp_size: int = 1
    # the weights and optimizer state as the failing step found them (``state`` records)
    states_read: Tuple[int, ...] = ()
    # the failing step is the launch's first, or a rank's weights were non-finite already at the launch's
    # first step: the bad weights came with the launch (its checkpoint)
    launch_first_step: bool = False
    bad_weights: Tuple[BadWeight, ...] = ()
    state_faults: Tuple[StateFault, ...] = ()
    lone_weights: Tuple[int, ...] = ()  # holders of a bad weight that a data-parallel peer holds finite
    odd_replicas: Tuple[int, ...] = ()  # weights unlike the majority of their data-parallel peers'
    split_replicas: Tuple[int, ...] = ()  # peers whose weights differ with no majority to side with
    # the in-place rerun of the failing step
    rerun: Optional[Conclusion] = None
    rerun_module: Optional[str] = None
    rerun_class: Optional[str] = None
    rerun_origins: Tuple[int, ...] = ()  # where a forward value first went non-finite
    rerun_concluded_by: Tuple[int, ...] = ()  # the replicas that reached the strongest conclusion
    reduction_fault: bool = False  # the origin call's tensor-parallel reduction: finite partials, a bad sum
    own_failure: Optional[OwnFailure] = None
    micro_batch: Optional[int] = None
    grew_in: Optional[Mapping[str, Any]] = None
    # the gradients
    gradient_basis: OriginBasis = OriginBasis.NONE
    gradient_origin: Tuple[int, ...] = ()
    origin_replicas: Tuple[int, ...] = ()  # the data-parallel replicas of ``gradient_origin``
    forward_pattern: bool = False  # (nearly) every gradient of the origin non-finite
    share_nonfinite: Optional[float] = None
    first_in_backward: Optional[str] = None
    first_rank: Optional[int] = None
    near_limit: bool = False
    recorded_norm: bool = False
    largest_grad: Optional[Mapping[str, Any]] = None  # a norm overflow's largest, finite, gradient
    largest_before_collective: bool = False
    # Megatron's loss check (--rerun-mode disabled) rejected these ranks' loss before any gradient existed
    rejected_losses: Tuple[int, ...] = ()
    rejected: Optional[Mapping[str, Any]] = None  # the first one: micro_batch, loss, batch, rerun_skipped
    recurs: bool = False  # the next step failed too, with no update applied in between (fp16 skips)
    iterations_seen: Tuple[int, ...] = ()  # every Megatron-LM iteration the step's records name (one: agreed)

    def label(self, rank: int) -> str:
        return self.labels.get(rank, f"rank {rank}")

    def labelled(self, ranks: Tuple[int, ...], limit: int = 4) -> str:
        shown = "; ".join(self.label(rank) for rank in ranks[:limit])
        return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``applies`` (the predicate), the ``cause`` it decides, the ``origin`` ranks it
    names, what that rests on (``basis``; None: the gradients' own basis) and what it ``says``; ``when`` is
    the predicate in words (docs/how-it-works.md's table)."""

    id: str
    cause: Cause
    when: str
    applies: Callable[[Evidence], bool]
    origin: Callable[[Evidence], Tuple[int, ...]]
    says: Callable[[Evidence], str]
    basis: Optional[OriginBasis] = None


@dataclass(frozen=True)
class Decision:
    """The cause, the rule that decided it, the origin ranks, what they rest on and the summary."""

    rule: str
    cause: Cause
    origin: Tuple[int, ...]
    basis: OriginBasis
    summary: str


def _ranks(items) -> Tuple[int, ...]:
    return tuple(sorted({item.rank for item in items}))


def _model_weights(e: Evidence) -> Tuple[BadWeight, ...]:
    return tuple(weight for weight in e.bad_weights if weight.copy == "model") or e.bad_weights


def _weight_holders(e: Evidence) -> Tuple[int, ...]:
    """The ranks holding the bad weights; of those, the odd replicas where their peers' copies are good."""
    holders = _ranks(_model_weights(e))
    lone = tuple(rank for rank in holders if rank in e.lone_weights or rank in e.odd_replicas)
    return lone or holders


def _first_weight(e: Evidence, ranks: Tuple[int, ...]) -> str:
    weight = next(w for w in _model_weights(e) if w.rank in ranks)
    more = len({w.name for w in e.bad_weights}) - 1
    return weight.text() + (f" (and {more} more parameter(s))" if more > 0 else "")


def _checkpoint_weights(e: Evidence) -> str:
    ranks = _weight_holders(e)
    return (f"the weights were already non-finite when the launch began: {_first_weight(e, ranks)}"
            f" on {e.labelled(ranks)}: they came with the checkpoint this launch resumed from (or its"
            " initialization), not from this step's data or arithmetic")


def _bad_state(e: Evidence) -> str:
    ranks = _ranks(e.state_faults)
    fault = next(f for f in e.state_faults if f.rank in ranks)
    weights = f"; the weight it updates is non-finite now: {_first_weight(e, _weight_holders(e))}" \
        if e.bad_weights else ""
    return (f"the optimizer update of step {e.step - 1} wrote a non-finite weight from finite gradients: the"
            f" optimizer state is bad on {e.labelled(ranks)}: {fault.text()}{weights}. A moment gone bad is"
            " a corrupted optimizer state (a bad write, a faulty device, a bad resume of optimizer state)")


def _one_replica_weights(e: Evidence) -> str:
    ranks = _weight_holders(e)
    return (f"the weights on {e.labelled(ranks)} were non-finite when step {e.step} began while their"
            f" data-parallel peers' copies of them were not: {_first_weight(e, ranks)}; that replica's copy"
            " went bad after the last update (a bad write, a faulty device)")


def _later_weights(e: Evidence) -> str:
    ranks = _weight_holders(e)
    return (f"the weights were non-finite when step {e.step} began, on every replica holding them, and the"
            f" optimizer state is finite: {_first_weight(e, ranks)} on {e.labelled(ranks)}; they were finite"
            f" when this launch began, so written since: by the update of step {e.step - 1} (finite"
            " gradients and moments: the learning rate, the update arithmetic) or a bad write")


def _diverged(e: Evidence) -> Tuple[int, ...]:
    """The replicas whose weights differ from their data-parallel peers': those unlike a majority of their
    peers; without a majority (two replicas), those of the split that produced the non-finite values
    themselves (the forward origin run again, or their own gradients before the collective): a copy that
    failed where an equal step on its peer's did not is the odd one; else every rank of the split."""
    if e.odd_replicas:
        return e.odd_replicas
    producers = set(e.rerun_origins) | (set(e.gradient_origin)
                                         if e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE else set())
    return tuple(rank for rank in e.split_replicas if rank in producers) or e.split_replicas


def _replicas_disagree(e: Evidence) -> str:
    ranks = _diverged(e)
    which = ("hold weights unlike their data-parallel peers'" if e.odd_replicas else
             "hold weights unlike their data-parallel peers', and of the copies that differ only theirs"
             " produced the non-finite values" if ranks != e.split_replicas else
             "and their data-parallel peers hold different weights, with no majority to tell which copy is"
             " right")
    return (f"{e.labelled(ranks)} {which} (a digest of every weight, read when step {e.step} began): the"
            " replicas diverged, finite but different; a bad write, a faulty device, or a"
            " non-deterministic update")


def _tensor_parallel_collective(e: Evidence) -> str:
    return (f"the tensor-parallel reduction in {untrusted(e.rerun_module)}: run again in place, every rank's"
            f" partial sum was finite and the reduced value was not, on {e.labelled(e.rerun_origins)},"
            f" micro-batch {e.micro_batch}: a transfer or reduction fault")


def _loss(e: Evidence) -> str:
    return (f"the loss function made it: run again in place, every module's output was finite and the loss"
            f" of micro-batch {e.micro_batch} computed from it was not, on {e.labelled(e.rerun_origins)}"
            " (a division by a zero token count, a log of zero); the model, its weights and the device are"
            " not at fault")


def _forward_op(e: Evidence) -> str:
    where = f"in {untrusted(e.rerun_module)}" + (f", after {grew_text(e.grew_in)}" if e.grew_in else "")
    return (f"a forward operator made it: the failing step, run again in place with the same micro-batches"
            f" and RNG state, went non-finite again {where} on {e.labelled(e.rerun_origins[:1])}, micro-batch"
            f" {e.micro_batch}, with finite inputs and finite weights: the data or the numerics (an"
            " overflow), not a passing fault")


_FAILED = {OwnFailure.LOSS: "its loss was not",
           OwnFailure.GRADIENTS: "its own gradients were not (before the data-parallel collective)"}


def _device(e: Evidence) -> str:
    failed = _FAILED[e.own_failure or OwnFailure.LOSS]
    return (f"a transient fault: the failing step, run again in place with the same micro-batches and RNG"
            f" state, was finite on every rank of the replica that failed, although {failed}"
            f" in the failing pass: suspect the device of {e.labelled(_device_origin(e))}")


def _device_origin(e: Evidence) -> Tuple[int, ...]:
    return e.gradient_origin or e.rerun_concluded_by


def _norm_overflow(e: Evidence) -> str:
    rank = e.gradient_origin[0] if e.gradient_origin else None
    summary = norm_overflow_summary(e.label(rank) if rank is not None else "a rank", e.largest_grad or {},
                                    e.largest_before_collective)
    return summary + (f" (and on {e.labelled(e.gradient_origin[1:])})" if len(e.gradient_origin) > 1 else "")


def _collective(e: Evidence) -> str:
    return (f"the data-parallel gradient collective: every rank's own gradients were finite before it"
            f" (checked on each), and {e.labelled(e.gradient_origin)} held non-finite gradients after it"
            f" ({untrusted(e.first_in_backward or 'see the table')}): a transfer or reduction fault")


def _backward_op(e: Evidence) -> str:
    rank = e.first_rank if e.first_rank is not None else e.gradient_origin[0]
    forward = (" the step's forward pass and its loss were finite when run again;"
               if e.rerun in (Conclusion.BACKWARD, Conclusion.AFTER_COLLECTIVE) else "")
    if e.first_in_backward is None:  # every gradient: from backward's first, the loss's own gradient
        return (f"a backward operator made it:{forward} every gradient of {e.labelled(e.gradient_origin)} is"
                " non-finite before the data-parallel collective, so from backward's first operator on (the"
                " loss's own gradient, or a loss function whose backward divides by zero)")
    alone = (f" Only one data-parallel replica of {e.dp_size} produced it, on its own data: if it recurs"
             " there on restart the operator and that batch, if not the device."
             if e.dp_size > 1 and len(e.origin_replicas) == 1 else "")
    return (f"a backward operator made it:{forward} the first non-finite gradient in backward order is"
            f" {untrusted(e.first_in_backward)} on {e.label(rank)}, before the data-parallel"
            f" collective.{alone}")


def _forward_unconfirmed(e: Evidence) -> str:
    return (f"{e.share_nonfinite:.0%} of the gradients of {e.labelled(e.gradient_origin)} are non-finite:"
            " the forward pass or the loss already was, but the step was not run again in place to say"
            " which operator (rerun='auto', the default, with megatron-core's schedules decides it)")


def _rejected_loss(e: Evidence) -> str:
    rejected = e.rejected or {}
    return rejected_loss_summary(rejected.get("global_rank"), rejected.get("micro_batch"),
                                 rejected.get("loss"), rejected.get("batch"), rejected.get("rerun_skipped"))


def _unconfirmed(e: Evidence) -> str:
    return (f"{e.labelled(e.gradient_origin)} hold non-finite gradients, and no check saw each rank's own"
            " gradients before the data-parallel collective (pre_reduction was off, or no Megatron DDP), so"
            " who produced them is not known: run with pre_reduction='deferred' (the default)")


def _not_reproduced(e: Evidence) -> str:
    return ("run again in place, the step was finite, and neither its loss nor its own gradients were seen"
            " non-finite to tell a transient fault from a clean replica: a self-test of the replica's devices"
            " or a capture on a rerun from the checkpoint decides it")


def _no_gradient(e: Evidence) -> str:
    if not e.recorded_norm:
        return ("no gradient was recorded at this step: Megatron's result validation ran it again and the job"
                " stopped before the grad norm, and no replica's own loss or gradients were seen non-finite")
    return ("no rank held a non-finite gradient and no largest gradient was recorded (only the norm was"
            " non-finite): a rank without gradnan's records, or the norm's own reduction")


def _always(e: Evidence) -> bool:
    return True


RULES: Tuple[Rule, ...] = (
    Rule("weights_at_launch", Cause.WEIGHTS,
         "a weight is non-finite, and it was already at the launch's first step",
         lambda e: bool(e.bad_weights) and e.launch_first_step, _weight_holders, _checkpoint_weights,
         OriginBasis.STATE),
    Rule("optimizer_state", Cause.OPTIMIZER_UPDATE,
         "a weight is non-finite at a later step and a rank's optimizer state holds a NaN/Inf or a negative"
         " second moment",
         lambda e: bool(e.bad_weights) and bool(e.state_faults), lambda e: _ranks(e.state_faults), _bad_state,
         OriginBasis.STATE),
    Rule("one_replica_weights", Cause.WEIGHTS,
         "a weight is non-finite at a later step on some data-parallel replicas, their peers' copies finite",
         lambda e: any(rank in e.lone_weights + e.odd_replicas for rank in _ranks(_model_weights(e))),
         _weight_holders,
         _one_replica_weights, OriginBasis.STATE),
    Rule("later_weights", Cause.WEIGHTS,
         "a weight is non-finite at a later step on every replica holding it, the optimizer state finite",
         lambda e: bool(e.bad_weights), _weight_holders, _later_weights, OriginBasis.STATE),
    Rule("replicas_disagree", Cause.WEIGHTS,
         "every weight finite, but data-parallel replicas' weights differ (digest)",
         lambda e: bool(e.odd_replicas or e.split_replicas), _diverged, _replicas_disagree,
         OriginBasis.REPLICAS),
    Rule("tensor_parallel_collective", Cause.COLLECTIVE,
         "run again, a layer's tensor-parallel reduction of finite partial sums is non-finite",
         lambda e: e.rerun is Conclusion.REPRODUCIBLE and e.reduction_fault, lambda e: e.rerun_origins,
         _tensor_parallel_collective, OriginBasis.RERUN),
    Rule("loss_function", Cause.LOSS,
         "run again, every module's output is finite and the loss computed from it is not",
         lambda e: e.rerun is Conclusion.LOSS, lambda e: e.rerun_origins, _loss, OriginBasis.RERUN),
    Rule("forward_operator", Cause.FORWARD_OP,
         "run again, a module's output is non-finite from finite inputs and finite weights",
         lambda e: e.rerun is Conclusion.REPRODUCIBLE and bool(e.rerun_module), lambda e: e.rerun_origins,
         _forward_op, OriginBasis.RERUN),
    Rule("transient", Cause.DEVICE,
         "run again, the step is finite although the replica's own loss or gradients were not",
         lambda e: e.rerun is Conclusion.TRANSIENT, _device_origin, _device),
    Rule("norm_overflow", Cause.NORM_OVERFLOW,
         "every gradient finite, the grad norm's float32 sum of squares overflowed",
         lambda e: e.gradient_basis is OriginBasis.NORM_OVERFLOW or e.rerun is Conclusion.NORM_OVERFLOW,
         lambda e: e.gradient_origin, _norm_overflow),
    Rule("gradient_collective", Cause.COLLECTIVE,
         "every rank's own gradients finite before the data-parallel collective (checked), some non-finite"
         " after it",
         lambda e: e.gradient_basis is OriginBasis.AFTER_COLLECTIVE, lambda e: e.gradient_origin,
         _collective),
    Rule("backward_operator", Cause.BACKWARD_OP,
         "a rank's own gradients non-finite before the collective: only some of them, or all with the forward"
         " pass and the loss finite when run again",
         lambda e: e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE and bool(e.gradient_origin)
         and (e.rerun in (Conclusion.BACKWARD, Conclusion.AFTER_COLLECTIVE)
              or (not e.forward_pattern and bool(e.first_in_backward))),
         lambda e: e.gradient_origin, _backward_op),
    Rule("forward_not_rerun", Cause.UNDETERMINED,
         "(nearly) every gradient of the origin non-finite, the step not run again",
         lambda e: e.forward_pattern and bool(e.gradient_origin) and e.rerun is None,
         lambda e: e.gradient_origin, _forward_unconfirmed),
    Rule("rejected_loss", Cause.UNDETERMINED,
         "Megatron's loss check rejected a loss and raised, the step not run again",
         lambda e: bool(e.rejected_losses), lambda e: e.rejected_losses, _rejected_loss,
         OriginBasis.LOSS_CHECK),
    Rule("unconfirmed_holders", Cause.UNDETERMINED,
         "ranks hold non-finite gradients, no pre-reduction check ran",
         lambda e: e.gradient_basis is OriginBasis.UNCONFIRMED, lambda e: e.gradient_origin, _unconfirmed),
    Rule("not_reproduced", Cause.UNDETERMINED,
         "run again, the step is finite, and no own loss or gradient of the replica was seen non-finite",
         lambda e: e.rerun is Conclusion.NOT_REPRODUCED, lambda e: e.rerun_concluded_by, _not_reproduced),
    Rule("no_gradient", Cause.UNDETERMINED, "none of the above", _always, lambda e: e.gradient_origin,
         _no_gradient),
)


def decide(evidence: Evidence, rules: Tuple[Rule, ...] = RULES) -> Decision:
    """The first rule that applies decides."""
    rule = next(rule for rule in rules if rule.applies(evidence))
    origin = tuple(rule.origin(evidence))
    basis = rule.basis or (evidence.gradient_basis if origin and set(origin) <= set(evidence.gradient_origin)
                           else OriginBasis.OWN_FAILURE if origin else OriginBasis.NONE)
    return Decision(rule.id, rule.cause, origin, basis, rule.says(evidence))


def rules_table() -> Dict[str, Tuple[str, str]]:
    """Rule id -> (cause, predicate in words), in order: what docs/how-it-works.md's table lists."""
    return {rule.id: (rule.cause.value, rule.when) for rule in RULES}
