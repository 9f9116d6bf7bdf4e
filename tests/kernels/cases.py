"""Random inputs for the kernel tests: hypothesis strategies that draw a seed and a few sizes, and builders
that turn them into jagged tensors (small: the Triton interpreter is ~150x slower than native code)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

OFFSET_DTYPES = [torch.int32, torch.int64]
VALUE_DTYPES = [torch.int64, torch.float32, torch.bfloat16]
# None: 1-D values; an int: 2-D values of that width (embeddings).
WIDTHS = [None, 1, 3, 8]

seeds = st.integers(0, 2**31 - 1)


def random_lengths(gen: torch.Generator, num_segments: int, max_length: int) -> torch.Tensor:
    """Heavy-ish tail with many empty segments: a quarter empty, the rest uniform up to max_length."""
    lengths = torch.randint(0, max_length + 1, (num_segments,), generator=gen)
    empty = torch.rand(num_segments, generator=gen) < 0.25
    return torch.where(empty, torch.zeros_like(lengths), lengths)


def random_values(gen: torch.Generator, rows: int, dtype: torch.dtype, width) -> torch.Tensor:
    shape = (rows,) if width is None else (rows, width)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 2**62, shape, generator=gen, dtype=torch.int64).to(dtype)


def offsets_of(lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out.to(dtype)


def permute_case(seed, num_segments, num_picked, offset_dtype, value_dtype, width, permutation, max_length):
    """(values, offsets, order) of an indexed_permute: a permutation of the segments, or a selection with repeats."""
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, num_segments, max_length)
    values = random_values(gen, int(lengths.sum()), value_dtype, width)
    if permutation or num_segments == 0:
        order = torch.randperm(num_segments, generator=gen)
    else:
        order = torch.randint(0, num_segments, (num_picked,), generator=gen)
    return values, offsets_of(lengths, offset_dtype), order


def random_boundaries(gen: torch.Generator, world_size: int, num_rows: int) -> torch.Tensor:
    """Row-wise shard ranges [0, num_rows) split at random points (some shards may be empty)."""
    cuts = torch.sort(torch.randint(0, num_rows + 1, (world_size - 1,), generator=gen)).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([num_rows])]).to(torch.int64)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality of dtype, shape and bytes (a poisoned, unwritten element can never match)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.contiguous().reshape(-1).view(torch.uint8)
    e = expected.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, e):
        bad = torch.nonzero(a != e).flatten()[:5] // actual.element_size()
        raise AssertionError(
            f"{what}: differs at flat elements {bad.tolist()}: {actual.reshape(-1)[bad]} vs {expected.reshape(-1)[bad]}"
        )
