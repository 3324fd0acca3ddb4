"""Where the non-finite value was born, decided once: one declared, ordered rule table (``RULES``) over
the typed ``Evidence``. Each rule names the kinds of evidence it needs (``needs``: it cannot fire where
one was not observed), its predicate, the ``Cause`` it decides, the origin ranks it names, its summary,
the parameter whose run-up is read (``culprit``) and the next actions (``actions``). The first rule whose
needs were observed and whose predicate holds decides; where two could both hold, the earlier wins (the
order is the precedence, docs/how-it-works.md). Nothing else decides a cause, an origin, a culprit or a
next action: the report's text, ``--json``, the plot and TensorBoard only render the ``Decision``.

Adding a cause: its evidence (a field of ``evidence.Evidence``, filled by ``offline.evidence``, and where
it is new, its collector on the training side and its ``facts.Fact``), one ``Rule`` here with its wording
(``summaries``), its ``Cause`` member (``formats.incident``) and actions (``actions``), a test in
``tests/test_causes_unit.py`` and a row in docs/how-it-works.md (the test fails when they differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..formats.incident import Cause, Conclusion, OriginBasis
from . import actions as act
from . import summaries as say
from .evidence import Evidence
from .facts import Fact, first_missing, unobserved

Culprit = Callable[[Evidence, Tuple[int, ...]], Optional[str]]  # (evidence, origin ranks) -> parameter


def culprit_of_gradients(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """On the origin: the first non-finite gradient in backward order where it is there, else its largest
    finite gradient (a norm overflow), else its first offending parameter."""
    named = set(origin)
    if e.first_in_backward and e.first_rank in named:
        return e.first_in_backward
    largest = [e.largest_names[rank] for rank in origin if rank in e.largest_names]
    params = [name for rank in e.gradient_origin if rank in named for name in e.origin_params.get(rank, ())]
    return next(iter(largest + params), e.first_in_backward)


def culprit_of_weights(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """The first origin rank's first bad weight in backward order (the last registered first); where it
    holds none, its first offending gradient."""
    held = sorted((weight for weight in e.bad_weights if origin and weight.rank == origin[0]),
                  key=lambda weight: -weight.order)
    if held:
        return held[0].name
    named = set(origin)
    if e.first_in_backward and e.first_rank in named:
        return e.first_in_backward
    params = [name for rank in e.gradient_origin if rank in named for name in e.origin_params.get(rank, ())]
    return next(iter(params), e.first_in_backward)


def culprit_of_divergence(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """The first parameter whose replicas' copies differed."""
    found = e.divergence
    return found.weights[0].name if found is not None and found.weights else None


