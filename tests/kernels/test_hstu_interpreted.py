"""The Triton HSTU attention, run by Triton's interpreter on CPU, against its per-sample twin: random jagged
batches with empty and one-token samples, targets, windows, rab with ordered and unordered timestamps (the
bucket-weight gradient's run-end atomics assume nothing about order), both normalizations.
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

from tests.kernels.hstu_cases import Case, assert_matches_twin  # noqa: E402


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
