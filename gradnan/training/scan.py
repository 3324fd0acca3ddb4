"""Pure functions over lists of tensors: is everything finite, and where exactly is it not.

Two levels, in the manner of ``torch.nn.utils.clip_grad``:
- ``finite_flag`` / ``nonfinite_indices``: sums. Any NaN or Inf makes a sum non-finite, so there are no
  false negatives; a finite tensor whose sum overflows is a false positive that the exact level clears.
  Tensors that are contiguous views of one storage (Megatron's ``main_grad`` views into the DDP grad
  buffer) are summed as one span, in rows of ``chunk`` elements, not one kernel each. Small CPU tensors
  (under ``PACK_BELOW`` elements, fewer in a small scan) are copied back to back into a reused scratch
  pack and summed in rows: on CPU a kernel per tensor costs more than their bytes. Every other tensor
  (fp16/bf16 main copies, distributed-optimizer shards on a GPU, large separate tensors) by dtype and
  device: one ``torch._foreach_norm`` call per group on CUDA (a fused multi-tensor kernel), a sum each
  on CPU.
- ``locate``: the exact statistics of one tensor (NaN/Inf counts, first bad element, abs max of the
  finite values): one integer pass over the bit pattern finds the rows holding a NaN or an Inf, the
  exact counts only for those, over runs of consecutive bad rows in slices of ``EXACT_SLICE_BYTES``: a
  NaN that spread through every gradient costs a few kernels per tensor, not a few per row (on a GPU,
  kernel launches per row made such a scan of a 1B-parameter model take 40 s).
Temporaries are bounded by the chunk size (``chunk_elements_for``: 1/512 of what is scanned), the
scratch size (``scratch_elements_for``: 4 MiB, at most 1/128 of what is scanned) and, for the exact counts
of bad rows, ``EXACT_SLICE_BYTES``, never the size of the input; results stay on the device until one
host read per level."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

CHUNK_MIN = 1024
CHUNK_MAX = 1 << 22
CHUNKS_PER_SCAN = 512
SCRATCH_BYTES = 1 << 22  # 4 MiB: a scratch buffer this size stays in a CPU's cache
SCRATCH_SHARE = 128  # and is at most 1/128 of what is scanned (the overhead target: under 1% extra memory)
PACK_BELOW = 1 << 15  # elements: a smaller CPU tensor is copied into a pack, a larger one read where it is
PACK_ROW = 1024  # elements summed together in a pack: a bad row suspects the one or two tensors it overlaps
EXACT_SLICE_BYTES = 1 << 24  # 16 MiB of a bad run counted at once (a mask and an abs copy of it at most)

# Row sums over one flat range (a span, a pack), the row length, and which positions ``[low, high)`` covers.
_Rows = Tuple[torch.Tensor, int, Callable[[int, int], List[int]]]
_Pack = Tuple[List[int], List[torch.Tensor], List[int]]  # positions, flat views, numels

# Per float dtype: the integer type of the same width, and the bit pattern of +Inf (exponent all ones).
_BITS = {
    torch.float64: (torch.int64, 0x7FF0_0000_0000_0000),
    torch.float32: (torch.int32, 0x7F80_0000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


def integer_view(tensor: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor's bit patterns as integers of its width, flattened (no copy where it is
    contiguous)."""
    return _flat(tensor).view(_BITS[tensor.dtype][0])


