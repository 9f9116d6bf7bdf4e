"""The Triton HSTU attention on CUDA against its per-sample twin (bf16 and fp32, outputs and every gradient),
and its reproducibility: every gradient bit for bit. No hypothesis here: this file runs where only torch and
triton are installed."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.hstu_cases import Case, assert_matches_twin, inputs, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LENGTHS = [300, 1, 0, 1024, 517, 64, 2000]
TARGETS = [5, 1, 0, 40, 0, 64, 100]


@pytest.mark.parametrize(
    "dtype, dim, rab",
    [
        (torch.float32, 64, True),
        (torch.bfloat16, 64, True),
        (torch.bfloat16, 64, False),
        (torch.bfloat16, 128, True),
        (torch.float32, 256, False),
        (torch.bfloat16, 256, True),
    ],
)
def test_kernel_matches_twin(dtype, dim, rab):
    assert_matches_twin(Case(LENGTHS, heads=2, dim=dim, dim_v=dim, targets=TARGETS, rab=rab, dtype=dtype), "cuda")


def test_kernel_matches_twin_with_window_and_per_sample_norm():
    case = Case(LENGTHS, dim=64, dim_v=64, targets=TARGETS, window=100, rab=True, seq_norm=None)
    assert_matches_twin(case, "cuda")


def test_unordered_timestamps():
    assert_matches_twin(Case(LENGTHS, dim=64, dim_v=64, rab=True, ordered_times=False), "cuda")


@pytest.mark.parametrize("dim", [64, 256])
def test_the_backward_recomputing_the_scores_matches_the_twin(dim):
    """The dQ pass that recomputes the scores (a batch whose dS would not fit the budget), windows and targets."""
    case = Case(LENGTHS, dim=dim, dim_v=dim, targets=TARGETS, window=300, rab=True, dtype=torch.bfloat16)
    assert_matches_twin(Case(**{**case.__dict__, "recompute": True}), "cuda")


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_is_reproducible(recompute):
    """No atomics anywhere in the backward: every gradient, the bucket weights' included, bit for bit, with the
    dQ pass reading the kept dS and recomputing it."""
    case = Case(LENGTHS, dim=64, dim_v=64, targets=TARGETS, rab=True, dtype=torch.bfloat16, recompute=recompute)
    data = inputs(case, "cuda")
    first, second = run(case, data, "triton"), run(case, data, "triton")
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"tensor {i} differs between two identical backward passes"


def test_odd_lengths_and_empty_samples():
    """Lengths one off the block sizes, a single token, and one longer than every tile config's blocks."""
    lengths = [1, 2, 127, 129, 0, 4097]
    case = Case(lengths, dim=64, dim_v=64, targets=[0, 1, 3, 129, 0, 8], rab=True, dtype=torch.bfloat16)
    assert_matches_twin(case, "cuda")


def test_millisecond_timestamps_give_the_twins_buckets():
    """Timestamps in milliseconds: a long sample's tiles span more than 2**31 ticks, so the kernel takes their
    gaps in int64; 64 time buckets reach gaps of 2**31 ticks."""
    case = Case([3000, 40, 900], dim=64, dim_v=64, rab=True, time_unit=1000, time_buckets=64)
    assert_matches_twin(case, "cuda")


@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float32, 256)])
def test_the_deterministic_modes_fixed_configuration_matches_the_twin(dtype, dim):
    """One launch configuration per head width and dtype, picked by no timing: the twin's numbers."""
    case = Case(LENGTHS, dim=dim, dim_v=dim, targets=TARGETS, rab=True, dtype=dtype, deterministic=True)
    assert_matches_twin(case, "cuda")


def _backward_configurations():
    from kernels.triton import triton_hstu_attention as hstu

    for table_name in ("_DKDV_CONFIGS", "_DQ_KEPT_CONFIGS"):
        for width, rows in getattr(hstu, table_name).items():
            for config in rows:
                yield pytest.param(table_name, width, config, id=f"{table_name[1:-8].lower()}-{width}-{config}")


@pytest.mark.parametrize("table_name, width, config", list(_backward_configurations()))
def test_every_launch_configuration_of_the_kept_backward_matches_the_twin(monkeypatch, table_name, width, config):
    """Each configuration the autotuner may pick for the passes that write and read the kept dS, one at a time
    (the deterministic mode's kernels rebuilt on it): a build that is wrong at one configuration only, as a
    pipelined one once was, shows here and not in the tests that run the autotuner's pick."""
    from kernels.triton import triton_hstu_attention as hstu

    kernel, slot = {
        "_DKDV_CONFIGS": (hstu._dkdv_kernel, "_DKDV"),
        "_DQ_KEPT_CONFIGS": (hstu._dq_kept_kernel, "_DQ_KEPT"),
    }[table_name]
    tuned = getattr(hstu, slot)
    rebuilt = hstu._tuned(kernel, {width: [config]}, True, key=list(tuned[1].keys))
    monkeypatch.setattr(hstu, slot, [tuned[0], rebuilt])
    case = Case(LENGTHS, dim=width, dim_v=width, targets=TARGETS, rab=True, dtype=torch.bfloat16, deterministic=True)
    assert_matches_twin(case, "cuda")
