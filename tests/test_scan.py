"""The cheap finite check, the exact chunked scan, and flat -> multi-dimensional indices."""

from __future__ import annotations

import math

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradnan.testing.measure import OperatorCounter
from gradnan.training import scan
from gradnan.training.scan import (
    EXACT_SLICE_ELEMENTS,
    SERIAL_ELEMENTS,
    NonFinite,
    find_nonfinite,
    finite_flag,
    locate,
    locate_all,
    nonfinite_indices,
    unravel,
)

NAN = float("nan")
INF = float("inf")
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def tensor_with(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# --- finite_flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_finite_flag_true_for_finite_tensor(dtype):
    flag = finite_flag(tensor_with([1.0, -2.0, 0.5], dtype))
    assert flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag) is True


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_finite_flag_false_for_any_nonfinite(dtype, bad):
    assert bool(finite_flag(tensor_with([1.0, bad, 3.0], dtype))) is False


def test_finite_flag_false_when_plus_and_minus_inf_cancel():
    """inf + (-inf) is NaN, so opposite infinities cannot hide each other in the sum."""
    assert bool(finite_flag(tensor_with([INF, -INF]))) is False


def test_finite_flag_accumulates_fp16_in_float32():
    """Eight fp16 maxima sum to ~5e5, over fp16's range but fine in the float32 accumulator."""
    assert bool(finite_flag(torch.full((8,), 65504.0, dtype=torch.float16))) is True


def test_finite_flag_accumulates_float64_in_float64():
    """1e300 is not representable in float32; a float32 accumulator would report it as Inf."""
    assert bool(finite_flag(tensor_with([1e300, 1e300], torch.float64))) is True


# --- nonfinite_indices ------------------------------------------------------------------------


def test_nonfinite_indices_skips_none_and_empty_tensors():
    tensors = [
        None,
        torch.empty(0),
        tensor_with([1.0, 2.0]),
        tensor_with([NAN]),
        None,
        torch.empty(0, 3),
        tensor_with([[0.0], [-INF]]),
    ]
    assert nonfinite_indices(tensors) == [3, 6]


def test_nonfinite_indices_nothing_to_check():
    assert nonfinite_indices([]) == []
    assert nonfinite_indices([None, torch.empty(0)]) == []


def test_nonfinite_indices_all_finite():
    assert nonfinite_indices([tensor_with([1.0]), tensor_with([2.0], torch.bfloat16)]) == []


