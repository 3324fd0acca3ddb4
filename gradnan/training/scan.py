"""Pure functions over lists of tensors: is everything finite, and where exactly is it not.

Two levels, in the manner of ``torch.nn.utils.clip_grad``:
- ``finite_flag`` / ``nonfinite_indices``: sums and largest magnitudes. Any NaN or Inf makes either
  non-finite, so there are no false negatives. Tensors that are contiguous views of one storage
  (Megatron's ``main_grad`` views into the DDP grad buffer) are summed as one span, in rows of ``chunk``
  elements, not one kernel each (a finite row whose sum overflows is a false positive that the exact level
  clears). Every other tensor (weights, fp16/bf16 main copies, optimizer state, distributed-optimizer
  shards) by dtype and device: one ``torch._foreach_norm(..., inf)`` call per group, a fused multi-tensor
  kernel on CUDA (on CPU it runs one kernel per tensor inside the one call). A tensor of another dtype
  (integers, bool, float8) holds no NaN this scan can see and is not checked.
- ``locate_all`` / ``locate``: the exact statistics of the tensors the first level suspects (NaN/Inf
  counts, first bad element, abs max of the finite values), all of them together: read as flat runs (a
  grad buffer's views where they are), cut or packed into slices of ``EXACT_SLICE_ELEMENTS``, each slice
  counted per tensor by a few segmented reductions. A NaN that spread through every gradient costs a dozen
  kernels per slice, not a few per tensor (on a GPU, kernel launches per tensor and per row made the
  failing step of a 1B-parameter model cost 27 forward passes).
Temporaries are bounded by the chunk size (``chunk_elements_for``: 1/512 of what is scanned) and, for the
exact counts, one slice (about 30 bytes an element), never the size of the input; results stay on the
device until one host read per level."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

CHUNK_MIN = 1024
CHUNK_MAX = 1 << 22
CHUNKS_PER_SCAN = 512
EXACT_SLICE_ELEMENTS = 1 << 22  # elements counted exactly at once (about 30 bytes of temporaries each)
SERIAL_ELEMENTS = 512  # the longest run of elements one segmented reduction's thread reads (``_segmented``)

# Row sums over one span, the row length, and which positions its elements ``[low, high)`` cover.
_Rows = Tuple[torch.Tensor, int, Callable[[int, int], List[int]]]

# Per float dtype: the integer type of the same width, and the bit pattern of +Inf (exponent all ones).
_BITS = {
    torch.float64: (torch.int64, 0x7FF0_0000_0000_0000),
    torch.float32: (torch.int32, 0x7F80_0000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


SCANNED_DTYPES = tuple(_BITS)  # the floating-point dtypes whose NaN and Inf this scan sees


def integer_view(tensor: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor's bit patterns as integers of its width, in its shape (no copy)."""
    return tensor.view(_BITS[tensor.dtype][0])


