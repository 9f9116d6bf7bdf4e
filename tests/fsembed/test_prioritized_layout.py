"""The flags' wire layout of Algorithm 2's lines 13-14: step i's and step i+1's flags interleaved per rank, and back."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsembed.prioritized import _deinterleave, _interleave, _paired


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=40))
def test_deinterleave_inverts_interleave(splits):
    a_splits, b_splits = [a for a, _ in splits], [b for _, b in splits]
    a = torch.arange(sum(a_splits))
    b = -1 - torch.arange(sum(b_splits))
    wire = _interleave(a, a_splits, b, b_splits)
    assert wire.tolist() == [  # per rank r: a's segment r, then b's
        x for r in range(len(splits)) for x in a.split(a_splits)[r].tolist() + b.split(b_splits)[r].tolist()
    ]
    assert list(map(sum, zip(*[iter(_paired(a_splits, b_splits))] * 2))) == [x + y for x, y in splits]
    back_a, back_b = _deinterleave(wire, a_splits, b_splits)
    assert torch.equal(back_a, a) and torch.equal(back_b, b)
