"""The facts a rule may need (``Fact``): each is observed or not in a given run, and a rule whose facts
were not all observed cannot fire. Where that leaves the verdict undecided, the report says which facts
were missing and how to observe them next time (``Fact.how_to_observe``).
"""

from __future__ import annotations

import enum
from typing import FrozenSet, Iterable, Tuple


class Fact(str, enum.Enum):
    """One kind of evidence, as the run's files hold it or not."""

    GRADIENTS = "gradients"
    """The gradients at the grad norm (or the fp16 overflow check): incident records."""
    OWN_GRADIENTS = "own_gradients"
    """Each rank's own gradients before the data-parallel collective (the pre-reduction check)."""
    PARAMETER_MAPS = "parameter_maps"
    """The origin's parameter maps: how many gradients it has, to tell a forward from a backward pattern."""
    LARGEST_GRADIENT = "largest_gradient"
    """The largest finite gradient of a rank whose gradients were all finite (a norm overflow)."""
    STATES = "states"
    """The weights and optimizer state when the failing step began (``state`` records)."""
    REPLICA_DIGESTS = "replica_digests"
    """The weights' digests of two or more data-parallel peers (``state`` records of a replica group)."""
    LEARNING_RATES = "learning_rates"
    """The learning rates of the steps before the failing one (``state`` records' ``learning_rates``)."""
    RERUN = "rerun"
    """The failing step run again in place (``rerun`` records)."""
    PIPELINE_LINKS = "pipeline_links"
    """What each pipeline stage sent and received over its point-to-point links (incident records)."""
    CHECKPOINT_MARKS = "checkpoint_marks"
    """Whether each checkpoint saved held only finite weights, main copies and moments (``checkpoint``
    records): what the restart advice names a checkpoint by."""

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]

    @property
    def how_to_observe(self) -> str:
        return _HOW[self]


_DESCRIPTIONS = {
    Fact.GRADIENTS: "the non-finite gradients at the grad norm",
    Fact.OWN_GRADIENTS: "each rank's own gradients before the data-parallel collective",
    Fact.PARAMETER_MAPS: "the origin's parameter map (how many gradients it has)",
    Fact.LARGEST_GRADIENT: "the largest finite gradient",
    Fact.STATES: "the weights and optimizer state when the failing step began",
    Fact.REPLICA_DIGESTS: "the weights of two or more data-parallel replicas",
    Fact.LEARNING_RATES: "the learning rates of the last steps",
    Fact.RERUN: "the failing step run again in place",
    Fact.PIPELINE_LINKS: "what each pipeline stage sent and received over its links",
    Fact.CHECKPOINT_MARKS: "the checkpoints' marks (their weights and optimizer state finite or not)",
}

_HOW = {
    Fact.GRADIENTS: "keep gradnan installed on every rank (records of every rank in one run dir)",
    Fact.OWN_GRADIENTS: "run with pre_reduction='deferred' (the default) under Megatron's DDP",
    Fact.PARAMETER_MAPS: "keep every rank's gradnan.map files in the run dir",
    Fact.LARGEST_GRADIENT: "keep gradnan installed on every rank (its records name the largest gradient)",
    Fact.STATES: "record on every rank (gradnan's ranks unset): each reads its weights at the first incident",
    Fact.REPLICA_DIGESTS: "with data parallelism, record on every rank, so that peers' weights are compared",
    Fact.LEARNING_RATES: "record on every rank with this gradnan (state records carry them since records v2)",
    Fact.RERUN: "run with rerun='auto' (the default) under megatron-core's schedules",
    Fact.PIPELINE_LINKS: "record on every pipeline stage with the pipeline_links patch on (the default)",
    Fact.CHECKPOINT_MARKS: ("save checkpoints with gradnan installed (patch checkpoint: Megatron-LM's"
                            " save_checkpoint, megatron-core's dist_checkpointing.save); a checkpoint saved"
                            " before it was installed has none"),
}


# facts that come with another: not said missing where that one is (the state records carry them)
COMES_WITH = {Fact.LEARNING_RATES: Fact.STATES, Fact.REPLICA_DIGESTS: Fact.STATES}


def first_missing(facts: Iterable[Fact]) -> Tuple[Fact, ...]:
    """``facts`` without those that come with another of them."""
    listed = tuple(facts)
    return tuple(fact for fact in listed if COMES_WITH.get(fact) not in listed)


def missing_text(facts: Iterable[Fact]) -> str:
    """What was not observed, and how to observe it: "the failing step run again in place (run with ...)"."""
    return "; ".join(f"{fact.description} (to see it: {fact.how_to_observe})" for fact in facts)


def unobserved(needs: Tuple[Fact, ...], observed: FrozenSet[Fact]) -> Tuple[Fact, ...]:
    """The facts of ``needs`` that were not observed, in ``needs``' order."""
    return tuple(fact for fact in needs if fact not in observed)
