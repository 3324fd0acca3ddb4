"""One data-parallel replica's conclusion about the failing step, from what its in-place rerun observed.

The training side writes the observations (a ``rerun`` record's ``observed``, version 2); ``conclude``
turns them into a ``Conclusion`` by the first rule of ``REPLICA_RULES`` that applies. The rank's log line,
TensorBoard and the report all call ``conclude``: changing what "transient" means is a change of this
table alone. Records of version 1 carry the conclusion their gradnan reached (``conclusion_of`` reads it).

Replicas may conclude differently (one failed again, its peer only received the values); ``PRECEDENCE``
declares which replica's conclusion the job's report leads with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Tuple

from ..formats.incident import Conclusion, OwnFailure
from ..formats.observed import ReplicaObservation, Seen


@dataclass(frozen=True)
class ReplicaRule:
    """One row: the ``conclusion`` it reaches, the observations it reads (``reads``), the predicate and the
    predicate in words (docs/how-it-works.md)."""

    id: str
    conclusion: Conclusion
    reads: Tuple[str, ...]
    when: str
    applies: Callable[[ReplicaObservation], bool]


def _failed_again(o: ReplicaObservation) -> bool:
    return o.reproduced


REPLICA_RULES: Tuple[ReplicaRule, ...] = (
    ReplicaRule("failed_again", Conclusion.REPRODUCIBLE, ("reproduced",),
                "a traced module's output went non-finite again", _failed_again),
    ReplicaRule("loss_again", Conclusion.LOSS, ("loss_again",),
                "every module's output finite again, and the loss computed from it not",
                lambda o: o.loss_again is Seen.NONFINITE),
    ReplicaRule("own_loss_only_then", Conclusion.TRANSIENT, ("loss",),
                "finite again, although its own loss was not in the failing pass",
                lambda o: o.loss is Seen.NONFINITE),
    ReplicaRule("own_gradients_only_then", Conclusion.TRANSIENT, ("own_gradients", "megatron_job"),
                "finite again, its own gradients non-finite in the failing pass, and Megatron's rerun of"
                " forward and backward finite",
                lambda o: o.own_gradients is Seen.NONFINITE and o.megatron_job is Conclusion.TRANSIENT),
    ReplicaRule("norm_overflowed", Conclusion.NORM_OVERFLOW, ("norm_overflow",),
                "forward pass finite, every gradient finite, a float32 sum of squares not",
                lambda o: o.norm_overflow),
    ReplicaRule("own_gradients_bad", Conclusion.BACKWARD, ("own_gradients",),
                "forward pass finite in both passes, its own gradients non-finite",
                lambda o: o.own_gradients is Seen.NONFINITE),
    ReplicaRule("own_gradients_clean", Conclusion.AFTER_COLLECTIVE, ("own_gradients",),
                "forward pass, loss and its own gradients before the data-parallel collective finite",
                lambda o: o.own_gradients is Seen.FINITE),
    ReplicaRule("loss_finite_gradients_unchecked", Conclusion.BACKWARD, ("loss", "own_gradients"),
                "forward pass finite in both passes, its loss finite, its own gradients unchecked",
                lambda o: o.loss is Seen.FINITE),
    ReplicaRule("nothing_seen", Conclusion.NOT_REPRODUCED, (),
                "finite again, and neither its loss nor its own gradients seen", lambda o: True),
)


def replica_rule(observation: ReplicaObservation) -> ReplicaRule:
    """The first rule of ``REPLICA_RULES`` that applies (the last always does)."""
    return next(rule for rule in REPLICA_RULES if rule.applies(observation))


def conclude(observation: ReplicaObservation) -> Conclusion:
    """The replica's conclusion: what its log line, TensorBoard and the report say."""
    return replica_rule(observation).conclusion


PRECEDENCE: Tuple[Conclusion, ...] = (
    Conclusion.REPRODUCIBLE, Conclusion.LOSS, Conclusion.TRANSIENT, Conclusion.NORM_OVERFLOW,
    Conclusion.BACKWARD, Conclusion.AFTER_COLLECTIVE, Conclusion.NOT_REPRODUCED)
"""Which replica's conclusion the job's report leads with, first wins: a replica that failed again (or
in its loss) outweighs one whose own values failed only in the failing pass, which outweighs one that
saw an overflow from finite gradients, then one whose backward pass made them, then one that only
received them, then one that saw nothing."""


def strongest(conclusions: Iterable[Conclusion]) -> Conclusion:
    """The conclusion of ``PRECEDENCE`` that comes first among ``conclusions``."""
    return min(conclusions, key=PRECEDENCE.index)


def conclusion_of(record: Mapping[str, Any]) -> Conclusion:
    """A checked ``rerun`` record's replica conclusion: decided from its ``observed`` (version 2), else
    the one its gradnan wrote (version 1)."""
    observed = record.get("observed")
    if observed is not None:
        return conclude(ReplicaObservation.from_json(observed))
    return Conclusion(record["conclusion"])


def own_failure_of(record: Mapping[str, Any]) -> Optional[OwnFailure]:
    """What of a checked ``rerun`` record's replica's own failed in the failing pass."""
    observed = record.get("observed")
    if observed is not None:
        return ReplicaObservation.from_json(observed).own_failure
    return OwnFailure(record["own_failure"]) if record.get("own_failure") else None
