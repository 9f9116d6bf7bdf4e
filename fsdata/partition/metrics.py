"""Balance metrics of a plan: per-rank cost, max/mean imbalance, its lower bound, per-rank sparsity, straggler %.

Vectorized over ranks (the simulator evaluates plans of up to 1,024 ranks every step). The single-batch
definitions (Eq. 1 sparsity, max/mean imbalance) are fsdata.metrics'; this module applies them to a plan.
"""

from __future__ import annotations

import numpy as np

from fsdata.metrics import imbalance
from fsdata.partition.base import ArrayLike, Plan, as_numpy

__all__ = ["imbalance", "lower_bound", "per_rank_cost", "per_rank_sparsity", "straggler_fraction"]


def per_rank_cost(plan: Plan, costs: ArrayLike) -> np.ndarray:
    """[W] total cost of the samples each rank receives."""
    c = as_numpy(costs, np.float64, "costs")
    return np.bincount(plan.destinations().numpy(), weights=c, minlength=plan.world_size)


def lower_bound(costs: ArrayLike, world_size: int) -> float:
    """The least max/mean any plan can reach: ``max(1, largest sample cost / mean per-rank cost)``.

    The rank holding the largest sample costs at least that sample, so no partitioner does better; "within 2% of
    the bound" is judged against this.
    """
    c = as_numpy(costs, np.float64, "costs")
    total = c.sum()
    if c.size == 0 or total <= 0:
        return 1.0
    return max(1.0, float(c.max()) * world_size / total)


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


def straggler_fraction(rank_times: ArrayLike, sync_time: float = 0.0) -> float:
    """Mean idle wait at the gradient synchronisation over the step time: ``mean(max - t_r) / (max + sync)``."""
    t = as_numpy(rank_times, np.float64, "rank_times")
    if t.size == 0:
        return 0.0
    step = t.max() + sync_time
    return float((t.max() - t).mean() / step) if step > 0 else 0.0
