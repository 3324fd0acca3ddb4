"""Issue 36: the rule table, on ``Evidence`` built in memory. Each rule fires on the facts it names and not
on the facts of the rules before it; the first match decides; every cause has a rule and a next action;
docs/how-it-works.md's table is the table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gradnan.decision.actions import Setting, next_steps
from gradnan.decision.causes import RULES, decide, rules_table
from gradnan.decision.evidence import (
    BadWeight,
    DivergedWeight,
    Evidence,
    OutlyingRow,
    RateFault,
    ReplicaDivergence,
    StateFault,
)
from gradnan.decision.facts import Fact, missing_text
from gradnan.decision.links import LinkFinding, link_findings
from gradnan.formats.incident import Action, Cause, Conclusion, OriginBasis, OwnFailure
from gradnan.offline.incident.evidence import replica_digests

LABELS = {rank: f"rank {rank}" for rank in range(8)}
NAN_WEIGHT = BadWeight(1, "decoder.layers.0.mlp.linear_fc1.weight", "model", (0, 7), 1, 0)
BAD_MOMENT = StateFault(2, "decoder.layers.1.mlp.linear_fc2.weight", "exp_avg_sq", 0, 0, 1)
FLIPPED = DivergedWeight(2, "decoder.layers.0.mlp.linear_fc1.weight", (0, 5), 0.0654296875, 0.032470703125)
DIVERGED = ReplicaDivergence((2,), 3, 2, 5, (FLIPPED,), 1)
HUGE_ROW = OutlyingRow(1, "embedding.word_embeddings.weight", 5, 37, 1e30, 0.05, every_step=True)
# rank 1 (stage 1) received a non-finite activation at its transfer 0 from rank 0 (stage 0)
RECEIVED = dict(direction="forward", receiver=1, receiver_stage=1, sender=0, sender_stage=0, transfer=0)
LARGEST = {"name": "output_layer.weight", "index": [0, 1], "value": 1e30, "overflows": True}


def evidence(**facts) -> Evidence:
    """In-memory evidence, every kind observed unless ``observed`` says otherwise."""
    return Evidence(**{"step": 5, "iteration": 105, "labels": LABELS, "dp_size": 2,
                       "observed": frozenset(Fact), **facts})


# one case per rule: the facts that make it fire, and the origin it names
CASES = {
    "records_conflict": (dict(conflicts=("rank 2's grad-norm record says ...",), conflict_ranks=(2,),
                              bad_weights=(NAN_WEIGHT,)), (2,)),
    # issue 59 (5): every rank's fp16 scaler at +Inf; their gradients all non-finite, no parameter at fault
    "loss_scale": (dict(loss_scale_bad=(0, 1), loss_scale="inf", gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                        gradient_origin=(0, 1), forward_pattern=True, share_nonfinite=1.0, recurs=True,
                        first_in_backward="output_layer.weight", first_rank=0), (0, 1)),
    "weights_at_launch": (dict(step=1, launch_first_step=True, bad_weights=(NAN_WEIGHT,),
                               rerun=Conclusion.REPRODUCIBLE, rerun_module="decoder.layers.0.mlp.linear_fc2",
                               rerun_origins=(0,)), (1,)),
    "optimizer_state": (dict(bad_weights=(NAN_WEIGHT,), state_faults=(BAD_MOMENT,)), (2,)),
    "learning_rate": (dict(bad_weights=(NAN_WEIGHT,), rate_fault=RateFault(1, 4, 0, "inf", 1e-4)), (1,)),
    "one_replica_weights": (dict(bad_weights=(NAN_WEIGHT,), lone_weights=(1,)), (1,)),
    "later_weights": (dict(bad_weights=(NAN_WEIGHT,)), (1,)),
    "embedding_row": (dict(outlying_rows=(HUGE_ROW,), odd_replicas=(1,), gradient_origin=(1,),
                           gradient_basis=OriginBasis.NORM_OVERFLOW, largest_grad=LARGEST), (1,)),
    "replica_diverged": (dict(divergence=DIVERGED), (2,)),
    "replicas_disagree": (dict(odd_replicas=(3,), rerun=Conclusion.REPRODUCIBLE, rerun_module="m",
                               rerun_origins=(3,)), (3,)),
    "pipeline_link": (dict(links=(LinkFinding(**RECEIVED, sent="finite"),), rerun=Conclusion.REPRODUCIBLE,
                           rerun_module="decoder.layers.1.input_layernorm", rerun_origins=(1,),
                           gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0, 1),
                           forward_pattern=True, share_nonfinite=1.0), (0, 1)),
    "link_unobserved": (dict(links=(LinkFinding(**{**RECEIVED, "sender": None}, sent=None),),
                             rerun=Conclusion.REPRODUCIBLE, rerun_module="decoder.layers.1.input_layernorm",
                             rerun_origins=(1,)), (1,)),
    "tensor_parallel_collective": (dict(rerun=Conclusion.REPRODUCIBLE, reduction_fault=True, micro_batch=0,
                                        rerun_module="decoder.layers.0.mlp.linear_fc2", rerun_origins=(0, 1)),
                                   (0, 1)),
    # issue 59 (4): rank 1's loss NaN, its tensor-parallel peer's (the same loss) finite
    "tensor_parallel_loss": (dict(rerun=Conclusion.LOSS, loss_stage=(1,), tensor_parallel_loss_split=(1,),
                                  micro_batch=0, gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                                  gradient_origin=(0, 1), forward_pattern=True, share_nonfinite=1.0), (1,)),
    "loss_function": (dict(rerun=Conclusion.LOSS, loss_stage=(0, 1), micro_batch=1,
                           gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0, 1),
                           forward_pattern=True, share_nonfinite=1.0), (0, 1)),
    "forward_operator": (dict(rerun=Conclusion.REPRODUCIBLE, rerun_module="decoder.layers.1.mlp",
                              rerun_origins=(3,), micro_batch=0, gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                              gradient_origin=(2, 3), forward_pattern=True, share_nonfinite=1.0), (3,)),
    # expert parallelism: rank 2 received the overflow from an expert on rank 3, whose files are missing
    "rerun_origin_absent": (dict(rerun=Conclusion.REPRODUCIBLE, rerun_origins_absent=(3,), micro_batch=0,
                                 gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(2,),
                                 first_in_backward="output_layer.weight", first_rank=2), (3,)),
    "transient": (dict(rerun=Conclusion.TRANSIENT, own_failure=OwnFailure.LOSS, rerun_concluded_by=(2, 3),
                       gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(2, 3),
                       forward_pattern=True, share_nonfinite=1.0), (2, 3)),
    "norm_overflow": (dict(gradient_basis=OriginBasis.NORM_OVERFLOW, gradient_origin=(1,),
                           largest_grad=LARGEST, largest_before_collective=True), (1,)),
    "norm_overflow_rerun": (dict(rerun=Conclusion.NORM_OVERFLOW, gradient_origin=(1,), largest_grad=LARGEST),
                            (1,)),
    "gradient_collective": (dict(gradient_basis=OriginBasis.AFTER_COLLECTIVE, gradient_origin=(2,),
                                 first_in_backward="decoder.layers.0.mlp.linear_fc1.weight", first_rank=2,
                                 rerun=Conclusion.AFTER_COLLECTIVE), (2,)),
    # rank 6 wrote no record at the failing step: rank 4 may only have received its value
    "unchecked_ranks": (dict(gradient_basis=OriginBasis.UNCHECKED, gradient_origin=(4,), unchecked=(6,),
                             first_in_backward="decoder.layers.1.mlp.linear_fc2.weight", first_rank=4,
                             rerun=Conclusion.BACKWARD), (6,)),
    "loss_scale_unread": (dict(loss_scale_unread=True, recurs=True,
                               gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                               gradient_origin=(0, 1), first_in_backward="output_layer.weight", first_rank=0,
                               rerun=Conclusion.BACKWARD), (0, 1)),
    "backward_operator": (dict(gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(3,),
                               origin_replicas=(1,), first_rank=3, rerun=Conclusion.BACKWARD,
                               first_in_backward="decoder.layers.0.mlp.linear_fc1.weight"), (3,)),
    "forward_not_rerun": (dict(gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0, 1),
                               forward_pattern=True, share_nonfinite=0.97), (0, 1)),
    "rejected_loss": (dict(rejected_losses=(1,), rejected={"global_rank": 1, "micro_batch": 0,
                                                           "loss": "nan", "batch": None,
                                                           "rerun_skipped": "pipeline"}), (1,)),
    "unconfirmed_holders": (dict(gradient_basis=OriginBasis.UNCONFIRMED, gradient_origin=(0, 1),
                                 first_in_backward="x.weight", first_rank=0), (0, 1)),
    "not_reproduced": (dict(rerun=Conclusion.NOT_REPRODUCED, rerun_concluded_by=(0, 1)), (0, 1)),
    "no_gradient": (dict(recorded_norm=True), ()),
}


def test_every_rule_has_a_case_and_every_cause_a_rule():
    assert list(CASES) == [rule.id for rule in RULES]
    assert {rule.cause for rule in RULES} == set(Cause)
    assert len({rule.id for rule in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", list(CASES))
def test_each_rule_decides_its_own_case(rule):
    facts, origin = CASES[rule]
    decided = decide(evidence(**facts))
    assert decided.rule == rule
    assert decided.cause is next(r.cause for r in RULES if r.id == rule)
    assert decided.origin == origin
    assert decided.summary and "None" not in decided.summary


@pytest.mark.parametrize("rule", list(CASES))
def test_no_earlier_rule_takes_a_later_rules_case(rule):
    """The order matters only where facts overlap: each case is decided by its rule, not by one above."""
    facts, _ = CASES[rule]
    earlier = RULES[:[r.id for r in RULES].index(rule)]
    assert not any(r.applies(evidence(**facts)) for r in earlier)


def _links(stage, **directions):
    """A stage's incident record as ``link_findings`` reads it (pp=2, tp0 dp0; global rank = stage)."""
    seen = {name: {"transfers": 2, "first_nonfinite": first, "unchecked": 0}
            for name, first in directions.items()}
    return {"rank": {"global_rank": stage, "tp": 0, "dp": 0, "pp": stage, "pp_size": 2},
            "pipeline_links": seen}


