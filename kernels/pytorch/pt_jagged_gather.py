"""Twins of the segment-gathering ops: indexed permute and keyed transpose.

Both are "concatenate segments src[0], src[1], ... of a jagged tensor": indexed permute picks the segments with
the partition plan's order, keyed transpose picks them in batch-major order from a feature-major layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.offsets import lengths_to_offsets


def gather_segments(
    values: torch.Tensor, src_starts: torch.Tensor, out_offsets: torch.Tensor, output_size: Optional[int]
) -> torch.Tensor:
    """Rows ``values[src_starts[k] : src_starts[k] + len_k]`` for every k, concatenated (len_k from out_offsets)."""
    num_segments = src_starts.numel()
    total = int(out_offsets[-1]) if output_size is None else int(output_size)
    out_lengths = (out_offsets[1:] - out_offsets[:-1]).to(torch.int64)
    segment = torch.repeat_interleave(torch.arange(num_segments, device=values.device), out_lengths, output_size=total)
    position = torch.arange(total, device=values.device, dtype=torch.int64)
    src = src_starts.to(torch.int64)[segment] + position - out_offsets[:-1].to(torch.int64)[segment]
    return values.index_select(0, src)


def indexed_permute(
    values: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor, output_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = offsets[1:] - offsets[:-1]
    out_offsets = lengths_to_offsets(lengths[order], offsets.dtype)
    return gather_segments(values, offsets[:-1][order], out_offsets, output_size), out_offsets


def keyed_transpose(
    values: torch.Tensor, lengths: torch.Tensor, output_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    num_keys, batch_size = lengths.shape
    offsets = lengths_to_offsets(lengths.reshape(-1), torch.int64)
    # Segment (key f, sample b) sits at f * B + b in the feature-major layout; batch-major wants them b-major.
    order = torch.arange(num_keys * batch_size, device=lengths.device).view(num_keys, batch_size).t().reshape(-1)
    out_lengths = lengths.t().contiguous()
    out_offsets = lengths_to_offsets(out_lengths.reshape(-1), torch.int64)
    total = values.shape[0] if output_size is None else output_size
    return gather_segments(values, offsets[:-1][order], out_offsets, total), out_lengths
