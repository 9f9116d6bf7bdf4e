"""How balanced a batch and a global step are: sparsity (the paper's Eq. 1, padding within a batch) and imbalance
(max/mean cost over the ranks).

These are measured the same way before and after balancing, so the two can be compared in one table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def sparsity(uih_lengths: torch.Tensor | np.ndarray) -> float:
    """Eq. 1: the share of padded items when every sample is padded to the batch's longest UIH.

    ``1 - sum(L) / (max(L) * B)``; 0.0 for an empty batch or a batch of empty histories. Host lengths (a CPU
    tensor is read through numpy, without a copy, and without dispatching torch ops on the training thread).
    """
    lengths = np.asarray(uih_lengths)
    if lengths.size == 0:
        return 0.0
    longest = int(lengths.max())
    if longest == 0:
        return 0.0
    return 1.0 - float(lengths.sum()) / (longest * lengths.size)


def imbalance(per_rank_cost: Sequence[float] | torch.Tensor) -> float:
    """max / mean of per-rank cost (1.0 is perfect balance; 1.0 also for an all-zero step)."""
    cost = torch.as_tensor(per_rank_cost, dtype=torch.float64)
    mean = float(cost.mean()) if cost.numel() else 0.0
    return float(cost.max()) / mean if mean > 0 else 1.0