def test_a_link_is_named_only_where_the_sender_sent_finite_what_the_receiver_got_non_finite():
    corrupted = link_findings([_links(0, sent_forward=None, received_backward=None),
                               _links(1, received_forward=1, sent_backward=None)])
    assert [(f.direction, f.sender, f.receiver, f.transfer, f.sent) for f in corrupted] == [
        ("forward", 0, 1, 1, "finite")]
    decided = decide(evidence(links=corrupted))
    assert decided.rule == "pipeline_link" and decided.origin == (0, 1) and "pp0 -> pp1" in decided.summary
    # the sender's own activation was already bad at that transfer (or before): not the link
    made = link_findings([_links(0, sent_forward=0), _links(1, received_forward=1)])
    assert made[0].sent == "nonfinite" and decide(evidence(links=made)).rule != "pipeline_link"
    # bad only after it (the corrupted value came back around the interleaved schedule's ring): the link
    ring = link_findings([_links(0, sent_forward=1), _links(1, received_forward=0)])
    assert ring[0].sent == "finite" and decide(evidence(links=ring)).rule == "pipeline_link"
    # the sender's records are not there: undetermined, naming the receiver and what was not observed
    alone = link_findings([_links(1, received_forward=1)])
    decided = decide(evidence(links=alone))
    assert decided.rule == "link_unobserved" and decided.cause is Cause.UNDETERMINED
    assert decided.origin == (1,) and "not observed" in decided.summary
    # received non-finite both ways, the sender's records missing: the receiver is named once
    both = link_findings([_links(1, received_forward=1, received_backward=0)])
    assert len(both) == 2 and decide(evidence(links=both)).origin == (1,)


