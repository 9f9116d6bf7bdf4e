"""The Triton kernels, run by Triton's interpreter on CPU, against the PyTorch twins on fresh random inputs.

TRITON_INTERPRET must be set before the kernels' @triton.jit decorators run, so it is set here, before the
Triton modules are imported (and they are reloaded if something imported them earlier without it). Output
buffers are poisoned (kernels.triton.common.POISON_OUTPUTS) so an element a kernel never writes fails.
Sizes stay small: the interpreter is ~150x slower than native code.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from kernels import ops  # noqa: E402
from kernels.impl import Impl  # noqa: E402
from kernels.triton import common  # noqa: E402
from tests.kernels.cases import (  # noqa: E402
    OFFSET_DTYPES,
    VALUE_DTYPES,
    WIDTHS,
    assert_same_bits,
    offsets_of,
    permute_case,
    random_boundaries,
    random_lengths,
    random_values,
    seeds,
)

_TRITON_MODULES = (
    "kernels.triton.search",
    "kernels.triton.triton_jagged_gather",
    "kernels.triton.triton_ranged",
    "kernels.triton.triton_segment",
)
for _name in _TRITON_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
    else:
        importlib.import_module(_name)

INTERPRETED = settings(max_examples=25, deadline=None)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Small tiles so that a few dozen rows already span several programs and segment boundaries."""
    from kernels.triton import triton_jagged_gather, triton_ranged

    monkeypatch.setattr(triton_jagged_gather, "ELEMENTS_PER_PROGRAM", 16)
    monkeypatch.setattr(triton_ranged, "COMBINE_ELEMENTS_PER_PROGRAM", 16)
    monkeypatch.setattr(triton_ranged, "DISPATCH_BLOCK", 16)


@INTERPRETED
@given(
    seeds,
    st.integers(0, 12),
    st.integers(0, 16),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from(VALUE_DTYPES),
    st.sampled_from(WIDTHS),
    st.booleans(),
)
def test_indexed_permute(seed, num_segments, num_picked, offset_dtype, value_dtype, width, permutation):
    values, offsets, order = permute_case(
        seed, num_segments, num_picked, offset_dtype, value_dtype, width, permutation, max_length=20
    )
    out, out_offsets = ops.indexed_permute(values, offsets, order, impl=Impl.TRITON)
    ref, ref_offsets = ops.indexed_permute(values, offsets, order, impl=Impl.TORCH)
    assert_same_bits(out, ref, "values")
    assert_same_bits(out_offsets, ref_offsets, "offsets")


@INTERPRETED
@given(
    seeds,
    st.integers(0, 4),
    st.integers(0, 6),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from(VALUE_DTYPES),
    st.sampled_from(WIDTHS),
)
def test_keyed_transpose(seed, num_keys, batch_size, length_dtype, value_dtype, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, num_keys * batch_size, 8).view(num_keys, batch_size).to(length_dtype)
    values = random_values(gen, int(lengths.sum()), value_dtype, width)
    out, out_lengths = ops.keyed_transpose(values, lengths, impl=Impl.TRITON)
    ref, ref_lengths = ops.keyed_transpose(values, lengths, impl=Impl.TORCH)
    assert_same_bits(out, ref, "values")
    assert_same_bits(out_lengths, ref_lengths, "lengths")


