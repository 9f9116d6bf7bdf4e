"""Twins of the segment reductions and of collision marking."""

from __future__ import annotations

import torch


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of every segment: integers accumulate (and return) in int64, floats accumulate in fp32 and return
    in the input dtype (bf16 sums of thousands of terms would otherwise lose most of their digits)."""
    if not values.is_floating_point():  # exact: differences of one running sum (no per-element segment ids)
        running = torch.zeros((values.shape[0] + 1,) + tuple(values.shape[1:]), dtype=torch.int64, device=values.device)
        torch.cumsum(values.to(torch.int64), 0, out=running[1:])
        offsets = offsets.to(torch.int64)
        return running[offsets[1:]] - running[offsets[:-1]]
    num_segments = offsets.numel() - 1
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    segment = torch.repeat_interleave(
        torch.arange(num_segments, device=values.device), lengths, output_size=values.shape[0]
    )
    out = torch.zeros((num_segments,) + tuple(values.shape[1:]), dtype=torch.float32, device=values.device)
    out.index_add_(0, segment, values.to(torch.float32))
    return out.to(values.dtype)


def collision_mask(ids: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.isin(ids, other)
