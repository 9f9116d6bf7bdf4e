"""Balance measures of a plan that tests and benchmarks judge partitioners by: per-rank cost, the lower bound of
max/mean any plan can reach, and the straggler fraction of a step's rank times.

Vectorized over ranks. The single-batch definitions (Eq. 1 sparsity, max/mean imbalance) are
fsdata.balance_measures'; the per-rank sparsity of a plan, which ``freescale simulate`` reports, is
fsdata.partition.plan_sparsity's.
"""

from __future__ import annotations

import numpy as np

from fsdata.partition.base import ArrayLike, Plan, as_numpy

__all__ = ["lower_bound", "per_rank_cost", "straggler_fraction"]


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


def straggler_fraction(rank_times: ArrayLike, sync_time: float = 0.0) -> float:
    """Mean idle wait at the gradient synchronisation over the step time: ``mean(max - t_r) / (max + sync)``."""
    t = as_numpy(rank_times, np.float64, "rank_times")
    if t.size == 0:
        return 0.0
    step = t.max() + sync_time
    return float((t.max() - t).mean() / step) if step > 0 else 0.0