def chunk_elements_for(total_elements: int) -> int:
    return min(CHUNK_MAX, max(CHUNK_MIN, total_elements // CHUNKS_PER_SCAN))


def scratch_elements_for(scanned_elements: int, element_size: int) -> int:
    return min(SCRATCH_BYTES // element_size, scanned_elements // SCRATCH_SHARE)


def _sum(tensor: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """fp16 sums overflow at 65504: accumulate those in fp32. bf16/fp32/fp64 have the range already."""
    kwargs = {"dtype": torch.float32} if tensor.dtype == torch.float16 else {}
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


def _partition(tensors: Sequence[Optional[torch.Tensor]], numels: Sequence[int],
               pack_below: int) -> Tuple[Dict[torch.dtype, _Pack], List[int]]:
    """Non-empty tensors two ways. CPU float tensors under ``pack_below`` elements by dtype, as
    ``(positions, flat views, numels)``: on CPU a kernel per tensor costs more than their bytes, so they
    are copied back to back and summed together (``_packed``). The positions of the others: views of one
    storage summed as spans, the rest checked one by one."""
    packs: Dict[torch.dtype, _Pack] = {}
    others = []
    for index, (tensor, numel) in enumerate(zip(tensors, numels)):
        if not numel:
            continue
        dtype = tensor.dtype
        if numel < pack_below and dtype in _BITS and tensor.is_cpu:
            positions, flats, sizes = packs.setdefault(dtype, ([], [], []))
            positions.append(index)
            flats.append(tensor if tensor.ndim == 1 else tensor.reshape(-1))
            sizes.append(numel)
        else:
            others.append(index)
    return packs, others


def _spans(tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> Tuple[
        List[Tuple[torch.Tensor, List[Tuple[int, int, int]]]], List[int]]:
    """Contiguous views of one storage grouped into one flat span: ``(span, [(index, start, end)])`` with
    offsets inside the span; and the positions of every other tensor, checked one by one."""
    groups: Dict[tuple, List[Tuple[int, int, int]]] = {}
    separate = []
    for index in positions:
        tensor = tensors[index]
        if tensor.is_contiguous():
            offset = tensor.storage_offset()
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


def _separate_flags(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One finite flag per tensor, grouped by dtype and device. On CUDA an L1 norm each (fp16/bf16
    accumulated in fp32) by ``torch._foreach_norm``, one fused pass over a group; on CPU, where that is one
    norm kernel per tensor (4x slower than a sum), a sum each."""
    groups: Dict[tuple, List[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(position)
    flags = torch.empty(len(tensors), dtype=torch.bool, device=device)
    for (dtype, where), positions in groups.items():
        group = [tensors[p] for p in positions]
        wider = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        on_cpu = where.type == "cpu"
        values = [_sum(tensor) for tensor in group] if on_cpu else torch._foreach_norm(group, 1, dtype=wider)
        flags[torch.tensor(positions, device=device)] = torch.isfinite(torch.stack(values)).to(device)
    return flags


def _in_span(members: List[Tuple[int, int, int]], low: int, high: int) -> List[int]:
    """The positions of the span's tensors that overlap its elements ``[low, high)``."""
    return [index for index, start, end in members if start < high and end > low]


def _in_pack(positions: List[int], ends: List[int], base: int, low: int, high: int) -> List[int]:
    """The positions of the packed tensors that overlap the pack's elements ``[low, high)``: tensor ``i``
    ends at ``ends[i] - base``, where tensor ``i + 1`` starts."""
    return positions[bisect_right(ends, base + low):bisect_left(ends, base + high) + 1]


def _packed(positions: List[int], flats: List[torch.Tensor], numels: List[int],
            scanned: int) -> Iterator[_Rows]:
    """Small flat tensors of one dtype copied back to back into one scratch buffer (``scratch_elements_for``
    the ``scanned`` elements; reused pack after pack: on CPU it stays in cache), each pack summed in rows
    of ``PACK_ROW``. Every tensor is under ``_pack_below(scanned)`` elements, so it fits."""
    ends = list(accumulate(numels))
    capacity = scratch_elements_for(scanned, flats[0].element_size())
    scratch = torch.empty(min(capacity, ends[-1]), dtype=flats[0].dtype)
    first, base = 0, 0
    while first < len(positions):
        last = bisect_right(ends, base + capacity, lo=first)
        pack = torch.cat(flats[first:last], out=scratch[:ends[last - 1] - base])
        yield (_row_sums(pack, PACK_ROW), PACK_ROW,
               partial(_in_pack, positions[first:last], ends[first:last], base))
        first, base = last, ends[last - 1]


def _suspects(bad: List[int], rows: List[_Rows], separate: List[int]) -> set:
    """The positions named by the non-finite flags ``bad``, numbered over every row of ``rows`` in turn,
    then one per ``separate`` tensor."""
    row_ends = list(accumulate(len(sums) for sums, _, _ in rows))
    suspects = set()
    for flag in bad:
        which = bisect_right(row_ends, flag)
        if which == len(rows):
            suspects.add(separate[flag - (row_ends[-1] if rows else 0)])
            continue
        _, length, covering = rows[which]
        row = flag - (row_ends[which - 1] if which else 0)
        suspects.update(covering(row * length, (row + 1) * length))
    return suspects


def _pack_below(scanned: int) -> int:
    """Tensors under this many elements are packed: ``PACK_BELOW``, less where the scratch is smaller."""
    return min(PACK_BELOW, scratch_elements_for(scanned, max(dtype.itemsize for dtype in _BITS)))


@torch.no_grad()
def nonfinite_indices(tensors: Sequence[Optional[torch.Tensor]], chunk: Optional[int] = None) -> List[int]:
    """Positions of the tensors that may hold a NaN/Inf (``locate`` confirms). One host read in all."""
    numels = [0 if tensor is None else tensor.numel() for tensor in tensors]
    scanned = sum(numels)
    packed, others = _partition(tensors, numels, _pack_below(scanned))
    shared, separate = _spans(tensors, others)
    chunk = chunk or chunk_elements_for(sum(span.numel() for span, _ in shared))
    rows: List[_Rows] = [(_row_sums(span, chunk), chunk, partial(_in_span, members))
                         for span, members in shared]
    for group in packed.values():
        rows.extend(_packed(*group, scanned))
    if not rows and not separate:
        return []
    device = rows[0][0].device if rows else tensors[separate[0]].device
    flags = [torch.isfinite(sums.to(device, torch.float32)) for sums, _, _ in rows]
    if separate:
        flags.append(_separate_flags([tensors[i] for i in separate], device))
    bad = torch.nonzero(~torch.cat(flags).cpu()).flatten().tolist()  # the flags read once, then found here
    suspects = _suspects(bad, rows, separate)
    if len(suspects) <= 1:
        return sorted(suspects)
    candidates = sorted(suspects)  # several tensors shared a bad row: one more read tells them apart
    flags = torch.stack([finite_flag(tensors[i]).to(device) for i in candidates]).tolist()
    return [index for index, ok in zip(candidates, flags) if not ok]


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


def _slice_stats(row: torch.Tensor, offset: int) -> torch.Tensor:
    """NaN, +Inf, -Inf counts, first bad flat index (or a huge value) and finite abs max of one 1-D slice
    that starts at flat index ``offset``."""
    finite = torch.isfinite(row)
    bad = ~finite
    first = torch.where(bad.any(), bad.to(torch.uint8).argmax() + offset, torch.iinfo(torch.int64).max)
    return torch.stack([
        torch.isnan(row).sum().to(torch.float64),
        torch.isposinf(row).sum().to(torch.float64),
        torch.isneginf(row).sum().to(torch.float64),
        first.to(torch.float64),
        torch.where(finite, row.abs(), 0).amax().to(torch.float64),
    ])


def _rows(flat: torch.Tensor, chunk: int) -> List[torch.Tensor]:
    """The tensor as at most two 2-D views: full ``chunk``-element rows, and the shorter last row."""
    full = flat.numel() // chunk
    views = [flat[: full * chunk].view(full, chunk)] if full else []
    if flat.numel() > full * chunk:
        views.append(flat[full * chunk:].view(1, -1))
    return views


def _bad_slices(flat: torch.Tensor, chunk: int, bad_rows: List[int]) -> Iterator[Tuple[torch.Tensor, int]]:
    """``(slice, its first flat index)`` covering exactly the bad rows: runs of consecutive bad rows, each
    cut into slices of at most ``EXACT_SLICE_BYTES`` (and never less than one row)."""
    step = max(chunk, EXACT_SLICE_BYTES // flat.element_size())
    runs: List[List[int]] = []
    for row in bad_rows:
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    for first_row, end_row in runs:
        end = min(end_row * chunk, flat.numel())
        for start in range(first_row * chunk, end, step):
            yield flat[start:min(start + step, end)], start


def _abs_bits_row_maxima(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per ``chunk``-element row, the largest bit pattern with the sign bit cleared: one integer pass.

    The sign bit cleared, IEEE floats order as integers do: a row holds a NaN or an Inf exactly when its
    maximum is at least +Inf's pattern, and a finite row's maximum is the pattern of its largest magnitude.
    The cleared bits go to a scratch buffer of whole rows, at most ``scratch_elements_for`` the tensor (one
    row when a row is larger), reused block after block: it stays in cache on CPU and never grows with the
    tensor."""
    bits = flat.view(_BITS[flat.dtype][0])
    rows_per_block = max(1, scratch_elements_for(flat.numel(), flat.element_size()) // chunk)
    scratch = torch.empty(min(rows_per_block * chunk, flat.numel()), dtype=bits.dtype, device=bits.device)
    sign_cleared = torch.iinfo(bits.dtype).max
    maxima = []
    for view in _rows(bits, chunk):
        for first in range(0, view.shape[0], rows_per_block):
            block = view[first:first + rows_per_block]
            cleared = torch.bitwise_and(block, sign_cleared, out=scratch[:block.numel()].view(block.shape))
            maxima.append(cleared.amax(dim=1))
    return torch.cat(maxima)


def locate(tensor: torch.Tensor, chunk_elements: Optional[int] = None) -> Optional[NonFinite]:
    """Exact NaN/Inf statistics of ``tensor``, or None when every element is finite.

    One integer pass finds the rows that hold a NaN or an Inf and the finite rows' abs max
    (``_abs_bits_row_maxima``); the exact counts only for the rows that hold one. Two host reads (one for a
    tensor of at most one row). Integer tensors hold neither: None."""
    flat = _flat(tensor)
    if flat.numel() == 0 or not (flat.is_floating_point() or flat.is_complex()):
        return None
    if flat.dtype not in _BITS:
        raise TypeError(f"locate: no NaN/Inf scan for {flat.dtype} (only {', '.join(map(str, _BITS))})")
    chunk = chunk_elements or chunk_elements_for(flat.numel())
    if flat.numel() <= chunk:
        nan, pos_inf, neg_inf, first_bad, abs_max_finite = _slice_stats(flat, 0).tolist()
        if nan + pos_inf + neg_inf == 0:
            return None
        return NonFinite(int(nan), int(pos_inf), int(neg_inf), int(first_bad), abs_max_finite)
    maxima = _abs_bits_row_maxima(flat, chunk)
    finite = maxima < _BITS[flat.dtype][1]
    good_abs_max = torch.where(finite, maxima, 0).amax().view(flat.dtype).to(torch.float64)
    bad_rows = [row for row, ok in enumerate(finite.tolist()) if not ok]
    if not bad_rows:
        return None
    stats = torch.stack([_slice_stats(piece, start) for piece, start in _bad_slices(flat, chunk, bad_rows)])
    summary = torch.cat([stats[:, :3].sum(dim=0), stats[:, 3:4].amin(dim=0),
                         torch.maximum(stats[:, 4].amax(), good_abs_max).reshape(1)])
    nan, pos_inf, neg_inf, first_bad, abs_max_finite = summary.tolist()
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
