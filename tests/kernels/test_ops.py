"""The dispatch point and the vectorized twins: twin == naive eager loop on random inputs, clear errors for
bad input, and the implementation enum's explicit match."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ops
from kernels.impl import Impl
from tests.kernels.cases import (
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

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(
    seeds,
    st.integers(0, 30),
    st.integers(0, 40),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from(VALUE_DTYPES),
    st.sampled_from(WIDTHS),
    st.booleans(),
)
def test_indexed_permute_twin_matches_eager(
    seed, num_segments, num_picked, offset_dtype, value_dtype, width, permutation
):
    values, offsets, order = permute_case(
        seed, num_segments, num_picked, offset_dtype, value_dtype, width, permutation, max_length=12
    )
    out, out_offsets = ops.indexed_permute(values, offsets, order)
    ref, ref_offsets = ops.indexed_permute(values, offsets, order, impl=Impl.EAGER)
    assert_same_bits(out, ref, "values")
    assert_same_bits(out_offsets, ref_offsets, "offsets")
    sized, _ = ops.indexed_permute(values, offsets, order, output_size=int(ref_offsets[-1]))
    assert_same_bits(sized, ref, "values with output_size")


@FAST
@given(seeds, st.integers(0, 300), st.integers(1, 40))
def test_ranged_dispatch_twin_matches_eager_and_combine_inverts(seed, n, world_size):
    gen = torch.Generator().manual_seed(seed)
    boundaries = random_boundaries(gen, world_size, 1000)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    # The samples the eager loops walk one at a time (empty samples included).
    cuts = torch.sort(torch.randint(0, n + 1, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
    send, splits, perm = ops.ranged_dispatch(ids, boundaries)
    for sample_offsets in (None, offsets):
        eager = ops.ranged_dispatch(ids, boundaries, offsets=sample_offsets, impl="eager")
        for got, want, what in zip((send, splits, perm), eager, ("send", "splits", "perm")):
            assert_same_bits(got, want, f"{what} (eager offsets {sample_offsets})")
        assert_same_bits(
            ops.ranged_combine(send, perm, splits=splits, offsets=sample_offsets, impl="eager"),
            ids,
            f"eager combine (offsets {sample_offsets})",
        )
    assert int(splits.sum()) == n
    assert_same_bits(ops.ranged_combine(send, perm), ids, "combine(dispatch(ids))")


@FAST
@given(
    seeds,
    st.integers(0, 5),
    st.integers(0, 8),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from(VALUE_DTYPES),
    st.sampled_from(WIDTHS),
)
def test_keyed_transpose_twin_matches_eager(seed, num_keys, batch_size, length_dtype, value_dtype, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, num_keys * batch_size, 6).view(num_keys, batch_size).to(length_dtype)
    values = random_values(gen, int(lengths.sum()), value_dtype, width)
    out, out_lengths = ops.keyed_transpose(values, lengths)
    ref, ref_lengths = ops.keyed_transpose(values, lengths, impl="eager")
    assert_same_bits(out, ref, "values")
    assert_same_bits(out_lengths, ref_lengths, "lengths")
    back, back_lengths = ops.keyed_transpose(out, out_lengths)
    assert_same_bits(back, values, "transpose twice")
    assert_same_bits(back_lengths, lengths, "lengths twice")


@FAST
@given(
    seeds,
    st.integers(0, 20),
    st.sampled_from(OFFSET_DTYPES),
    st.sampled_from([torch.int32, torch.int64, torch.float32, torch.bfloat16]),
    st.sampled_from(WIDTHS),
)
def test_segment_sum_twin_matches_eager(seed, num_segments, offset_dtype, value_dtype, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, num_segments, 30)
    offsets = offsets_of(lengths, offset_dtype)
    values = random_values(gen, int(lengths.sum()), torch.float32, width)
    values = values.to(value_dtype) if value_dtype.is_floating_point else (values * 100).to(value_dtype)
    out = ops.segment_sum(values, offsets)
    ref = ops.segment_sum(values, offsets, impl="eager")
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if value_dtype.is_floating_point:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(out, ref)


@FAST
@given(seeds, st.integers(0, 200), st.integers(0, 200), st.sampled_from([torch.int32, torch.int64]))
def test_collision_mask_twin_matches_eager(seed, n, m, dtype):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (n,), generator=gen).to(dtype)
    other = torch.randint(0, 300, (m,), generator=gen).to(dtype)
    cuts = torch.sort(torch.randint(0, n + 1, (3,), generator=gen)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
    assert_same_bits(
        ops.collision_mask(ids, other), ops.collision_mask(ids, other, offsets=offsets, impl="eager"), "mask"
    )


def test_ranged_combine_twin_gradient():
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(17, generator=gen)
    values = torch.randn(17, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: ops.ranged_combine(v, perm), (values,))


def test_one_rank_and_empty_batches():
    boundaries = torch.tensor([0, 10])
    ids = torch.tensor([3, 9, 0, 3])
    send, splits, perm = ops.ranged_dispatch(ids, boundaries)
    assert send.tolist() == [3, 9, 0, 3] and splits.tolist() == [4] and perm.tolist() == [0, 1, 2, 3]
    send, splits, perm = ops.ranged_dispatch(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 5, 5, 9]))
    assert send.numel() == 0 and splits.tolist() == [0, 0, 0] and perm.numel() == 0
    out, out_offsets = ops.indexed_permute(
        torch.zeros(0, 4), torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    )
    assert out.shape == (0, 4) and out_offsets.tolist() == [0] and out_offsets.dtype == torch.int32
    assert ops.segment_sum(torch.zeros(0), torch.zeros(1, dtype=torch.int64)).shape == (0,)


def test_default_impl_on_cpu_is_the_twin(monkeypatch):
    called = []
    monkeypatch.setattr(ops.pt_segment, "collision_mask", lambda ids, other: called.append(1) or torch.isin(ids, other))
    ops.collision_mask(torch.tensor([1]), torch.tensor([1]))
    assert called == [1]


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="kernels.ops.segment_sum: unknown impl 'pytorch'"):
        ops.segment_sum(torch.ones(3), torch.tensor([0, 3]), impl="pytorch")
    with pytest.raises(ValueError, match="impl must be"):
        ops.segment_sum(torch.ones(3), torch.tensor([0, 3]), impl=3)
    with pytest.raises(ValueError, match="'varlen' is not one of this op's"):
        ops.segment_sum(torch.ones(3), torch.tensor([0, 3]), impl="varlen")


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: ops.indexed_permute(torch.ones(4), torch.tensor([0, 2, 1, 4]), torch.tensor([0])),
            "non-decreasing; segment 1",
        ),
        (
            lambda: ops.indexed_permute(torch.ones(4), torch.tensor([0, 2, 5]), torch.tensor([0])),
            r"offsets\[-1\] = 5 exceeds",
        ),
        (
            lambda: ops.indexed_permute(torch.ones(4), torch.tensor([0, 2, 4]), torch.tensor([2])),
            "order holds segment 2",
        ),
        (lambda: ops.indexed_permute(torch.ones(4), torch.tensor([0, 4.0]), torch.tensor([0])), "int32 or int64"),
        (
            lambda: ops.indexed_permute(torch.ones(4), torch.tensor([0, 4]), torch.tensor([0], dtype=torch.int32)),
            "order must be",
        ),
        (lambda: ops.ranged_dispatch(torch.tensor([5, 12]), torch.tensor([0, 10])), "id 12 is outside"),
        (lambda: ops.ranged_dispatch(torch.tensor([5]), torch.tensor([0, 7, 3, 10])), "must be sorted; shard 1"),
        (lambda: ops.ranged_dispatch(torch.tensor([5]), torch.tensor([0])), "world_size"),
        (lambda: ops.ranged_combine(torch.ones(3), torch.tensor([0, 1])), "perm has 2 entries"),
        (lambda: ops.ranged_combine(torch.ones(3), torch.tensor([0, 1, 1])), "not a permutation"),
        (lambda: ops.keyed_transpose(torch.ones(3), torch.tensor([[1, 1]])), "sum to 2 but values has 3"),
        (lambda: ops.keyed_transpose(torch.ones(3), torch.tensor([1, 2])), "2-D"),
        (lambda: ops.segment_sum(torch.ones(3), torch.tensor([0, 2])), "must span all 3"),
        (lambda: ops.collision_mask(torch.tensor([1]), torch.tensor([1], dtype=torch.int32)), "share an integer dtype"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()