def test_nonfinite_indices_mixed_dtypes():
    tensors = [
        tensor_with([INF], torch.float16),
        tensor_with([1.0], torch.float64),
        tensor_with([NAN], torch.bfloat16),
    ]
    assert nonfinite_indices(tensors) == [0, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_overflowing_sum_is_flagged_then_cleared_by_the_exact_scan(dtype):
    """3e38 is finite in bf16/fp32 but two of them overflow the float32 accumulator: the row sum of a
    grad buffer's views over-reports (allowed), the exact scan must clear it (no false positive in the
    result). A separate tensor's largest magnitude never over-reports."""
    buffer = torch.full((4,), 3e38, dtype=dtype)
    views = [buffer[:2], buffer[2:]]
    assert torch.isfinite(buffer).all()
    assert nonfinite_indices(views) == [0, 1]
    assert find_nonfinite(views) == []
    assert nonfinite_indices([buffer.clone()]) == []


# --- find_nonfinite ---------------------------------------------------------------------------


def test_find_nonfinite_positions_and_results_in_input_order():
    tensors = [
        tensor_with([INF, 1.0]),
        None,
        tensor_with([1.0, 2.0]),
        tensor_with([5.0, NAN, -INF]),
    ]
    found = find_nonfinite(tensors)
    assert [position for position, _ in found] == [0, 3]
    first, second = (result for _, result in found)
    assert (first.nan, first.pos_inf, first.neg_inf, first.first_bad) == (0, 1, 0, 0)
    assert first.abs_max_finite == 1.0
    assert (second.nan, second.pos_inf, second.neg_inf, second.first_bad) == (1, 0, 1, 1)
    assert second.abs_max_finite == 5.0


# --- locate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_finite_tensor_is_none(dtype):
    assert locate(tensor_with([0.0, -1.0, 2.5], dtype)) is None


def test_locate_empty_tensor_is_none():
    assert locate(torch.empty(0)) is None
    assert locate(torch.empty(4, 0)) is None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_counts_each_kind_exactly(dtype):
    values = [0.5, NAN, INF, -6.5, NAN, -INF, INF, 2.0, NAN, -INF, INF, -0.25]
    result = locate(tensor_with(values, dtype))
    assert result == NonFinite(nan=3, pos_inf=3, neg_inf=2, first_bad=1, abs_max_finite=6.5)
    assert result.inf == 5


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_abs_max_ignores_nonfinite_and_uses_magnitude(dtype):
    """The largest finite magnitude is a negative value; the Inf elements must not count."""
    result = locate(tensor_with([INF, 3.0, -12.0, -INF, 7.0, NAN], dtype))
    assert result.abs_max_finite == 12.0
    assert isinstance(result.abs_max_finite, float)


def test_locate_all_nonfinite_has_zero_abs_max():
    """No finite value at all: the masked-out elements count as 0."""
    assert locate(tensor_with([NAN, INF, -INF])).abs_max_finite == 0.0


def test_locate_returns_plain_python_numbers():
    result = locate(tensor_with([1.0, NAN]))
    assert all(type(v) is int for v in (result.nan, result.pos_inf, result.neg_inf, result.first_bad))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_first_bad_is_smallest_index_across_chunks(dtype):
    """Chunks of 3 over 20 elements: bad values only in the 4th and 6th chunks, largest finite value
    in the 2nd chunk. Counts and maxima must combine over chunks, first_bad must be the minimum."""
    values = [1.0] * 20
    values[4] = -9.0
    values[17] = NAN
    values[11] = INF
    values[10] = -INF
    result = locate(tensor_with(values, dtype), chunk_elements=3)
    assert result == NonFinite(nan=1, pos_inf=1, neg_inf=1, first_bad=10, abs_max_finite=9.0)


def test_locate_bad_value_in_last_partial_chunk():
    values = [2.0] * 10
    values[9] = NAN
    result = locate(tensor_with(values), chunk_elements=4)
    assert (result.nan, result.first_bad, result.abs_max_finite) == (1, 9, 2.0)


@pytest.mark.parametrize("chunk_elements", [1, 2, 5, 7, 8, 1000])
def test_locate_independent_of_chunk_size(chunk_elements):
    values = [0.0, 1.0, NAN, 3.0, -INF, -4.0, INF, 0.5]
    result = locate(tensor_with(values), chunk_elements=chunk_elements)
    assert result == NonFinite(nan=1, pos_inf=1, neg_inf=1, first_bad=2, abs_max_finite=4.0)


def test_locate_non_contiguous_transposed_tensor_uses_logical_order():
    """Flat indices refer to the tensor as it is indexed (row-major), not to its storage."""
    base = torch.zeros(3, 4)
    base[0, 2] = NAN  # storage position 2
    base[2, 1] = INF  # storage position 9
    transposed = base.t()  # shape (4, 3); NaN at [2, 0] -> flat 6, Inf at [1, 2] -> flat 5
    assert not transposed.is_contiguous()
    result = locate(transposed, chunk_elements=2)
    assert result.first_bad == 5
    assert (result.nan, result.pos_inf) == (1, 1)
    assert math.isinf(transposed[tuple(unravel(result.first_bad, transposed.shape))].item())


def test_locate_strided_slice():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    base[1, 1] = NAN  # dropped by the slice below
    base[2, 2] = -INF
    view = base[:, ::2]  # columns 0 and 2 -> shape (3, 2); -Inf at [2, 1] -> flat 5
    assert not view.is_contiguous()
    result = locate(view)
    assert (result.nan, result.neg_inf, result.first_bad) == (0, 1, 5)
    assert result.abs_max_finite == 8.0  # finite values in the view: 0, 2, 4, 6, 8


def test_locate_does_not_modify_input_or_track_grad():
    tensor = tensor_with([1.0, NAN, 2.0]).requires_grad_()
    before = tensor.detach().clone()
    locate(tensor)
    assert torch.equal(tensor.detach().isnan(), before.isnan())
    assert tensor.grad is None


def locate_by_definition(tensor):
    """What ``locate`` must return, elementwise and in float64: the reference for the properties below."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    bad = ~torch.isfinite(flat)
    if not bad.any():
        return None
    finite = flat[~bad].abs()
    return NonFinite(nan=int(flat.isnan().sum()), pos_inf=int(flat.isposinf().sum()),
                     neg_inf=int(flat.isneginf().sum()), first_bad=int(bad.nonzero()[0]),
                     abs_max_finite=float(finite.max()) if finite.numel() else 0.0)


def edge_values(dtype):
    """NaN, both infinities, both zeros, the largest finite values, the smallest normal and subnormal ones."""
    info = torch.finfo(dtype)
    return [NAN, INF, -INF, 0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal / 4,
            -info.smallest_normal / 4, 1.0, -2.5]


@st.composite
def tensors_with_edge_values(draw):
    """A 1-D tensor of one float dtype: edge values at drawn places among ordinary ones, possibly strided."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    size = draw(st.integers(1, 300))
    values = draw(st.lists(st.one_of(st.sampled_from(edge_values(dtype)), st.floats(-100, 100)),
                           min_size=size, max_size=size))
    tensor = tensor_with(values, dtype)
    return tensor[::2] if draw(st.booleans()) else tensor


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(tensor=tensors_with_edge_values(), chunk_elements=st.integers(1, 64))
def test_locate_matches_the_definition_for_every_dtype_and_chunk(tensor, chunk_elements):
    assert locate(tensor, chunk_elements=chunk_elements) == locate_by_definition(tensor)


def test_a_nan_spread_through_every_tensor_is_counted_in_a_few_operators_for_them_all():
    """245 views of one grad buffer, every one holding NaN: one slice counted together, a fixed number of
    operators whatever the number of tensors (it was a few per tensor and per row: on a GPU each is a
    kernel launch, and a NaN spread through a 1B-parameter model cost 27 forward passes to scan)."""
    def counted(views):
        with OperatorCounter() as ops:
            found = locate_all(views)
        assert [result.nan for result in found] == [view.numel() - 1 for view in views]
        assert [result.first_bad for result in found] == [1] * len(views)
        return ops.total

    def all_nan_views(count):
        buffer = torch.full((count * 1000,), NAN)
        buffer[::1000] = 2.0
        return list(buffer.view(count, 1000))

    few, many = counted(all_nan_views(3)), counted(all_nan_views(245))
    assert few == many < 40


def test_no_segmented_reduction_reads_a_long_segment(monkeypatch):
    """On CUDA one thread reduces each segment of ``torch.segment_reduce`` serially, and a 2-D input is
    slower still (a 4M-element segment of an [n, 3] tensor: 278 ms on an H100, where a reduction of the
    slice takes 0.03 ms): every call the exact counts make is 1-D with segments of at most
    ``SERIAL_ELEMENTS``, or of the pieces' results of one slice, however long the tensors."""
    calls = []
    original = torch.segment_reduce

    def recorded(values, reduce, lengths):
        calls.append((values.dim(), int(lengths.max())))
        return original(values, reduce, lengths=lengths)

    monkeypatch.setattr(torch, "segment_reduce", recorded)
    long_tensor = torch.zeros(EXACT_SLICE_ELEMENTS * 2 + 3)
    long_tensor[-1] = NAN
    found = locate_all([torch.ones(5), long_tensor, torch.full((7,), INF)])
    assert [None if result is None else (result.nan, result.pos_inf) for result in found] == [
        None, (1, 0), (0, 7)]
    assert calls and {dim for dim, _ in calls} == {1}
    longest = max(SERIAL_ELEMENTS, EXACT_SLICE_ELEMENTS // SERIAL_ELEMENTS)
    assert max(length for _, length in calls) <= longest


@pytest.mark.parametrize("chunk_elements", [1 << 16, 1 << 18])
def test_exact_counts_temporaries_are_bounded_by_the_slice(chunk_elements):
    """A tensor of 64 MiB counted ``chunk_elements`` at a time: no temporary over 12 bytes an element of one
    slice (the three kind masks as float32), whatever the tensor's size."""
    tensor = torch.zeros(1 << 24)
    tensor[-1] = INF
    found = []
    largest = largest_allocation(lambda: found.append(locate(tensor, chunk_elements=chunk_elements)))
    assert found[0].pos_inf == 1
    assert largest <= 12 * chunk_elements


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_locate_tells_a_nonfinite_value_from_the_largest_finite_one(dtype, bad):
    """The largest finite magnitude's bit pattern is one below +Inf's: a row holding only it is finite and
    reports it; a row holding the bad value is the one examined."""
    largest = torch.finfo(dtype).max
    values = [1.0] * 12
    values[2], values[5], values[9] = -largest, largest, bad
    result = locate(tensor_with(values, dtype), chunk_elements=4)
    assert (result.nan + result.inf, result.first_bad, result.abs_max_finite) == (1, 9, largest)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_abs_max_of_negative_zero_and_subnormals(dtype):
    """-0.0 is a magnitude of 0, a subnormal a magnitude above 0: their sign bits do not count."""
    subnormal = torch.finfo(dtype).smallest_normal / 4
    values = [-0.0] * 8 + [-subnormal, 0.0, subnormal / 2, NAN]
    result = locate(tensor_with(values, dtype), chunk_elements=4)
    assert result == NonFinite(nan=1, pos_inf=0, neg_inf=0, first_bad=11, abs_max_finite=subnormal)
    assert result.abs_max_finite > 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_locate_abs_max_of_finite_rows_across_slices(dtype):
    """More rows than one slice holds: the largest magnitude sits in a finite row of a later slice and the
    NaN in an earlier one; both are found."""
    chunk = 1024
    numel = 1 << 16
    tensor = torch.ones(numel, dtype=dtype)
    tensor[chunk + 3] = NAN
    tensor[7 * chunk + 7] = -1000.0
    tensor[-1] = 250.0
    result = locate(tensor, chunk_elements=chunk)
    assert result == NonFinite(nan=1, pos_inf=0, neg_inf=0, first_bad=chunk + 3, abs_max_finite=1000.0)


def largest_allocation(fn):
    """The largest single allocation (bytes) ``fn`` makes on CPU, as torch's profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_locate_tensors_that_cannot_hold_nan_are_none(dtype):
    assert locate(torch.ones(5000, dtype=dtype), chunk_elements=100) is None


def test_locate_dtype_without_a_scan_is_a_clear_error():
    with pytest.raises(TypeError, match="no NaN/Inf scan for torch.complex64"):
        locate(torch.ones(5000, dtype=torch.complex64), chunk_elements=100)


# --- lists of tensors: views of one buffer in spans, the others by dtype -----------------------


def found_by_definition(tensors):
    return [(index, result) for index, result in
            ((index, locate_by_definition(tensor)) for index, tensor in enumerate(tensors)
             if tensor is not None)
            if result is not None]


@st.composite
def gradient_lists(draw):
    """Gradients as optimizers hold them: None, empty, 0-dim, 1-D and 2-D (some transposed or strided),
    views into one shared buffer among separate tensors, of every float dtype, edge values anywhere."""
    shared = torch.zeros(64, dtype=draw(st.sampled_from(FLOAT_DTYPES)))
    tensors = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["none", "empty", "scalar", "flat", "matrix", "transposed", "strided",
                                     "view"]))
        dtype = draw(st.sampled_from(FLOAT_DTYPES))
        size = draw(st.integers(1, 40))
        values = torch.tensor(draw(st.lists(st.one_of(st.sampled_from(edge_values(dtype)), st.floats(-9, 9)),
                                            min_size=2 * size, max_size=2 * size)), dtype=dtype)
        start = draw(st.integers(0, 32))
        shared[start:start + size // 2] = values[:size // 2].to(shared.dtype)
        tensors.append({"none": None, "empty": values[:0], "scalar": values[0], "flat": values[:size],
                        "matrix": values.view(2, size), "transposed": values.view(2, size).t(),
                        "strided": values[::2], "view": shared[start:start + size // 2 + 1]}[kind])
    return tensors


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(tensors=gradient_lists(), chunk=st.integers(1, 16))
def test_find_nonfinite_matches_the_definition_however_tensors_are_grouped(tensors, chunk):
    """Spans' rows shrunk to a few elements, so the examples cross many row boundaries; separate tensors of
    every dtype mixed: every tensor that holds a NaN or Inf is found, with its exact statistics, and no
    other."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scan, "chunk_elements_for", lambda total: chunk)
        assert find_nonfinite(tensors) == found_by_definition(tensors)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(tensors=gradient_lists(), chunk_elements=st.integers(1, 48))
def test_locate_all_matches_the_definition_however_tensors_are_sliced(tensors, chunk_elements):
    """Views of one buffer (overlapping ones, gaps between them), separate, strided and transposed tensors
    counted together in slices of a few elements: each tensor's exact statistics, as if counted alone."""
    present = [tensor for tensor in tensors if tensor is not None]
    assert locate_all(present, chunk_elements=chunk_elements) == [locate_by_definition(tensor)
                                                                   if tensor.numel() else None
                                                                   for tensor in present]


def test_a_nan_in_any_of_thousands_of_separate_tensors_is_found_in_a_few_operators():
    """3,000 separate tensors of two dtypes, a NaN in the last of one dtype, Infs in two others: found, in
    a fixed number of operators whatever the number of tensors (a fused multi-tensor kernel per dtype on
    a GPU: a kernel per tensor there made the failing step's state record cost three forward passes)."""
    def suspects(count):
        tensors = [torch.ones(100, dtype=torch.bfloat16 if index % 2 else torch.float32)
                   for index in range(count)]
        tensors[count - 1][99] = NAN
        tensors[0][0] = -INF
        tensors[count // 2][50] = INF
        with OperatorCounter() as ops:
            found = nonfinite_indices(tensors)
        assert found == sorted({0, count // 2, count - 1})
        return ops.total

    few, many = suspects(10), suspects(3000)
    assert few == many < 20


def test_a_small_view_and_a_large_view_of_one_buffer():
    """Views of one buffer are read in one span, in rows: each is found for what it holds, not for its
    neighbour's."""
    buffer = torch.zeros(3 * 4096)
    small, large = buffer[4096:4096 + 10], buffer[4096 + 10:]
    other_large = buffer[:4096]
    small[3] = NAN
    assert [index for index, _ in find_nonfinite([large, small, other_large])] == [1]
    large[-1] = INF
    assert [index for index, _ in find_nonfinite([large, small, other_large])] == [0, 1]


def test_parameters_that_require_grad_are_checked_without_autograd():
    weights = [torch.ones(5, requires_grad=True), torch.tensor([1.0, NAN], requires_grad=True)]
    assert nonfinite_indices(weights) == [1]


def test_tensors_that_cannot_hold_nan_are_left_out_of_a_list():
    tensors = [torch.ones(3, dtype=torch.int64), torch.tensor([NAN]), torch.ones(2, dtype=torch.bool)]
    assert nonfinite_indices(tensors) == [1]


def test_the_first_level_allocates_nothing_the_size_of_its_tensors():
    """64 MiB of separate tensors: the first level's largest allocation is its flags, not a copy."""
    tensors = [torch.zeros(4096) for _ in range(4096)]
    tensors[-1][-1] = NAN
    found = []
    largest = largest_allocation(lambda: found.append(nonfinite_indices(tensors)))
    assert found == [[4095]]
    assert largest <= 64 * 1024


# --- NonFinite --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nan, pos_inf, neg_inf, kind",
    [
        (1, 0, 0, "nan"),
        (0, 1, 0, "inf"),
        (0, 0, 2, "inf"),
        (0, 3, 4, "inf"),
        (2, 1, 0, "nan+inf"),
        (1, 0, 1, "nan+inf"),
    ],
)
def test_nonfinite_kind(nan, pos_inf, neg_inf, kind):
    result = NonFinite(nan=nan, pos_inf=pos_inf, neg_inf=neg_inf, first_bad=0, abs_max_finite=0.0)
    assert result.kind == kind
    assert result.inf == pos_inf + neg_inf


# --- unravel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7,), (2, 3), (3, 1, 4), (2, 3, 4, 5), (1, 1, 6)])
def test_unravel_matches_numpy_for_every_index(shape):
    for flat in range(math.prod(shape)):
        assert unravel(flat, shape) == [int(i) for i in numpy.unravel_index(flat, shape)]


def test_unravel_hand_checked():
    assert unravel(0, (4, 5)) == [0, 0]
    assert unravel(5, (2, 3)) == [1, 2]
    assert unravel(7, (2, 3, 4)) == [0, 1, 3]
    assert unravel(13, (2, 3, 4)) == [1, 0, 1]


def test_unravel_scalar_shape():
    assert unravel(0, ()) == []


def test_unravel_accepts_torch_size_and_round_trips():
    tensor = torch.arange(24).reshape(2, 3, 4)
    for flat in range(24):
        index = unravel(flat, tensor.shape)
        assert tensor[tuple(index)].item() == flat


def test_unravel_with_large_shape():
    shape = (50304, 4096)  # a vocabulary-sized embedding
    row, col = 40000, 1234
    assert unravel(row * shape[1] + col, shape) == [row, col]

