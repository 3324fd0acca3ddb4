"""The pipeline's links as this stage saw them in the step: for each direction (the activations it sent
to the next stage and received from the previous one, the gradients it sent to the previous stage and
received from the next one) the largest magnitude of every tensor that went through, in order, left on the
device. Nothing is read on a healthy step; an incident record reads them all at once (``read``): how many
transfers each direction made and the first whose tensor was non-finite. A stage's n-th transfer to a
neighbour is that neighbour's n-th from it, so the report can tell a link that corrupted a finite tensor
from a sender whose own tensor was already bad.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..events import PipelineTransfer
from ..formats.records import LINK_DIRECTIONS
from .scan import abs_max


class PipelineLinks:
    """The step's per-transfer maxima by direction (None: received before its transfer finished, not
    readable here); dropped when the step count moves on."""

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._of_step: Optional[int] = None
        self._maxima: Dict[str, List[Optional[torch.Tensor]]] = {}

    def observe(self, transfer: PipelineTransfer) -> None:
        step = self._step()
        if step != self._of_step:
            self._of_step, self._maxima = step, {}
        with torch.no_grad():
            for direction in LINK_DIRECTIONS:
                tensor = getattr(transfer, direction)
                if tensor is not None:
                    unreadable = direction.startswith("received") and not transfer.complete
                    self._maxima.setdefault(direction, []).append(None if unreadable else abs_max(tensor))

    def read(self) -> Optional[Dict[str, Any]]:
        """This step's transfers per direction that carried any (one host read, at an incident only): their
        count, the first non-finite one's position (None: none seen), how many could not be read; None
        where this stage made no transfer in the step (no pipeline)."""
        if self._of_step != self._step() or not self._maxima:
            return None
        # read in LINK_DIRECTIONS' order, the order the findings are handed out below
        kept = [value for direction in LINK_DIRECTIONS for value in self._maxima.get(direction, ())
                if value is not None]
        finite = iter(torch.isfinite(torch.stack(kept)).tolist() if kept else [])
        found: Dict[str, Dict[str, Optional[int]]] = {}
        for direction in LINK_DIRECTIONS:
            values = self._maxima.get(direction)
            if values is None:
                continue
            seen = [None if value is None else next(finite) for value in values]
            first = next((position for position, ok in enumerate(seen) if ok is False), None)
            found[direction] = {"transfers": len(seen), "first_nonfinite": first,
                                "unchecked": seen.count(None)}
        return found