def test_a_collective_beside_replicas_that_recorded_nothing_does_not_claim_they_were_checked():
    facts, _ = CASES["gradient_collective"]
    assert "(checked on each)" in decide(evidence(**facts)).summary
    quiet = decide(evidence(**facts, silent_replicas=(0, 1)))
    assert quiet.rule == "gradient_collective" and "(checked on each)" not in quiet.summary
    assert "the replicas of rank(s) 0, 1 had a finite norm" in quiet.summary


def test_a_later_weight_whose_peers_did_not_read_theirs_does_not_claim_every_replica():
    """Rank 0's records missing: rank 1's bad weight was read, its peer's copy was not."""
    alone = decide(evidence(bad_weights=(NAN_WEIGHT,), replicas_compared=False, weights_unpeered=True))
    assert alone.rule == "later_weights" and "every replica holding" not in alone.summary
    assert "is not known" in alone.summary
    compared = decide(evidence(bad_weights=(NAN_WEIGHT,), replicas_compared=True))
    assert "on every replica holding" in compared.summary


def test_a_gradient_corrupted_on_its_way_back_is_the_link_not_a_backward_operator_with_the_loss():
    """Issue 48 case 2: stage 0 received a NaN gradient that stage 1 sent finite; every gradient of stage 0
    non-finite was called 'the loss's own gradient' on a stage without the loss."""
    links = link_findings([_links(0, received_backward=0), _links(1, sent_backward=None)])
    decided = decide(evidence(links=links, gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0,),
                              forward_pattern=True, share_nonfinite=1.0, rerun=Conclusion.BACKWARD))
    assert decided.rule == "pipeline_link" and decided.origin == (1, 0) and "gradient" in decided.summary
    assert "loss" not in decided.summary


