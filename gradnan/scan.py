"""Pure functions over lists of tensors: is everything finite, and where exactly is it not.

Two levels, in the manner of ``torch.nn.utils.clip_grad``:
- ``finite_flag`` / ``nonfinite_indices``: a float32-accumulated sum per tensor. Any NaN or Inf makes
  the sum non-finite, so there are no false negatives; a finite tensor whose sum overflows is a false
  positive that the exact scan below clears. No temporary as large as the input.
- ``locate``: the exact, chunked scan of one tensor (NaN/Inf counts, first bad element, abs max of
  the finite values), run only where the flag tripped. All its per-chunk results stay on the device
  until one host read at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

CHUNK_ELEMENTS = 1 << 22


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensor's device: False if any element is NaN or +-Inf. No host sync."""
    return torch.isfinite(tensor.sum(dtype=_accumulation_dtype(tensor)))


def nonfinite_indices(tensors: Sequence[Optional[torch.Tensor]]) -> List[int]:
    """Positions of the tensors that may hold a NaN/Inf (exact scan to confirm). One host sync in all."""
    present = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel() > 0]
    if not present:
        return []
    flags = torch.stack([finite_flag(t).to(present[0][1].device) for _, t in present])
    return [i for (i, _), finite in zip(present, flags.tolist()) if not finite]


@dataclass(frozen=True)
class NonFinite:
    """What the exact scan found in one tensor (flat indices into that tensor)."""

    nan: int
    pos_inf: int
    neg_inf: int
    first_bad: int
    abs_max_finite: float

    @property
    def inf(self) -> int:
        return self.pos_inf + self.neg_inf

    @property
    def kind(self) -> str:
        if self.nan and self.inf:
            return "nan+inf"
        return "nan" if self.nan else "inf"


def locate(tensor: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> Optional[NonFinite]:
    """Exact NaN/Inf statistics of ``tensor``, or None when every element is finite."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return None
    per_chunk = []
    for start in range(0, flat.numel(), chunk_elements):
        chunk = flat[start:start + chunk_elements]
        finite = torch.isfinite(chunk)
        bad = ~finite
        first = torch.where(bad.any(), bad.to(torch.uint8).argmax() + start, flat.numel())
        per_chunk.append(
            torch.stack(
                [
                    torch.isnan(chunk).sum().to(torch.float64),
                    torch.isposinf(chunk).sum().to(torch.float64),
                    torch.isneginf(chunk).sum().to(torch.float64),
                    first.to(torch.float64),
                    torch.where(finite, chunk.abs(), 0).amax().to(torch.float64),
                ]
            )
        )
    totals = torch.stack(per_chunk)
    summary = torch.cat([totals[:, :3].sum(dim=0), totals[:, 3:4].amin(dim=0), totals[:, 4:].amax(dim=0)])
    nan, pos_inf, neg_inf, first_bad, abs_max_finite = summary.tolist()
    if nan + pos_inf + neg_inf == 0:
        return None
    return NonFinite(int(nan), int(pos_inf), int(neg_inf), int(first_bad), abs_max_finite)


def find_nonfinite(tensors: Sequence[Optional[torch.Tensor]]) -> List[Tuple[int, NonFinite]]:
    """``(position, NonFinite)`` for every tensor that holds a NaN or Inf, in input order."""
    found = []
    for index in nonfinite_indices(tensors):
        result = locate(tensors[index])
        if result is not None:
            found.append((index, result))
    return found


def unravel(flat_index: int, shape: Sequence[int]) -> List[int]:
    """Flat (row-major) index -> multi-dimensional index for ``shape``."""
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size) if size else (flat_index, 0)
        index.append(rest)
    return list(reversed(index))
