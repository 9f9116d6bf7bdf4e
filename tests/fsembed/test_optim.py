"""Duplicate rows of a step are summed deterministically: every row once (CPU) or repeated with the same sum
(the device form, whose row count never reaches the host), each sum in arrival order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsembed.optim import sum_duplicate_rows


def _expected(ids: torch.Tensor, grads: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for i, row in zip(ids.tolist(), grads):
        out[i] = out[i] + row if i in out else row.clone()  # arrival order, one add at a time
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=40), st.integers(1, 5), st.integers(0, 2**16))
def test_every_row_once_with_its_summed_gradient(ids, dim, seed):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    grads = torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed))
    rows, sums = sum_duplicate_rows(ids_t, grads)
    expected = _expected(ids_t, grads)
    assert rows.tolist() == sorted(expected), "each touched row once, ascending"
    for r, s in zip(rows.tolist(), sums):
        torch.testing.assert_close(s, expected[r], rtol=1e-6, atol=1e-6)


def test_no_rows():
    rows, sums = sum_duplicate_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    assert rows.numel() == 0 and sums.shape == (0, 3)
