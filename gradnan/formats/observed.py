"""What one data-parallel replica observed when its failing step was run again in place: a ``rerun``
record's ``observed`` (records version 2), the same on every rank of the replica's model-parallel group.
Observations only: ``decision.replica`` concludes from them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from .incident import Conclusion, OwnFailure


class Seen(str, enum.Enum):
    """How a value stood in a pass: non-finite, finite, or not seen (no rank of the replica saw it)."""

    NONFINITE = "nonfinite"
    FINITE = "finite"
    UNSEEN = "unseen"

    @classmethod
    def of(cls, value: Optional[bool]) -> "Seen":
        """From "was it finite" (None: not seen)."""
        return cls.UNSEEN if value is None else cls.FINITE if value else cls.NONFINITE


@dataclass(frozen=True)
class ReplicaObservation:
    """What one data-parallel replica saw of the failing step, all-reduced over its model-parallel group
    (the same on each of its ranks): the fields of a ``rerun`` record's ``observed``.

    ``reproduced``: a traced module's output went non-finite again when the step was run again.
    ``loss``: the failing pass's loss. ``loss_again``: the loss of the pass run again.
    ``own_gradients``: its own gradients before the data-parallel collective (unseen: unchecked).
    ``norm_overflow``: every gradient of the group finite and a rank's float32 sum of squares not.
    ``megatron_job``: Megatron's own rerun of the step (forward and backward), job-wide (None: none ran)."""

    reproduced: bool
    loss: Seen = Seen.UNSEEN
    loss_again: Seen = Seen.UNSEEN
    own_gradients: Seen = Seen.UNSEEN
    norm_overflow: bool = False
    megatron_job: Optional[Conclusion] = None

    @property
    def own_failure(self) -> Optional[OwnFailure]:
        """What of this replica's own went non-finite in the failing pass (None: nothing seen)."""
        if self.loss is Seen.NONFINITE:
            return OwnFailure.LOSS
        return OwnFailure.GRADIENTS if self.own_gradients is Seen.NONFINITE else None

    def to_json(self) -> Dict[str, Any]:
        return {"reproduced": self.reproduced, "loss": self.loss.value, "loss_again": self.loss_again.value,
                "own_gradients": self.own_gradients.value, "norm_overflow": self.norm_overflow,
                "megatron_job": None if self.megatron_job is None else self.megatron_job.value}

    @classmethod
    def from_json(cls, observed: Mapping[str, Any]) -> "ReplicaObservation":
        """From a record's ``observed`` that ``formats.records`` checked (``is_observation``)."""
        job = observed.get("megatron_job")
        return cls(observed["reproduced"], Seen(observed["loss"]), Seen(observed["loss_again"]),
                   Seen(observed["own_gradients"]), observed["norm_overflow"],
                   None if job is None else Conclusion(job))


SEEN_VALUES = tuple(seen.value for seen in Seen)
MEGATRON_JOB_VALUES = (Conclusion.REPRODUCIBLE.value, Conclusion.TRANSIENT.value)


def is_observation(observed: Any) -> bool:
    """A ``rerun`` record's ``observed`` (version 2): every field there, each of its type."""
    return (isinstance(observed, dict) and isinstance(observed.get("reproduced"), bool)
            and isinstance(observed.get("norm_overflow"), bool)
            and all(observed.get(key) in SEEN_VALUES for key in ("loss", "loss_again", "own_gradients"))
            and observed.get("megatron_job") in (None, *MEGATRON_JOB_VALUES))
