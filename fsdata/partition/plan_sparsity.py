"""Per-rank sparsity of a plan: the paper's Eq. 1 of each rank's received batch, vectorized over ranks (the
planner, ``freescale simulate``, evaluates plans of up to 1,024 ranks every step). The single-batch definition is
fsdata.balance_measures.sparsity; the balance measures that only tests and benchmarks use (per-rank cost, the
lower bound, the straggler fraction) are benchmarks/plan_measures.py's.
"""

from __future__ import annotations

import numpy as np

from fsdata.partition.base import ArrayLike, Plan, as_numpy

__all__ = ["per_rank_sparsity"]


def per_rank_sparsity(plan: Plan, uih_lengths: ArrayLike) -> np.ndarray:
    """[W] Eq. 1 sparsity of each rank's received batch (0.0 for an empty batch or all-empty histories)."""
    lengths = as_numpy(uih_lengths, np.float64, "uih_lengths")
    dest = plan.destinations().numpy()
    w = plan.world_size
    counts = np.bincount(dest, minlength=w)
    sums = np.bincount(dest, weights=lengths, minlength=w)
    longest = np.zeros(w)
    np.maximum.at(longest, dest, lengths)
    padded = longest * counts
    out = np.zeros(w)
    np.divide(sums, padded, out=out, where=padded > 0)
    return np.where(padded > 0, 1.0 - out, 0.0)