@INTERPRETED
@given(
    seeds,
    st.integers(0, 80),
    st.sampled_from([1, 2, 5, 33]),
    st.sampled_from([None, 1, 4]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_ranged_dispatch_and_combine(seed, n, world_size, width, value_dtype):
    gen = torch.Generator().manual_seed(seed)
    boundaries = random_boundaries(gen, world_size, 500)
    ids = torch.randint(0, 500, (n,), generator=gen)
    got = ops.ranged_dispatch(ids, boundaries, impl=Impl.TRITON)
    want = ops.ranged_dispatch(ids, boundaries, impl=Impl.TORCH)
    for g, w, what in zip(got, want, ("send_ids", "splits", "perm")):
        assert_same_bits(g, w, what)
    perm = want[2]
    values = random_values(gen, n, value_dtype, width).requires_grad_(True)
    out = ops.ranged_combine(values, perm, impl=Impl.TRITON)
    ref = ops.ranged_combine(values, perm, impl=Impl.TORCH)
    assert_same_bits(out.detach(), ref.detach(), "combined")
    grad_out = random_values(gen, n, value_dtype, width)
    (grad,) = torch.autograd.grad(out, values, grad_out)
    (grad_ref,) = torch.autograd.grad(ref, values, grad_out)
    assert_same_bits(grad, grad_ref, "gradient")


def test_ranged_combine_gradcheck():
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(9, generator=gen)
    values = torch.randn(9, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: ops.ranged_combine(v, perm, impl=Impl.TRITON), (values,))


@INTERPRETED
@given(
    seeds,
    st.integers(0, 8),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from([torch.int32, torch.int64, torch.float32, torch.bfloat16]),
    st.sampled_from(WIDTHS),
)
def test_segment_sum(seed, num_segments, offset_dtype, value_dtype, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, num_segments, 150)
    offsets = offsets_of(lengths, offset_dtype)
    values = random_values(gen, int(lengths.sum()), torch.float32, width)
    values = values.to(value_dtype) if value_dtype.is_floating_point else (values * 100).to(value_dtype)
    out = ops.segment_sum(values, offsets, impl=Impl.TRITON)
    ref = ops.segment_sum(values, offsets, impl=Impl.TORCH)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if value_dtype.is_floating_point:
        # Both accumulate in fp32 but in different orders; bf16 results may then round one ulp apart.
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-4)
    else:
        assert_same_bits(out, ref, "sums")


@INTERPRETED
@given(seeds, st.integers(0, 100), st.integers(0, 100), st.sampled_from([torch.int32, torch.int64]))
def test_collision_mask(seed, n, m, dtype):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-50, 150, (n,), generator=gen).to(dtype)
    other = torch.randint(-50, 150, (m,), generator=gen).to(dtype)
    assert_same_bits(
        ops.collision_mask(ids, other, impl=Impl.TRITON), ops.collision_mask(ids, other, impl=Impl.TORCH), "mask"
    )


def test_large_heavy_tailed_segments(monkeypatch):
    """One long segment among many empty and short ones, across many programs."""
    from kernels.triton import triton_jagged_gather

    monkeypatch.setattr(triton_jagged_gather, "ELEMENTS_PER_PROGRAM", 256)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([0, 3, 0, 0, 2100, 1, 0, 40, 0])
    offsets = offsets_of(lengths, torch.int64)
    values = random_values(gen, int(lengths.sum()), torch.int64, None)
    order = torch.tensor([4, 8, 0, 7, 4, 1, 5])
    out, out_offsets = ops.indexed_permute(values, offsets, order, impl=Impl.TRITON)
    ref, ref_offsets = ops.indexed_permute(values, offsets, order, impl=Impl.TORCH)
    assert_same_bits(out, ref, "values")
    assert_same_bits(out_offsets, ref_offsets, "offsets")


def test_non_differentiable_kernels_refuse_grad():
    values = torch.randn(4, 2, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable"):
        ops.indexed_permute(values, torch.tensor([0, 4]), torch.tensor([0]), impl=Impl.TRITON)
    with torch.no_grad():
        out, _ = ops.indexed_permute(values, torch.tensor([0, 4]), torch.tensor([0]), impl=Impl.TRITON)
    assert torch.equal(out, values.detach())


def test_outputs_are_poisoned():
    """The guard the comparisons above rely on: a fresh output buffer holds no plausible value."""
    out = common.new_output((4,), torch.float32, "cpu")
    assert torch.isnan(out).all()
    assert (common.new_output((4,), torch.int64, "cpu") == -1).all()
