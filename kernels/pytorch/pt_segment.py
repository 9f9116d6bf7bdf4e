"""Twins of the segment reductions and of collision marking."""

from __future__ import annotations

import torch


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of every segment: integers accumulate (and return) in int64, floats accumulate in fp32 and return
    in the input dtype (bf16 sums of thousands of terms would otherwise lose most of their digits)."""
    num_segments = offsets.numel() - 1
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    segment = torch.repeat_interleave(
        torch.arange(num_segments, device=values.device), lengths, output_size=values.shape[0]
    )
    floating = values.is_floating_point()
    acc_dtype = torch.float32 if floating else torch.int64
    out = torch.zeros((num_segments,) + tuple(values.shape[1:]), dtype=acc_dtype, device=values.device)
    out.index_add_(0, segment, values.to(acc_dtype))
    return out.to(values.dtype) if floating else out


def collision_mask(ids: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.isin(ids, other)