def test_a_backward_operator_on_the_later_stage_leaves_out_the_stage_that_only_received_its_gradient():
    links = link_findings([_links(0, received_backward=0), _links(1, sent_backward=0)])
    decided = decide(evidence(links=links, gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                              gradient_origin=(0, 1), first_rank=1, rerun=Conclusion.BACKWARD,
                              first_in_backward="decoder.layers.1.mlp.linear_fc2.weight"))
    assert decided.rule == "backward_operator" and decided.origin == (1,)
    # every gradient of both stages non-finite: the stage that made it is named, not the one it reached
    decided = decide(evidence(links=links, gradient_basis=OriginBasis.BEFORE_COLLECTIVE,
                              gradient_origin=(0, 1), forward_pattern=True, share_nonfinite=1.0,
                              rerun=Conclusion.BACKWARD))
    assert decided.origin == (1,) and "every gradient of rank 1 is" in decided.summary


def test_without_a_pipeline_the_links_are_not_missing_evidence():
    decided = decide(evidence(observed=frozenset(Fact) - {Fact.PIPELINE_LINKS}, recorded_norm=True))
    assert Fact.PIPELINE_LINKS in decided.not_observed  # a pipelined run without them says so


def test_weights_outrank_the_forward_origin_that_only_received_them():
    """A NaN weight on TP rank 1 reaches TP rank 0's row-parallel output through the all-reduce: the rerun
    names rank 0's layer, the weights name rank 1."""
    facts, _ = CASES["weights_at_launch"]
    decided = decide(evidence(**facts))
    assert decided.cause is Cause.WEIGHTS and decided.origin == (1,)
    assert "came with the checkpoint" in decided.summary and "linear_fc1.weight[0, 7]" in decided.summary


def test_every_gradient_bad_with_a_clean_forward_pass_and_loss_run_again_is_backward_not_undecided():
    """Seen on pretrain_gpt.py: a loss whose backward divides by zero; the rerun saw the forward pass and the
    loss finite, every gradient was non-finite, so no gradient comes first in backward order."""
    decided = decide(evidence(gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0, 1),
                              forward_pattern=True, share_nonfinite=1.0, rerun=Conclusion.BACKWARD))
    assert decided.rule == "backward_operator" and "from backward's first operator on" in decided.summary
    assert "not run again" not in decided.summary


