"""Jagged attention: the block mask built from offsets equals create_block_mask's; the per-sample twin equals the
padded baseline (outputs and gradients, fp32, rtol 1e-5 / atol 1e-5); edge cases (length 1, a sample at the cap, one
sample, samples without keys). The FlexAttention path against the twin: test_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import jagged_attention, resolve_impl
from kernels.flex.block_mask import build_block_mask
from kernels.impl import Impl
from tests.kernels.test_attention_gpu import _compare, _qkv


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


def _expected_mask(q_offsets, kv_offsets, causal, block):
    from torch.nn.attention.flex_attention import create_block_mask

    q_sample = torch.repeat_interleave(torch.arange(q_offsets.numel() - 1), q_offsets.diff())
    kv_sample = torch.repeat_interleave(torch.arange(kv_offsets.numel() - 1), kv_offsets.diff())

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_sample[q_idx] == kv_sample[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return create_block_mask(
        mask_mod, None, None, int(q_offsets[-1]), int(kv_offsets[-1]), device="cpu", BLOCK_SIZE=block
    )


def _rows(num: torch.Tensor, indices: torch.Tensor) -> list[list[int]]:
    """Each row's listed blocks, as a sorted list (the order inside a row is free)."""
    return [sorted(indices[0, 0, i, :n].tolist()) for i, n in enumerate(num[0, 0].tolist())]


lengths_st = st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 40)), min_size=1, max_size=6)


def _union(mask, direction: str) -> list[list[int]]:
    """Every listed block of each row, partial and full together."""
    partial = _rows(getattr(mask, f"{direction}_num_blocks"), getattr(mask, f"{direction}_indices"))
    full = _rows(getattr(mask, f"full_{direction}_num_blocks"), getattr(mask, f"full_{direction}_indices"))
    return [sorted(p + f) for p, f in zip(partial, full)]


@settings(max_examples=60, deadline=None)
@given(
    q_lengths=lengths_st,
    kv_lengths=lengths_st,
    causal=st.booleans(),
    block=st.sampled_from([1, 2, 4, 8, 16]),
    separate=st.booleans(),
)
def test_block_mask_from_offsets_equals_create_block_mask(q_lengths, kv_lengths, causal, block, separate):
    if causal:
        kv_lengths = q_lengths
    else:  # the lists are exact when every sample has queries and keys (kernels/flex/block_mask.py)
        size = min(len(q_lengths), len(kv_lengths))
        q_lengths, kv_lengths = [max(n, 1) for n in q_lengths[:size]], [max(n, 1) for n in kv_lengths[:size]]
    if sum(q_lengths) == 0:
        return
    qo, ko = _offsets(q_lengths), _offsets(kv_lengths)
    expected = _expected_mask(qo, ko, causal, block)
    got = build_block_mask(qo, None if causal else ko, causal=causal, block_size=block, separate_full_blocks=separate)
    if separate:
        for name in ("kv", "full_kv", "q", "full_q"):
            assert _rows(getattr(got, f"{name}_num_blocks"), getattr(got, f"{name}_indices")) == _rows(
                getattr(expected, f"{name}_num_blocks"), getattr(expected, f"{name}_indices")
            ), name
    else:
        assert got.full_kv_indices is None and got.full_q_indices is None
        for name in ("kv", "q"):
            assert _rows(getattr(got, f"{name}_num_blocks"), getattr(got, f"{name}_indices")) == _union(
                expected, name
            ), name
    assert got.block_mask().shape[-2:] == (int(qo[-1]), int(ko[-1]))


def test_cross_block_mask_with_empty_samples_lists_every_needed_block():
    """Samples without queries or keys may leave masked blocks in a partial list, never drop a needed one."""
    qo, ko = _offsets([3, 0, 5, 2, 0]), _offsets([0, 7, 4, 0, 9])
    expected = _expected_mask(qo, ko, False, 2)
    got = build_block_mask(qo, ko, causal=False, block_size=2, separate_full_blocks=True)
    for name in ("kv", "q"):
        want = _rows(getattr(expected, f"{name}_num_blocks"), getattr(expected, f"{name}_indices"))
        have = _rows(getattr(got, f"{name}_num_blocks"), getattr(got, f"{name}_indices"))
        assert all(set(w) <= set(h) for w, h in zip(want, have)), name
    for name in ("full_kv", "full_q"):
        assert _rows(getattr(got, f"{name}_num_blocks"), getattr(got, f"{name}_indices")) == _rows(
            getattr(expected, f"{name}_num_blocks"), getattr(expected, f"{name}_indices")
        ), name


@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [37], [5, 64, 1, 0, 20], [64, 64], [0, 3, 0]], ids=str)
def test_causal_twin_equals_padded(lengths):
    _compare(lengths, None, True, "torch")


@pytest.mark.parametrize(
    "q_lengths,kv_lengths", [([1], [1]), ([2, 3, 1], [10, 1, 64]), ([4, 0, 2], [5, 6, 0])], ids=str
)
def test_cross_twin_equals_padded(q_lengths, kv_lengths):
    _compare(q_lengths, kv_lengths, False, "torch")


def test_a_query_without_keys_gets_zeros_and_no_nan():
    qo, ko = _offsets([2, 1]), _offsets([0, 3])
    q, k, v = _qkv(3, 3)
    for impl in ("torch", "padded"):
        out = jagged_attention(q, k, v, qo, ko, causal=False, impl=impl)
        assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isfinite(out).all()


def test_bad_input_is_refused_with_a_message():
    q, k, v = _qkv(4, 4)
    with pytest.raises(ValueError, match="kernels.attention: unknown impl"):
        jagged_attention(q, k, v, _offsets([4]), causal=True, impl="sdpa")
    with pytest.raises(ValueError, match="from 0 to the 4 packed rows"):
        jagged_attention(q, k, v, _offsets([3]), causal=True)
    with pytest.raises(ValueError, match="runs on CUDA"):
        jagged_attention(q, k, v, _offsets([4]), causal=True, impl=Impl.FLEX)
    with pytest.raises(ValueError, match="one set of offsets"):
        jagged_attention(q, k, v, _offsets([2, 2]), _offsets([1, 3]), causal=True)
    assert resolve_impl(None, torch.device("cpu")) is Impl.TORCH
