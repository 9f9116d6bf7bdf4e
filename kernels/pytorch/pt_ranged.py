"""Twins of ranged dispatch and ranged combine: the two ends of an ID or embedding AllToAll over row-wise
sharded tables (shard r owns rows [boundaries[r], boundaries[r+1]))."""

from __future__ import annotations

import torch


def shard_of(ids: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Owning shard of every id (int64)."""
    return torch.searchsorted(boundaries, ids, right=True) - 1


def ranged_dispatch(ids: torch.Tensor, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    world_size = boundaries.numel() - 1
    shard = shard_of(ids, boundaries)
    # A stable sort keeps each shard's ids in their original (batch-major) order, as the receiver expects.
    _, perm = torch.sort(shard, stable=True)
    splits = torch.bincount(shard, minlength=world_size).to(torch.int64)
    return ids.index_select(0, perm), splits, perm


def ranged_combine(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    # index_copy is differentiable in its source: the backward gathers grad_out[perm], the scatter's inverse.
    return torch.empty_like(values).index_copy(0, perm, values)