def test_some_gradients_bad_beside_a_non_finite_loss_without_a_rerun_is_not_a_backward_operator():
    """Seen planting an expert's forward overflow under fp16 and expert parallelism (no rerun there): the
    receiving rank's gradients were only partly non-finite, its first in backward order the output layer's,
    and its fp16 skip said its loss was non-finite: the forward pass made it, not backward."""
    facts = dict(gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0, 1), share_nonfinite=0.6,
                 first_rank=0, first_in_backward="output_layer.weight")
    assert decide(evidence(**facts)).rule == "backward_operator"
    decided = decide(evidence(**facts, losses_nonfinite=(0,)))
    assert (decided.cause, decided.rule) == (Cause.UNDETERMINED, "forward_not_rerun")
    assert decided.summary.startswith("the loss of rank 0 was non-finite in the failing pass: the forward")


def test_a_loss_from_finite_outputs_is_the_loss_not_the_device():
    facts, _ = CASES["loss_function"]
    decided = decide(evidence(**facts))
    assert decided.cause is Cause.LOSS and "micro-batch 1" in decided.summary


def test_a_collective_with_clean_inputs_does_not_claim_the_check_was_off():
    facts, _ = CASES["gradient_collective"]
    decided = decide(evidence(**facts))
    assert decided.cause is Cause.COLLECTIVE and "pre_reduction" not in decided.summary


def test_a_lone_replica_backward_fault_says_how_to_tell_the_operator_from_the_device():
    facts, _ = CASES["backward_operator"]
    assert "if not the device" in decide(evidence(**facts)).summary
    assert "if not the device" not in decide(evidence(**{**facts, "origin_replicas": (0, 1)})).summary


def test_the_replicas_weights_are_compared_by_digest_among_data_parallel_peers():
    def state(rank, tp, dp, digest):
        return {"rank": {"global_rank": rank, "tp": tp, "pp": 0, "dp": dp}, "weights_digest": digest}

    same = [state(0, 0, 0, "a"), state(1, 1, 0, "b"), state(2, 0, 1, "a"), state(3, 1, 1, "b")]
    assert replica_digests(same) == ((), ())
    odd = same + [state(4, 0, 2, "a"), state(5, 0, 3, "z")]
    assert replica_digests(odd) == ((5,), ())
    assert replica_digests([state(0, 0, 0, "a"), state(2, 0, 1, "z")]) == ((), (0, 2))


def test_two_replicas_that_differ_name_the_one_that_failed():
    """No majority of copies (two replicas): the one whose own gradients, or forward pass run again, went
    non-finite holds the odd copy; where neither or both did, both are named."""
    split = dict(split_replicas=(0, 1), rerun=Conclusion.REPRODUCIBLE, rerun_module="m")
    failed = decide(evidence(**split, rerun_origins=(1,)))
    assert (failed.rule, failed.origin) == ("replicas_disagree", (1,))
    assert "only theirs produced the non-finite values" in failed.summary
    before = decide(evidence(**split, gradient_basis=OriginBasis.BEFORE_COLLECTIVE, gradient_origin=(0,)))
    assert before.origin == (0,)
    assert decide(evidence(**split, rerun_origins=(0, 1))).origin == (0, 1)
    undecided = decide(evidence(**split))
    assert undecided.origin == (0, 1) and "no majority to tell which copy is right" in undecided.summary


def test_a_diverged_replica_is_named_with_its_parameter_element_and_values_and_drained():
    decided = decide(evidence(divergence=DIVERGED))
    assert decided.cause is Cause.REPLICA_DIVERGENCE and decided.basis is OriginBasis.REPLICA_CHECK
    assert decided.culprit == FLIPPED.name
    assert ("linear_fc1.weight[0, 5] = 0.0654296875 on rank 2 where the majority holds 0.032470703125"
            in decided.summary)
    assert "the copy 2 of the 3 data-parallel replicas hold" in decided.summary
    origin = ({"global_rank": 2, "host": "h", "device": "cuda:2"},)
    steps = next_steps(decided.actions, evidence(divergence=DIVERGED),
                       Setting(origin, {2: origin[0]}, "run"))
    assert [step.action for step in steps] == [Action.DRAIN, Action.SELFTEST, Action.RESUME]
    assert "older than step 5 (iteration 105), the replica check that saw the replicas" in steps[2].text


