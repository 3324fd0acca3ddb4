"""Issue 47: every decision is taken by a declared table in ``gradnan.decision`` (the replicas'
conclusions, the gradients' origin, the cause and its next actions), the docs' tables are those tables,
a rerun record carries observations (version 2) and version 1 records still read, and no module outside
the tables names a cause or builds a next action."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from gradnan.decision.facts import Fact
from gradnan.decision.origin import ORIGIN_RULES, decide_gradient_origin, silent_replicas, unchecked_ranks
from gradnan.decision.replica import (
    PRECEDENCE,
    REPLICA_RULES,
    conclude,
    conclusion_of,
    own_failure_of,
    replica_rule,
    strongest,
)
from gradnan.errors import InputError
from gradnan.formats.incident import Cause, Conclusion, OriginBasis, OwnFailure
from gradnan.formats.observed import ReplicaObservation, Seen
from gradnan.formats.records import from_json
from gradnan.offline.incident.analysis import analyze

from .helpers import observed
from .test_report_unit import _files, _record, clean_states

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "how-it-works.md").read_text()
ALL_OBSERVATIONS = [ReplicaObservation(reproduced, loss, again, own, overflow, job)
                    for reproduced, loss, again, own, overflow, job in itertools.product(
                        (False, True), Seen, Seen, Seen, (False, True),
                        (None, Conclusion.REPRODUCIBLE, Conclusion.TRANSIENT))]


def test_docs_list_the_replica_rules_and_their_precedence():
    rows = re.findall(r"^\| `([a-z_]+)` \| `([a-z_]+)` \| ([a-z_, -]+) \| (.+?) \|$",
                      DOCS.split("The replica conclusions, in the order")[1].split("\n\n")[1], re.MULTILINE)
    assert rows == [(rule.id, rule.conclusion.value, ", ".join(rule.reads) or "-", rule.when)
                    for rule in REPLICA_RULES]
    assert ("the report leads with the first of: " + ", ".join(f"`{c.value}`" for c in PRECEDENCE)) in DOCS


def test_docs_list_the_origin_rules():
    table = DOCS.split("| `origin_basis` | needs |")[1].split("\n\n")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([a-z_, -]+) \| (.+?) \|$", table, re.MULTILINE)
    assert rows[:-1] == [(rule.basis.value, ", ".join(fact.value for fact in rule.needs), rule.when)
                         for rule in ORIGIN_RULES]
    assert rows[-1][0] == "none"


def test_every_replica_rule_reads_only_observations_and_every_one_can_decide():
    fields = set(ReplicaObservation.__dataclass_fields__)
    assert all(set(rule.reads) <= fields for rule in REPLICA_RULES)
    deciding = {replica_rule(observation).id for observation in ALL_OBSERVATIONS}
    assert deciding == {rule.id for rule in REPLICA_RULES}


def test_where_two_replica_rules_hold_the_table_order_says_which_wins():
    """A replica that failed again outweighs its own loss having failed (not transient); an overflow of
    finite gradients outweighs own gradients seen non-finite only if Megatron did not find them transient."""
    both = ReplicaObservation(True, loss=Seen.NONFINITE)
    holding = [rule.id for rule in REPLICA_RULES if rule.applies(both)]
    assert holding[:2] == ["failed_again", "own_loss_only_then"]
    assert conclude(both) is Conclusion.REPRODUCIBLE
    overflow = ReplicaObservation(False, own_gradients=Seen.NONFINITE, norm_overflow=True)
    assert conclude(overflow) is Conclusion.NORM_OVERFLOW
    assert conclude(ReplicaObservation(False, own_gradients=Seen.NONFINITE, norm_overflow=True,
                                       megatron_job=Conclusion.TRANSIENT)) is Conclusion.TRANSIENT


def test_precedence_orders_every_conclusion_once():
    assert sorted(PRECEDENCE) == sorted(Conclusion) and len(set(PRECEDENCE)) == len(PRECEDENCE)
    assert strongest([Conclusion.AFTER_COLLECTIVE, Conclusion.TRANSIENT]) is Conclusion.TRANSIENT
    assert strongest([Conclusion.NOT_REPRODUCED, Conclusion.BACKWARD]) is Conclusion.BACKWARD


def _rerun(version, **fields):
    return {"schema": "gradnan.record", "version": version, "kind": "rerun", "step": 2, "params": [],
            "rank": {"global_rank": 0, "world_size": 1}, "role": "clean", "output_abs_max": None,
            "micro_batch": None, "module": None, **fields}


def test_a_version_2_rerun_record_carries_observations_and_is_concluded_when_read():
    record = from_json(_rerun(2, observed=observed("transient", "gradients"), megatron="transient"), "f:1")
    assert conclusion_of(record) is Conclusion.TRANSIENT and own_failure_of(record) is OwnFailure.GRADIENTS
    assert "conclusion" not in record


def test_a_version_1_rerun_record_still_reads_with_the_conclusion_it_wrote():
    record = from_json(_rerun(1, conclusion="backward", own_failure=None), "f:1")
    assert conclusion_of(record) is Conclusion.BACKWARD and own_failure_of(record) is None


@pytest.mark.parametrize("observed_fields", [
    None, [], {"reproduced": "yes"}, {**observed("backward"), "loss": "maybe"},
    {**observed("backward"), "megatron_job": "backward"}, {**observed("backward"), "norm_overflow": 1},
])
def test_a_malformed_observation_is_a_problem_with_its_line_not_a_traceback(observed_fields):
    with pytest.raises(InputError, match="f:7: a rerun record needs"):
        from_json(_rerun(2, observed=observed_fields), "f:7")


def test_a_version_2_rerun_record_without_observations_is_refused_even_with_a_conclusion():
    with pytest.raises(InputError, match="a rerun record needs"):
        from_json(_rerun(2, conclusion="reproducible", own_failure=None), "f:1")


def test_the_gradients_origin_rules_in_order():
    def record(kind, rank, params=(), **extra):
        return {"kind": kind, "rank": {"global_rank": rank}, "params": [{"name": p} for p in params],
                **extra}

    pre = record("pre_reduction", 1, ["w"])
    norm = record("nonfinite_grad_norm", 0, ["w"], pre_reduction="clean")
    merged = {**pre, "params_total": 1}
    assert decide_gradient_origin([norm, pre], ()) == (OriginBasis.BEFORE_COLLECTIVE, [merged])
    assert decide_gradient_origin([norm], ())[0] is OriginBasis.AFTER_COLLECTIVE
    assert decide_gradient_origin([{**norm, "pre_reduction": "unchecked"}], ())[0] is OriginBasis.UNCONFIRMED
    # ranks 0 and 2 (tp0, tp1) of replica dp0 and rank 1 of dp1: rank 2 shares rank 0's non-finite norm
    known = {0: {"dp": 0}, 1: {"dp": 1}, 2: {"dp": 0}}
    holder = {**norm, "rank": {"global_rank": 0, "world_size": 3, "dp": 0}}

    def decided(*records):
        return decide_gradient_origin(list(records), unchecked_ranks(list(records), known))

    assert decided(holder) == (OriginBasis.UNCHECKED, [{**holder, "params_total": 1}])
    assert unchecked_ranks([holder], known) == (2,)  # rank 1's finite norm: no record, nothing missing
    unchecked = {**norm, "rank": {"global_rank": 2, "world_size": 3, "dp": 0}, "pre_reduction": "unchecked",
                 "params": []}
    assert decided(holder, unchecked)[0] is OriginBasis.UNCHECKED
    checked = {**unchecked, "pre_reduction": "clean"}
    assert decided(holder, checked)[0] is OriginBasis.AFTER_COLLECTIVE
    assert unchecked_ranks([holder], {**known, 5: {"dp": 0}}) == (2,)  # rank 5: not of this 3-rank job
    assert silent_replicas([holder], known) == (1,)  # no rank of replica dp1 recorded: a finite norm there
    big = {"name": "w", "value": 1e30, "overflows": True}
    overflow = record("nonfinite_grad_norm", 2, largest_grad=big, pre_reduction="clean")
    assert decide_gradient_origin([overflow], ()) == (OriginBasis.NORM_OVERFLOW, [overflow])
    assert decide_gradient_origin([], ()) == (OriginBasis.NONE, [])


# the modules allowed to name a Cause member or build a next step: the tables, the vocabulary that
# defines them, and the fault plants that compute the expected answer of a planted fault
DECIDERS = ("gradnan/decision/", "gradnan/formats/incident.py", "gradnan/testing/plants.py")


def test_no_cause_or_next_action_is_decided_outside_the_tables():
    pattern = re.compile(r"\bCause\.[A-Z]|\bNextStep\(|\bAction\.[A-Z]+\.wording|\bRULES\b.*\bapplies")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for folder in ("gradnan", "patches") for path in sorted((ROOT / folder).rglob("*.py"))
             if not str(path.relative_to(ROOT)).startswith(DECIDERS)
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_an_undetermined_verdict_says_what_was_not_observed_and_how_to_observe_it():
    """No rerun, no state, no pre-reduction check, no maps: the rules that needed them could not fire, and
    the report says so; a run without data parallelism is not told to compare replicas."""
    norm = _record(2, "nonfinite_grad_norm", 0, ["a.weight"], pre_reduction="unchecked")
    norm["rank"].update(dp_size=1)
    incident = analyze(_files(norm)).incident
    assert incident.verdict.cause is Cause.UNDETERMINED
    assert [fact.value for fact in incident.verdict.not_observed] == [
        "states", "rerun", "own_gradients", "parameter_maps"]
    line = incident.verdict.evidence[-1]
    assert line.startswith("not observed: the weights and optimizer state") and "rerun='auto'" in line
    with_states = analyze(_files(norm, *clean_states([norm]))).incident.verdict
    assert not {Fact.REPLICA_DIGESTS, Fact.STATES} & set(with_states.not_observed)
    assert analysis_json(norm)["incident"]["verdict"]["not_observed"][0] == "states"


def analysis_json(*records):
    return analyze(_files(*records)).to_json()


def test_the_weights_are_called_equal_across_replicas_only_where_peers_were_compared():
    """Issue 52: "weights equal across data-parallel replicas" was printed after reading one rank."""
    norm = _record(2, "nonfinite_grad_norm", 0, ["a.weight"], pre_reduction="clean")  # dp_size 2
    peer = _record(2, "nonfinite_grad_norm", 1, ["a.weight"], pre_reduction="clean")

    def weights_line(*records):
        lines = analyze(_files(*records)).incident.verdict.evidence
        return next(line for line in lines if line.startswith("weights when the step began"))

    assert weights_line(norm, *clean_states([norm])).endswith(
        "weights not compared across data-parallel replicas (no peer of theirs read them)")
    assert weights_line(norm, peer, *clean_states([norm, peer])).endswith(
        "weights equal across data-parallel replicas")
    alone = {**norm, "rank": {**norm["rank"], "dp_size": 1}}
    assert weights_line(alone, *clean_states([alone])).endswith("optimizer state finite")
