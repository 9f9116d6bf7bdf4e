"""The Triton HSTU attention, run by Triton's interpreter on CPU, against its per-sample twin: random jagged
batches with empty and one-token samples, targets, windows, rab with ordered and unordered timestamps (the
bucket-weight gradient's per-bucket sums assume nothing about order), both normalizations; and the kernel's
bucket arithmetic against the twin's over the whole int32 range of distances and gaps.
TRITON_INTERPRET is set before the kernel module is (re)imported, as in test_triton_interpreted.py."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

_MODULE = "kernels.triton.triton_hstu_attention"
if _MODULE in sys.modules:
    importlib.reload(sys.modules[_MODULE])

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.pytorch.pt_hstu_attention import position_bucket, time_bucket  # noqa: E402
from tests.kernels.hstu_cases import Case, assert_matches_twin  # noqa: E402

hstu = sys.modules.get(_MODULE) or importlib.import_module(_MODULE)


@st.composite
def cases(draw) -> Case:
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    targets = draw(st.none() | st.just([draw(st.integers(0, n)) for n in lengths]))
    return Case(
        lengths=lengths,
        heads=draw(st.sampled_from([1, 2])),
        dim=draw(st.sampled_from([16, 24])),
        dim_v=draw(st.sampled_from([16, 32])),
        targets=targets,
        window=draw(st.sampled_from([0, 0, 1, 7, 20])),
        rab=draw(st.booleans()),
        ordered_times=draw(st.booleans()),
        seq_norm=draw(st.sampled_from([None, 64])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=12, deadline=None)
@given(cases())
def test_the_kernel_matches_its_twin_on_random_jagged_batches(case):
    assert_matches_twin(case, "cpu")


def test_a_target_block_beyond_one_key_block_and_a_window_inside_it():
    """Lengths over two blocks (16 under the interpreter) with many targets and a window shorter than a block:
    every masked-tile path of the three kernels at once."""
    assert_matches_twin(Case(lengths=[45, 3], targets=[20, 1], window=5, rab=True), "cpu")


@triton.jit
def _bucket_kernel(
    X,
    POS,
    TIME,
    n,
    num_buckets,
    BLOCK: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0)
    tl.store(POS + i, hstu._position_bucket(x, num_buckets, P_LINEAR, P_LOG2, P_SUB), mask=i < n)
    tl.store(TIME + i, hstu._time_bucket(x, num_buckets, T_LINEAR, T_LOG2, T_SUB), mask=i < n)


@pytest.mark.parametrize("num_buckets", [1, 16, 64, 200])
def test_the_kernels_buckets_are_the_twins(num_buckets):
    powers = torch.tensor([1 << e for e in range(31)])
    edges = torch.cat([torch.arange(0, 70), powers - 1, powers, powers + 1, -powers, torch.tensor([-1, 2**31 - 1])])
    x = torch.cat([edges, torch.randint(-(2**31), 2**31 - 1, (256,), generator=torch.Generator().manual_seed(0))])
    x = x.to(torch.int32)
    pos, time = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(x.numel())
    _bucket_kernel[(1,)](x, pos, time, x.numel(), num_buckets, BLOCK=block, **hstu._BUCKET_CONSTANTS)
    assert torch.equal(pos, position_bucket(x.clamp(min=0), num_buckets))
    gaps = x.clamp(min=-(2**30), max=2**30)  # the kernel's gaps are within +-2**30 (kernels.triton: _TIME_RANGE)
    _bucket_kernel[(1,)](gaps, pos, time, x.numel(), num_buckets, BLOCK=block, **hstu._BUCKET_CONSTANTS)
    assert torch.equal(time, time_bucket(gaps, num_buckets))