def test_two_replicas_that_differ_are_both_named_and_which_is_wrong_is_not_claimed():
    both = ReplicaDivergence((0, 1), 2, None, 7, (DivergedWeight(0, "w", (3,), 1.0, None),
                                                  DivergedWeight(1, "w", (3,), 2.0, None)), 1)
    decided = decide(evidence(divergence=both))
    assert decided.origin == (0, 1)
    assert "no majority: which copy is wrong cannot be told" in decided.summary
    assert "w[3] = 1.0 on rank 0; w[3] = 2.0 on rank 1" in decided.summary and "majority holds" not in \
        decided.summary
    assert "read at step 7" in decided.summary


def test_a_divergence_whose_copies_agreed_again_says_its_element_was_not_located():
    healed = ReplicaDivergence((1,), 4, 3, 10, (DivergedWeight(1, "w", None, None, None),), 2)
    decided = decide(evidence(divergence=healed))
    assert "first differing element not located" in decided.summary and "and 1 more parameter" in \
        decided.summary


def test_non_finite_weights_outrank_the_replica_check_that_also_saw_them():
    """A NaN in one replica's weight also makes its digest differ: the state record's finding is the more
    specific one."""
    decided = decide(evidence(bad_weights=(NAN_WEIGHT,), lone_weights=(1,), divergence=DIVERGED))
    assert decided.rule == "one_replica_weights"


def test_docs_table_is_the_rule_table():
    """docs/how-it-works.md lists the rules in order, each with its cause and its predicate in words."""
    text = (Path(__file__).parents[1] / "docs" / "how-it-works.md").read_text()
    text = text.split("The rules, in the order they are tried")[1]
    rows = re.findall(r"^\| `([a-z_]+)` \| `([a-z_]+)` \| ([a-z_, -]+) \| (.+?) \|$", text,
                      flags=re.MULTILINE)
    assert {rule: (cause, needs, when) for rule, cause, needs, when in rows} == rules_table()
    assert [rule for rule, *_ in rows] == list(rules_table())


@pytest.mark.parametrize("rule", list(CASES))
def test_a_rule_cannot_fire_without_the_evidence_it_needs(rule):
    """Each case with one needed kind of evidence not observed: another rule decides, and the decision
    lists what was missing."""
    needs = next(r.needs for r in RULES if r.id == rule)
    facts, _ = CASES[rule]
    for fact in needs:
        decided = decide(evidence(**{**facts, "observed": frozenset(Fact) - {fact}}))
        assert decided.rule != rule and fact in decided.not_observed


def test_a_forward_origin_without_a_rerun_on_record_is_undetermined_and_says_how_to_see_it():
    """The rerun's facts in memory but no rerun in the run's files (a hostile or partial run dir): no
    confident forward_op; the summary does not claim it, the missing rerun is named."""
    facts, _ = CASES["forward_operator"]
    decided = decide(evidence(**{**facts, "observed": frozenset(Fact) - {Fact.RERUN}}))
    assert decided.cause is Cause.UNDETERMINED and decided.not_observed == (Fact.RERUN,)
    assert "rerun='auto'" in missing_text(decided.not_observed)


SETTING = Setting(origin=({"global_rank": 1, "host": "node-1", "device": "cuda:1"},),
                  ranks={1: {"global_rank": 1, "host": "node-1"}}, run_dir="/run", bundle="/run/b",
                  bundle_module="m", bundle_rank=1, batch="/run/batch.pt", reran=True,
                  capture={"GRADNAN_CAPTURE_MODULES": "x", "GRADNAN_CAPTURE_STEPS": "5",
                           "GRADNAN_CAPTURE_RANKS": "1"})