def culprit_in_forward_module(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """The origin's first offending parameter inside the module that grew a value or went non-finite."""
    named = set(origin)
    params = [name for rank in e.gradient_origin if rank in named for name in e.origin_params.get(rank, ())]
    modules = [module for module in ((e.grew_in or {}).get("module"), e.rerun_module) if module]
    inside = [name for module in modules for name in params if name.startswith(module + ".")]
    return inside[0] if inside else culprit_of_gradients(e, origin)


def no_culprit(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """No parameter: the cause is outside the model (fp16's loss scaler)."""
    return None


def culprit_of_rows(e: Evidence, origin: Tuple[int, ...]) -> Optional[str]:
    """The weight holding the first outlying row."""
    return e.outlying_rows[0].name if e.outlying_rows else None


@dataclass(frozen=True)
class Rule:
    """One row of the table. ``basis``: what the origin rests on (None: the gradients' own basis)."""

    id: str
    cause: Cause
    needs: Tuple[Fact, ...]
    when: str  # the predicate in words (docs/how-it-works.md's table)
    applies: Callable[[Evidence], bool]
    origin: Callable[[Evidence], Tuple[int, ...]]
    says: Callable[[Evidence], str]
    actions: Tuple[act.ActionRule, ...]
    culprit: Culprit = culprit_of_gradients
    basis: Optional[OriginBasis] = None


@dataclass(frozen=True)
class Decision:
    """The cause, the rule that decided it, the origin ranks, what they rest on, the summary, the
    parameter whose run-up is read, the rule's next actions, and the kinds of evidence earlier rules
    needed and the run did not hold (``not_observed``: what an undetermined verdict lacked)."""

    rule: str
    cause: Cause
    origin: Tuple[int, ...]
    basis: OriginBasis
    summary: str
    culprit: Optional[str] = None
    actions: Tuple[act.ActionRule, ...] = ()
    not_observed: Tuple[Fact, ...] = ()

    @property
    def undecided(self) -> bool:
        """No rule could name a cause: the report says what was not observed."""
        return self.cause is Cause.UNDETERMINED


def _gradient_origin(e: Evidence) -> Tuple[int, ...]:
    return e.gradient_origin


def _rerun_origins(e: Evidence) -> Tuple[int, ...]:
    return e.rerun_origins


def _link_ends(e: Evidence) -> Tuple[int, ...]:
    found = e.link_faults[0]
    return tuple(rank for rank in (found.sender, found.receiver) if rank is not None)


_WEIGHTS = (act.resume_before_weights, act.selftest_after_launch)
_COLLECTIVE = (act.check_interconnect, act.selftest)
_STATES = (Fact.STATES,)
_RERUN = (Fact.RERUN,)

RULES: Tuple[Rule, ...] = (
    Rule("records_conflict", Cause.UNDETERMINED, (),
         "two of the step's records contradict each other (a claim of one that another refutes)",
         lambda e: bool(e.conflicts), lambda e: e.conflict_ranks, say.records_conflict,
         (act.decide_by("read one launch of the run directory (gradnan report --run), or rerun from the last"
                        " checkpoint with gradnan's defaults into an empty run directory"),),
         basis=OriginBasis.CONFLICT),
    Rule("loss_scale", Cause.LOSS_SCALE, (),
         "fp16's dynamic loss scale itself non-finite at the failing step (loss_scale_overflow records)",
         lambda e: bool(e.loss_scale_bad), lambda e: e.loss_scale_bad, say.loss_scale, (act.fix_loss_scale,),
         no_culprit, OriginBasis.LOSS_SCALE),
    Rule("weights_at_launch", Cause.WEIGHTS, _STATES,
         "a weight is non-finite, and it was already at the launch's first step",
         lambda e: bool(e.bad_weights) and e.launch_first_step, say.weight_holders, say.checkpoint_weights,
         _WEIGHTS, culprit_of_weights, OriginBasis.STATE),
    Rule("optimizer_state", Cause.OPTIMIZER_UPDATE, _STATES,
         "a weight is non-finite at a later step and a rank's optimizer state holds a NaN/Inf or a negative"
         " second moment",
         lambda e: bool(e.bad_weights) and bool(e.state_faults), lambda e: say.ranks_of(e.state_faults),
         say.bad_state, (act.resume_before_update, act.selftest_after_launch), culprit_of_weights,
         OriginBasis.STATE),
    Rule("learning_rate", Cause.OPTIMIZER_UPDATE, (Fact.STATES, Fact.LEARNING_RATES),
         "a weight is non-finite at a later step, and the update before it used a non-finite learning rate or"
         " one 100 times the steps' before",
         lambda e: bool(e.bad_weights) and not e.launch_first_step and e.rate_fault is not None,
         say.weight_holders, say.learning_rate,
         (act.resume_before_update, act.fix_learning_rate), culprit_of_weights, OriginBasis.STATE),
    Rule("one_replica_weights", Cause.WEIGHTS, _STATES,
         "a weight is non-finite at a later step on some data-parallel replicas, their peers' copies finite",
         lambda e: any(rank in e.lone_weights + e.odd_replicas
                       for rank in say.ranks_of(say.model_weights(e))),
         say.weight_holders, say.one_replica_weights, _WEIGHTS, culprit_of_weights, OriginBasis.STATE),
    Rule("later_weights", Cause.WEIGHTS, _STATES,
         "a weight is non-finite at a later step on every replica holding it, the optimizer state finite",
         lambda e: bool(e.bad_weights), say.weight_holders, say.later_weights, _WEIGHTS, culprit_of_weights,
         OriginBasis.STATE),
    Rule("embedding_row", Cause.WEIGHTS, _STATES,
         "a row of the vocabulary's weights (a token's) is non-finite or 10,000 times the rows' median, when"
         " the step began",
         lambda e: bool(e.outlying_rows), say.row_holders, say.outlying_row,
         (act.restore_rows, act.inspect_batch, act.skip_where_the_data_reads_it), culprit_of_rows,
         OriginBasis.STATE),
    Rule("replica_diverged", Cause.REPLICA_DIVERGENCE, (),
         "at a periodic replica check, a data-parallel replica's weights differed from its peers'"
         " (replica_divergence records), no weight non-finite",
         lambda e: e.divergence is not None, say.divergence_ranks, say.replica_divergence,
         (act.drain, act.selftest_beside_drain, act.resume_before_divergence), culprit_of_divergence,
         OriginBasis.REPLICA_CHECK),
    Rule("replicas_disagree", Cause.WEIGHTS, (Fact.STATES, Fact.REPLICA_DIGESTS),
         "every weight finite, but data-parallel replicas' weights differ (digest)",
         lambda e: bool(e.odd_replicas or e.split_replicas), say.diverged, say.replicas_disagree, _WEIGHTS,
         basis=OriginBasis.REPLICAS),
    Rule("pipeline_link", Cause.COLLECTIVE, (Fact.PIPELINE_LINKS,),
         "a stage received a non-finite activation or gradient over a pipeline link that its sender sent"
         " finite (both checked at the link)",
         lambda e: bool(e.link_faults), _link_ends, say.pipeline_link, _COLLECTIVE, basis=OriginBasis.LINK),
    Rule("link_unobserved", Cause.UNDETERMINED, (Fact.PIPELINE_LINKS,),
         "a stage received a non-finite activation or gradient over a pipeline link, what its sender sent"
         " there not observed",
         lambda e: bool(e.links_unobserved),
         lambda e: tuple(dict.fromkeys(found.receiver for found in e.links_unobserved)),
         say.link_unobserved,
         (act.decide_link,), basis=OriginBasis.LINK_UNOBSERVED),
    Rule("tensor_parallel_collective", Cause.COLLECTIVE, _RERUN,
         "run again, a layer's tensor-parallel reduction of finite partial sums is non-finite",
         lambda e: e.rerun is Conclusion.REPRODUCIBLE and e.reduction_fault, _rerun_origins,
         say.tensor_parallel_collective, _COLLECTIVE, basis=OriginBasis.RERUN),
    Rule("tensor_parallel_loss", Cause.COLLECTIVE, _RERUN,
         "run again, a rank's own loss non-finite and a tensor-parallel peer's (the same loss) finite",
         lambda e: e.rerun in (Conclusion.LOSS, Conclusion.REPRODUCIBLE)
         and bool(e.tensor_parallel_loss_split),
         lambda e: e.tensor_parallel_loss_split, say.tensor_parallel_loss, _COLLECTIVE,
         basis=OriginBasis.RERUN),
    Rule("loss_function", Cause.LOSS, (Fact.RERUN, Fact.STATES),
         "run again, every module's output is finite and the loss computed from it is not",
         lambda e: e.rerun is Conclusion.LOSS, lambda e: e.loss_stage, say.loss,
         (act.fix_loss, act.inspect_batch, act.skip_iteration), basis=OriginBasis.RERUN),
    Rule("forward_operator", Cause.FORWARD_OP, (Fact.RERUN, Fact.STATES),
         "run again, a module's output is non-finite from finite inputs and finite weights",
         lambda e: e.rerun is Conclusion.REPRODUCIBLE and bool(e.rerun_module), _rerun_origins,
         say.forward_op, (act.tune_numerics_if_it_recurs, act.inspect_batch, act.skip_iteration,
                          act.replay_forward_origin, act.bisect),
         culprit_in_forward_module, OriginBasis.RERUN),
    Rule("rerun_origin_absent", Cause.UNDETERMINED, _RERUN,
         "run again, the ranks' rerun records name a forward origin whose own records are absent",
         lambda e: bool(e.rerun_origins_absent) and not e.rerun_origins, lambda e: e.rerun_origins_absent,
         say.origin_records_absent, (act.decide_by(
             "copy the origin rank's gradnan files (records/, maps/, bundles/, batches/) into the run"
             " directory and report again, or rerun from the last checkpoint recording on every rank"
             " (gradnan's ranks unset)"),), basis=OriginBasis.RERUN),
    Rule("transient", Cause.DEVICE, _RERUN,
         "run again, the step is finite although the replica's own loss or gradients were not",
         lambda e: e.rerun is Conclusion.TRANSIENT, say.device_origin, say.device,
         (act.drain, act.selftest_beside_drain)),
    Rule("norm_overflow", Cause.NORM_OVERFLOW, (Fact.GRADIENTS,),
         "every gradient finite, the grad norm's float32 sum of squares overflowed (the gradients' records)",
         lambda e: e.gradient_basis is OriginBasis.NORM_OVERFLOW, _gradient_origin, say.norm_overflow,
         (act.tune_numerics,)),
    Rule("norm_overflow_rerun", Cause.NORM_OVERFLOW, _RERUN,
         "run again, the forward pass finite, every gradient finite and a float32 sum of squares not",
         lambda e: e.rerun is Conclusion.NORM_OVERFLOW, _gradient_origin, say.norm_overflow,
         (act.tune_numerics,)),
    Rule("gradient_collective", Cause.COLLECTIVE, (Fact.GRADIENTS, Fact.OWN_GRADIENTS),
         "every rank's own gradients finite before the data-parallel collective (checked), some non-finite"
         " after it",
         lambda e: e.gradient_basis is OriginBasis.AFTER_COLLECTIVE, _gradient_origin, say.collective,
         _COLLECTIVE),
    Rule("unchecked_ranks", Cause.UNDETERMINED, (Fact.GRADIENTS, Fact.OWN_GRADIENTS),
         "every checked rank's own gradients finite before the data-parallel collective, a rank of a replica"
         " that recorded a non-finite norm not checked (no record of it at the failing step)",
         lambda e: e.gradient_basis is OriginBasis.UNCHECKED, lambda e: e.unchecked, say.unchecked_ranks,
         (act.decide_by("copy those ranks' gradnan files (records/, maps/) into the run directory and report"
                        " again; where a rank died before writing, its own log says why (a device error:"
                        " drain its node)"),), basis=OriginBasis.UNCHECKED),
    Rule("loss_scale_unread", Cause.UNDETERMINED, (),
         "fp16 steps skipped for overflowing gradients with a finite loss, again and again, no record holding"
         " the loss scale",
         lambda e: e.loss_scale_unread, _gradient_origin, say.loss_scale_unread,
         (act.decide_by("read the scale where the loop logs it (Megatron-LM's 'loss scale:' log column): +Inf"
                        " or NaN is the scaler's fault; a finite one, rerun from the last checkpoint with"
                        " gradnan's defaults"),), no_culprit),
    Rule("backward_operator", Cause.BACKWARD_OP, (Fact.OWN_GRADIENTS,),
         "a rank's own gradients non-finite before the collective: only some of them (no loss non-finite),"
         " or all with the forward pass and the loss finite when run again",
         lambda e: e.gradient_basis is OriginBasis.BEFORE_COLLECTIVE and bool(e.gradient_origin)
         and (e.rerun in (Conclusion.BACKWARD, Conclusion.AFTER_COLLECTIVE)
              or (not e.forward_pattern and bool(e.first_in_backward) and not e.losses_nonfinite)),
         lambda e: e.gradient_makers, say.backward_op, (act.replay_or_capture, act.selftest, act.bisect)),
    Rule("forward_not_rerun", Cause.UNDETERMINED, (Fact.GRADIENTS, Fact.PARAMETER_MAPS),
         "(nearly) every gradient of the origin non-finite, or a loss non-finite in the failing pass, the"
         " step not run again",
         lambda e: (e.forward_pattern or bool(e.losses_nonfinite)) and bool(e.gradient_origin)
         and e.rerun is None,
         _gradient_origin, say.forward_unconfirmed, (act.decide_by(
             "rerun from the last checkpoint with rerun='auto' (the default) so the failing step is run"
             " again in place and its forward operator named"),)),
    Rule("rejected_loss", Cause.UNDETERMINED, (),
         "Megatron's loss check rejected a loss and raised, the step not run again",
         lambda e: bool(e.rejected_losses), lambda e: e.rejected_losses, say.rejected_loss,
         (act.decide_rejected_loss,),
         basis=OriginBasis.LOSS_CHECK),
    Rule("unconfirmed_holders", Cause.UNDETERMINED, (Fact.GRADIENTS,),
         "ranks hold non-finite gradients, no pre-reduction check ran",
         lambda e: e.gradient_basis is OriginBasis.UNCONFIRMED, _gradient_origin, say.unconfirmed,
         (act.decide_by("rerun from the last checkpoint with pre_reduction='deferred' (the default) under"
                        " Megatron's DDP; under Megatron-FSDP, whose own reduction gradnan does not check,"
                        " only the failing step run again in place (rerun='auto', the default) can name"
                        " where a forward value went non-finite"),)),
    Rule("not_reproduced", Cause.UNDETERMINED, _RERUN,
         "run again, the step is finite, and no own loss or gradient of the replica was seen non-finite",
         lambda e: e.rerun is Conclusion.NOT_REPRODUCED, lambda e: e.rerun_concluded_by, say.not_reproduced,
         (act.decide_by(say.SELFTEST_OR_RERUN),)),
    Rule("no_gradient", Cause.UNDETERMINED, (), "none of the above", lambda e: True, _gradient_origin,
         say.no_gradient, (act.decide_by(say.SELFTEST_OR_RERUN),)),
)


def decide(evidence: Evidence, rules: Tuple[Rule, ...] = RULES) -> Decision:
    """The first rule whose needs were observed and whose predicate holds decides."""
    missing: Dict[Fact, None] = {}
    for rule in rules:
        lacking = unobserved(rule.needs, evidence.observed)
        if lacking:
            missing.update(dict.fromkeys(lacking))
        elif rule.applies(evidence):
            break
    origin = tuple(rule.origin(evidence))
    basis = rule.basis or (evidence.gradient_basis if origin and set(origin) <= set(evidence.gradient_origin)
                           else OriginBasis.OWN_FAILURE if origin else OriginBasis.NONE)
    return Decision(rule.id, rule.cause, origin, basis, rule.says(evidence), rule.culprit(evidence, origin),
                    rule.actions, first_missing(missing))


def rules_table() -> Dict[str, Tuple[str, str, str]]:
    """Rule id -> (cause, the evidence it needs, predicate in words), in order: docs/how-it-works.md's
    table."""
    return {rule.id: (rule.cause.value, ", ".join(fact.value for fact in rule.needs) or "-", rule.when)
            for rule in RULES}