def chunk_elements_for(total_elements: int) -> int:
    return min(CHUNK_MAX, max(CHUNK_MIN, total_elements // CHUNKS_PER_SCAN))


def _sum(tensor: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """fp16 sums overflow at 65504: accumulate those in fp32. bf16/fp32/fp64 have the range already."""
    kwargs: Dict[str, Any] = {"dtype": torch.float32} if tensor.dtype == torch.float16 else {}
    return tensor.sum(**kwargs) if dim is None else tensor.sum(dim=dim, **kwargs)


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensor's device: False if any element is NaN or +-Inf. No host sync."""
    return torch.isfinite(_sum(tensor))


def abs_max(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 tensor on the tensor's device: its largest magnitude, NaN or Inf where it holds one
    (``aminmax`` propagates both). One pass, no temporary the size of the tensor, no host sync: the same
    read as ``finite_flag``, and it also tells a finite value whose square overflows a float32 norm."""
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    return torch.maximum(low.abs(), high.abs()).to(torch.float32)


def _row_sums(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of each ``chunk``-element row of a 1-D tensor (the last row may be shorter)."""
    if flat.numel() <= chunk:
        return _sum(flat).reshape(1)
    sums = [_sum(view, dim=1) for view in _rows(flat, chunk)]
    return torch.cat(sums) if len(sums) > 1 else sums[0]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def _spans(tensors: Mapping[int, torch.Tensor], positions: Sequence[int]) -> Tuple[
        List[Tuple[torch.Tensor, List[Tuple[int, int, int]]]], List[int]]:
    """Contiguous views of one storage grouped into one flat span: ``(span, [(index, start, end)])`` with
    offsets inside the span; and the positions of every other tensor, checked one by one."""
    groups: Dict[tuple, List[Tuple[int, int, int]]] = {}
    separate = []
    for index in positions:
        tensor = tensors[index]
        if tensor.is_contiguous():
            offset = int(tensor.storage_offset())
            key = (tensor.data_ptr() - offset * tensor.element_size(), tensor.dtype, tensor.device)
            groups.setdefault(key, []).append((index, offset, offset + tensor.numel()))
        else:
            separate.append(index)
    spans = []
    for members in groups.values():
        if len(members) == 1:
            separate.append(members[0][0])
            continue
        first = tensors[members[0][0]]
        low = min(start for _, start, _ in members)
        high = max(end for _, _, end in members)
        span = first.new_empty(0).set_(first.untyped_storage(), low, (high - low,), (1,)).detach()
        spans.append((span, [(index, start - low, end - low) for index, start, end in members]))
    return spans, sorted(separate)


def _separate_flags(tensors: Sequence[torch.Tensor],
                    device: torch.device) -> Tuple[List[torch.Tensor], List[int]]:
    """One finite flag per tensor, a flags tensor per group, and the order they come in (positions in
    ``tensors``): grouped by dtype and device, each group's largest magnitudes by one
    ``torch._foreach_norm(..., inf)`` (NaN and Inf carry through, a finite tensor's is finite: no false
    positives)."""
    groups: Dict[tuple, List[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(position)
    flags, order = [], []
    for positions in groups.values():
        largest = torch._foreach_norm([tensors[p] for p in positions], math.inf)
        flags.append(torch.isfinite(torch.stack(largest)).to(device))
        order += positions
    return flags, order


def _in_span(members: List[Tuple[int, int, int]], low: int, high: int) -> List[int]:
    """The positions of the span's tensors that overlap its elements ``[low, high)``."""
    return [index for index, start, end in members if start < high and end > low]


def _suspects(bad: List[int], rows: List[_Rows], separate: List[int]) -> Tuple[List[int], List[int]]:
    """The positions named by the non-finite flags ``bad``, numbered over every row of ``rows`` in turn,
    then one per ``separate`` tensor: (those of the rows, which may share a row with a bad neighbour or
    overflow their sum; those of the separate tensors, which hold a NaN/Inf), each sorted."""
    row_ends = list(accumulate(len(sums) for sums, _, _ in rows))
    in_rows, held = set(), set()
    for flag in bad:
        which = bisect_right(row_ends, flag)
        if which == len(rows):
            held.add(separate[flag - (row_ends[-1] if rows else 0)])
            continue
        _, length, covering = rows[which]
        row = flag - (row_ends[which - 1] if which else 0)
        in_rows.update(covering(row * length, (row + 1) * length))
    return sorted(in_rows), sorted(held)


@torch.no_grad()
def nonfinite_indices(tensors: Sequence[Optional[torch.Tensor]], chunk: Optional[int] = None) -> List[int]:
    """Positions of the tensors that may hold a NaN/Inf (``locate`` confirms). One host read, and one more
    where several views of one storage shared a bad row."""
    present = _present(tensors)
    in_rows, held = _suspect_indices(present, chunk)
    if len(in_rows) > 1:  # several tensors shared a bad row: one more read tells them apart
        device = present[in_rows[0]].device
        flags = torch.stack([finite_flag(present[i]).to(device) for i in in_rows]).tolist()
        in_rows = [index for index, ok in zip(in_rows, flags) if not ok]
    return sorted(in_rows + held)


def _present(tensors: Sequence[Optional[torch.Tensor]]) -> Dict[int, torch.Tensor]:
    """The tensors the first level checks, by position (in order): not None, not empty, of a scanned
    dtype."""
    return {index: tensor for index, tensor in enumerate(tensors)
            if tensor is not None and tensor.numel() and tensor.dtype in _BITS}


@torch.no_grad()
def _suspect_indices(present: Dict[int, torch.Tensor],
                     chunk: Optional[int]) -> Tuple[List[int], List[int]]:
    """Every tensor of ``present`` (``_present``) holding a NaN/Inf, as the positions of views in a span's
    row whose sum is not finite (possibly finite neighbours that share its row, or whose sum overflows),
    and those of separate tensors whose largest magnitude is not (exactly the bad ones). One host read."""
    shared, separate = _spans(present, list(present))
    chunk = chunk or chunk_elements_for(sum(span.numel() for span, _ in shared))
    rows: List[_Rows] = [(_row_sums(span, chunk), chunk, partial(_in_span, members))
                         for span, members in shared]
    if not rows and not separate:
        return [], []
    device = rows[0][0].device if rows else present[separate[0]].device
    flags = [torch.isfinite(sums.to(device, torch.float32)) for sums, _, _ in rows]
    if separate:
        separate_flags, order = _separate_flags([present[i] for i in separate], device)
        flags += separate_flags
        separate = [separate[i] for i in order]
    bad = torch.nonzero(~torch.cat(flags).cpu()).flatten().tolist()  # the flags read once, then found here
    return _suspects(bad, rows, separate)


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


def _rows(flat: torch.Tensor, chunk: int) -> List[torch.Tensor]:
    """The tensor as at most two 2-D views: full ``chunk``-element rows, and the shorter last row."""
    full = flat.numel() // chunk
    views = [flat[: full * chunk].view(full, chunk)] if full else []
    if flat.numel() > full * chunk:
        views.append(flat[full * chunk:].view(1, -1))
    return views


@dataclass(frozen=True)
class _Segment:
    """Consecutive elements of a slice that belong to one tensor: its ``position`` (None: a gap between two
    tensors of one storage, counted and ignored), the flat index in it of the first, and how many."""

    position: Optional[int]
    first: int
    length: int


_Run = Tuple[torch.Tensor, List[_Segment]]  # flat elements, and the segments they are made of, in order


def _runs(tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> List[_Run]:
    """The tensors at ``positions`` as flat runs, read where they are: contiguous views that follow one
    another in one storage (a DDP grad buffer's parameters) as one run, the gaps of at most ``CHUNK_MIN``
    elements between them as ignored segments; every other tensor a run of its own (copied flat where it
    is not contiguous)."""
    runs: List[_Run] = []
    in_storage: Dict[tuple, List[Tuple[int, int, int]]] = {}
    for position in positions:
        tensor = tensors[position]
        if tensor.is_contiguous():
            offset = int(tensor.storage_offset())
            key = (tensor.data_ptr() - offset * tensor.element_size(), tensor.dtype, tensor.device)
            in_storage.setdefault(key, []).append((offset, offset + tensor.numel(), position))
        else:
            runs.append((_flat(tensor), [_Segment(position, 0, tensor.numel())]))
    for members in in_storage.values():
        members.sort()
        group = [members[0]]
        for member in members[1:]:
            if 0 <= member[0] - group[-1][1] <= CHUNK_MIN:
                group.append(member)
                continue
            runs.append(_run(tensors, group))
            group = [member]
        runs.append(_run(tensors, group))
    return runs


def _run(tensors: Sequence[torch.Tensor], group: List[Tuple[int, int, int]]) -> _Run:
    """One run over the storage range ``group`` covers (``(start, end, position)`` in storage order)."""
    first = tensors[group[0][2]]
    low, high = group[0][0], group[-1][1]
    span = first.new_empty(0).set_(first.untyped_storage(), low, (high - low,), (1,)).detach()
    segments, at = [], low
    for start, end, position in group:
        if start > at:
            segments.append(_Segment(None, 0, start - at))
        segments.append(_Segment(position, 0, end - start))
        at = end
    return span, segments


def _cut(run: _Run, capacity: int) -> Iterator[_Run]:
    """A run in slices of ``capacity`` elements where it is (no copy), its segments split at the cuts."""
    flat, segments = run
    starts = list(accumulate((segment.length for segment in segments), initial=0))
    for low in range(0, flat.numel(), capacity):
        high = min(low + capacity, flat.numel())
        pieces = []
        for index in range(bisect_right(starts, low) - 1, bisect_left(starts, high)):
            segment, start = segments[index], starts[index]
            begin, end = max(low, start), min(high, start + segment.length)
            pieces.append(_Segment(segment.position, segment.first + begin - start, end - begin))
        yield flat[low:high], pieces


def _slices(runs: List[_Run], capacity: int) -> Iterator[_Run]:
    """Slices of at most ``capacity`` elements: a longer run cut where it is, shorter runs copied back to
    back into one slice (a kernel per tensor would cost more than its bytes)."""
    pending: List[_Run] = []
    filled = 0
    for run in runs:
        if run[0].numel() > capacity:
            yield from _cut(run, capacity)
            continue
        if pending and filled + run[0].numel() > capacity:
            yield _joined(pending)
            pending, filled = [], 0
        pending.append(run)
        filled += run[0].numel()
    if pending:
        yield _joined(pending)


def _joined(runs: List[_Run]) -> _Run:
    if len(runs) == 1:
        return runs[0]
    return torch.cat([flat for flat, _ in runs]), [segment for _, segments in runs for segment in segments]


def _pieces(lengths: List[int], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each segment cut into pieces of at most ``SERIAL_ELEMENTS``: the pieces' lengths, and how many pieces
    each segment has (every length is positive)."""
    counts = [-(-length // SERIAL_ELEMENTS) for length in lengths]
    pieces = torch.full((sum(counts),), SERIAL_ELEMENTS, dtype=torch.long, device=device)
    last = torch.tensor([end - 1 for end in accumulate(counts)], device=device)
    tails = [length - (count - 1) * SERIAL_ELEMENTS for length, count in zip(lengths, counts)]
    pieces[last] = torch.tensor(tails, device=device)
    return pieces, torch.tensor(counts, device=device)


def _segmented(values: torch.Tensor, reduce: str, pieces: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``torch.segment_reduce`` of a 1-D tensor per segment, in two stages: over the segments' pieces, then
    over each segment's pieces' results. On CUDA one thread reduces a segment serially: a slice counted as
    one segment of 2**22 elements took 278 ms on an H100 ([n, 3] input), in pieces of 512 under 0.2 ms."""
    lengths, counts = pieces
    return torch.segment_reduce(torch.segment_reduce(values, reduce, lengths=lengths), reduce, lengths=counts)


def _slice_stats(flat: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """Per segment of a 1-D slice (``lengths`` elements each, back to back): NaN, +Inf and -Inf counts, the
    index in the slice of its first non-finite element (inf: none) and its largest finite magnitude; one
    row per segment (float64 for float64 input). float32 counts and indices are exact: a slice holds at
    most 2**24 elements."""
    pieces = _pieces(lengths, flat.device)
    finite = torch.isfinite(flat)
    counts = [_segmented(kind(flat).to(torch.float32), "sum", pieces)
              for kind in (torch.isnan, torch.isposinf, torch.isneginf)]
    index = torch.arange(flat.numel(), dtype=torch.float32, device=flat.device)
    first = _segmented(torch.where(finite, math.inf, index), "min", pieces)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32  # every magnitude exact
    largest = _segmented(torch.where(finite, flat.abs(), 0).to(wide), "max", pieces)
    return torch.stack([*(count.to(wide) for count in counts), first.to(wide), largest], dim=1)


@torch.no_grad()
def locate_all(tensors: Sequence[torch.Tensor],
               chunk_elements: Optional[int] = None) -> List[Optional[NonFinite]]:
    """``locate`` of each tensor, in a few kernels for them all: grouped by dtype and device, read as flat
    runs (``_runs``: a grad buffer's views where they are), cut or packed into slices of ``chunk_elements``
    (``EXACT_SLICE_ELEMENTS``, at most 2**24), each slice counted per tensor by segmented reductions
    (``_slice_stats``): a NaN that spread through every gradient costs a dozen kernels per slice, not a
    few per tensor or per row. Temporaries: about 30 bytes per element of one slice. One host read."""
    capacity = min(chunk_elements or EXACT_SLICE_ELEMENTS, 1 << 24)
    groups: Dict[tuple, List[int]] = {}
    for position, tensor in enumerate(tensors):
        if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        if tensor.dtype not in _BITS:
            raise TypeError(f"locate: no NaN/Inf scan for {tensor.dtype} (only {', '.join(map(str, _BITS))})")
        groups.setdefault((tensor.dtype, tensor.device), []).append(position)
    stats: Dict[torch.device, List[torch.Tensor]] = {}
    slices: List[List[_Segment]] = []
    for (_, device), positions in groups.items():
        for flat, segments in _slices(_runs(tensors, positions), capacity):
            stats.setdefault(device, []).append(_slice_stats(flat, [segment.length for segment in segments]))
            slices.append(segments)
    rows = iter([row for values in stats.values() for row in torch.cat(values).tolist()])
    totals: Dict[int, List[float]] = {}
    for segments in slices:
        start = 0
        for segment, (nan, pos_inf, neg_inf, first, largest) in zip(segments, rows):
            if segment.position is not None:
                total = totals.setdefault(segment.position, [0.0, 0.0, 0.0, math.inf, 0.0])
                total[:3] = [total[0] + nan, total[1] + pos_inf, total[2] + neg_inf]
                total[3] = min(total[3], first - start + segment.first)
                total[4] = max(total[4], largest)
            start += segment.length
    return [_found(totals.get(position)) for position in range(len(tensors))]


def _found(total: Optional[List[float]]) -> Optional[NonFinite]:
    if total is None or not total[0] + total[1] + total[2]:
        return None
    nan, pos_inf, neg_inf, first_bad, abs_max_finite = total
    return NonFinite(int(nan), int(pos_inf), int(neg_inf), int(first_bad), abs_max_finite)


def locate(tensor: torch.Tensor, chunk_elements: Optional[int] = None) -> Optional[NonFinite]:
    """Exact NaN/Inf statistics of ``tensor`` (counted ``chunk_elements`` at a time), or None when every
    element is finite. Integer tensors hold neither: None."""
    return locate_all([tensor], chunk_elements)[0]


def find_nonfinite(tensors: Sequence[Optional[torch.Tensor]]) -> List[Tuple[int, NonFinite]]:
    """``(position, NonFinite)`` for every tensor that holds a NaN or Inf, in input order: the suspects of
    the cheap level counted exactly together (``locate_all``). Two host reads."""
    present = _present(tensors)
    in_rows, held = _suspect_indices(present, None)
    suspects = sorted(in_rows + held)
    found = locate_all([present[index] for index in suspects]) if suspects else []
    return [(index, result) for index, result in zip(suspects, found) if result is not None]


def unravel(flat_index: int, shape: Sequence[int]) -> List[int]:
    """Flat (row-major) index -> multi-dimensional index for ``shape``."""
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size) if size else (flat_index, 0)
        index.append(rest)
    return list(reversed(index))