@pytest.mark.parametrize("rule", list(CASES))
def test_every_rule_lists_next_actions_that_give_at_least_one_step(rule):
    decided = decide(evidence(**CASES[rule][0]))
    steps = next_steps(decided.actions, evidence(**CASES[rule][0]), SETTING)
    assert steps, rule
    undecided = decided.cause is Cause.UNDETERMINED
    assert (steps[0].action is Action.DECIDE) is undecided


@pytest.mark.parametrize("rule, culprit", [
    ("weights_at_launch", NAN_WEIGHT.name),  # the bad weight, not the rerun's module
    ("norm_overflow", "output_layer.weight"),  # the largest gradient
    ("backward_operator", "decoder.layers.0.mlp.linear_fc1.weight"),  # first in backward order
])
def test_each_rule_names_the_parameter_whose_run_up_is_read(rule, culprit):
    facts = {**CASES[rule][0], "largest_names": {1: "output_layer.weight"}}
    assert decide(evidence(**facts)).culprit == culprit


def test_a_forward_origin_reads_the_run_up_of_a_parameter_inside_its_module():
    facts = {**CASES["forward_operator"][0],
             "origin_params": {3: ("decoder.layers.2.mlp.x.weight",
                                   "decoder.layers.1.mlp.linear_fc2.weight")}}
    assert decide(evidence(**facts)).culprit == "decoder.layers.1.mlp.linear_fc2.weight"


@pytest.mark.parametrize("every_step, skipped", [(False, True), (True, False)])
def test_a_rows_next_steps_restore_it_and_skip_only_where_the_data_alone_reads_it(every_step, skipped):
    """Issue 48, case 6: restore the row (one step for the ranks holding it), never change the numerics;
    the skip only for a row read where the data holds its token (untied) whose step failed again in the
    forward pass: a row every step reads (tied, the output layer's) fails the next step too."""
    rows = tuple(dataclasses.replace(HUGE_ROW, rank=rank, every_step=every_step) for rank in (1, 3))
    facts = dict(outlying_rows=rows, rerun=Conclusion.REPRODUCIBLE, rerun_module="decoder.layers.0.mlp",
                 rerun_origins=(1,), micro_batch=0, iterations_seen=(105,))
    decided = decide(evidence(**facts))
    assert (decided.rule, decided.origin, decided.culprit) == ("embedding_row", (1, 3), HUGE_ROW.name)
    assert "row 5 of embedding.word_embeddings.weight (token 37)" in decided.summary
    steps = next_steps(decided.actions, evidence(**facts), dataclasses.replace(SETTING, megatron_reran=True))
    assert steps[0].action is Action.RESTORE_ROW and "on rank 1; rank 3" in steps[0].text
    assert "Megatron's validate_results wrote at its exit (iteration 104)" in steps[0].text
    assert [step.action for step in steps].count(Action.RESTORE_ROW) == 1
    assert (Action.SKIP_ITERATION in [step.action for step in steps]) is skipped
    assert Action.TUNE_NUMERICS not in [step.action for step in steps]


def test_a_loss_scaler_gone_wrong_names_the_scale_and_no_parameter():
    """Issue 59 (5): the scale itself is the cause; where no record holds it, undetermined, never a
    parameter."""
    decided = decide(evidence(**CASES["loss_scale"][0]))
    assert decided.cause is Cause.LOSS_SCALE and decided.culprit is None and "inf" in decided.summary
    unread = decide(evidence(**CASES["loss_scale_unread"][0]))
    assert unread.cause is Cause.UNDETERMINED and unread.culprit is None


def test_a_tensor_parallel_loss_split_is_the_collective_not_the_loss_function():
    """Issue 59 (4): 'the loss function made it ... the device not at fault' was said of one TP rank."""
    decided = decide(evidence(**CASES["tensor_parallel_loss"][0]))
    assert decided.cause is Cause.COLLECTIVE and "not the loss function" in decided.summary
    both = decide(evidence(**{**CASES["tensor_parallel_loss"][0], "tensor_parallel_loss_split": ()}))
    assert both.rule == "loss_function"
