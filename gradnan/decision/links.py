"""The pipeline's links at the failing step, from each stage's ``pipeline_links`` (its incident record):
a stage's n-th transfer to a neighbour in one direction is that neighbour's n-th from it in the same
direction (point-to-point messages between two ranks arrive in the order they were sent), so each
receiver's first non-finite tensor is set against what its sender sent at that position. Under the
interleaved schedule a corrupted value goes on around the ring of model chunks and comes back through the
sender: its later sends are non-finite too, and only the position tells the link from the sender. Pure: no
torch, no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

# what travels each way, and the stage it comes from relative to the receiver
_FROM = {"forward": -1, "backward": +1}
_WHAT = {"forward": "activation", "backward": "gradient"}


@dataclass(frozen=True)
class LinkFinding:
    """A receiver's first non-finite tensor from its neighbour, at position ``transfer`` of the step's
    transfers that way, and what the sender sent at that position: ``sent`` "finite" (there and before:
    the link made it), "nonfinite" (there or before: the sender's own), None (not observed: no record of
    the sender says)."""

    direction: str  # "forward": an activation; "backward": its gradient
    receiver: int
    receiver_stage: int
    sender: Optional[int]
    sender_stage: int
    transfer: int
    sent: Optional[str]

    @property
    def what(self) -> str:
        return _WHAT[self.direction]

    def link(self) -> str:
        return f"pp{self.sender_stage} -> pp{self.receiver_stage}"


def _peer_key(rank: Mapping[str, Any]) -> Tuple[Any, ...]:
    return tuple(rank.get(axis) for axis in ("tp", "dp", "cp"))


def link_findings(records: Sequence[Mapping[str, Any]]) -> Tuple[LinkFinding, ...]:
    """Every receiver's first non-finite tensor per direction, set against its sender's (``records``: the
    failing step's incident records; the first of each rank that carries ``pipeline_links``)."""
    links: Dict[int, Tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for record in records:
        rank = record["rank"]
        if isinstance(record.get("pipeline_links"), dict) and rank.get("global_rank") not in links:
            links[rank["global_rank"]] = (rank, record["pipeline_links"])
    by_place = {(_peer_key(rank), rank.get("pp")): (global_rank, seen)
                for global_rank, (rank, seen) in links.items()}
    found = []
    for global_rank, (rank, seen) in sorted(links.items()):
        stages, stage = rank.get("pp_size"), rank.get("pp")
        for direction, step in _FROM.items():
            first = (seen.get(f"received_{direction}") or {}).get("first_nonfinite")
            if first is None or not isinstance(stages, int) or not isinstance(stage, int):
                continue
            sender_stage = (stage + step) % stages
            sender, sender_seen = by_place.get((_peer_key(rank), sender_stage), (None, {}))
            sent_info = sender_seen.get(f"sent_{direction}")
            sent = None
            if isinstance(sent_info, dict) and sent_info["transfers"] > first:
                bad = sent_info.get("first_nonfinite")
                sent = "nonfinite" if bad is not None and bad <= first else "finite"
            found.append(LinkFinding(direction, global_rank, stage, sender, sender_stage, first, sent))
    return tuple(found)
