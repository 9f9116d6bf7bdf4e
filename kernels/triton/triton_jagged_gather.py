"""Triton indexed permute and keyed transpose: one copy kernel that concatenates chosen segments of a jagged
tensor.

Work is split by *output rows*, not by segment: UIH lengths are heavy-tailed (a few thousand typical, up to
21,000), so one program per segment would leave most SMs idle behind the longest ones (the intra-kernel
straggler of paper section 4.1). Each program copies a fixed block of output rows; the segment of each row is
found by a binary search over the output offsets, narrowed first to the segments that this block spans (one
``searchsorted`` over the block starts), so most blocks need zero or one search step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.pytorch.pt_jagged_gather import lengths_to_offsets
from kernels.triton.common import as_bits, cdiv, new_output, tile_shape

# Elements (rows x columns) copied per program; tuned on the H200 (see docs/bench/kernels.md).
ELEMENTS_PER_PROGRAM = 4096
NUM_WARPS = 8


@triton.jit
def _gather_segments_kernel(
    values_ptr,
    out_ptr,
    src_starts_ptr,
    out_offsets_ptr,
    block_segment_ptr,
    total,
    width,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_mask = rows < total
    # Segments of this block's first row and of the next block's first row bound every row's segment.
    lo_seg = tl.load(block_segment_ptr + pid)
    hi_seg = tl.load(block_segment_ptr + pid + 1)
    lo = tl.zeros([BLOCK_R], dtype=tl.int64) + lo_seg
    hi = tl.zeros([BLOCK_R], dtype=tl.int64) + hi_seg
    span = hi_seg - lo_seg
    while span > 0:
        mid = (lo + hi + 1) // 2
        start = tl.load(out_offsets_ptr + mid, mask=row_mask, other=0).to(tl.int64)
        right = start <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
        span = span // 2
    seg_out_start = tl.load(out_offsets_ptr + lo, mask=row_mask, other=0).to(tl.int64)
    src_rows = tl.load(src_starts_ptr + lo, mask=row_mask, other=0).to(tl.int64) + (rows - seg_out_start)
    for d0 in range(0, width, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        mask = row_mask[:, None] & (cols < width)[None, :]
        v = tl.load(values_ptr + src_rows[:, None] * width + cols[None, :], mask=mask)
        tl.store(out_ptr + rows[:, None] * width + cols[None, :], v, mask=mask)


def gather_segments(
    values: torch.Tensor, src_starts: torch.Tensor, out_offsets: torch.Tensor, total: int
) -> torch.Tensor:
    """Rows values[src_starts[k] : src_starts[k] + len_k] for k = 0.., concatenated; len_k from out_offsets."""
    out = new_output((total,) + tuple(values.shape[1:]), values.dtype, values.device)
    bits = as_bits(values)
    width = bits.shape[1]
    num_segments = src_starts.numel()
    if total == 0 or width == 0 or num_segments == 0:
        return out
    block_r, block_d = tile_shape(width, ELEMENTS_PER_PROGRAM)
    num_blocks = cdiv(total, block_r)
    block_starts = torch.arange(num_blocks + 1, device=values.device, dtype=torch.int64) * block_r
    block_starts[-1] = total - 1
    block_segment = torch.searchsorted(out_offsets.to(torch.int64), block_starts, right=True) - 1
    _gather_segments_kernel[(num_blocks,)](
        bits,
        out.view(bits.dtype).reshape(total, width),
        src_starts,
        out_offsets,
        block_segment,
        total,
        width,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
    return out


def indexed_permute(
    values: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor, output_size: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = offsets[1:] - offsets[:-1]
    out_offsets = lengths_to_offsets(lengths[order], offsets.dtype)
    total = int(out_offsets[-1]) if output_size is None else int(output_size)
    src_starts = offsets[:-1][order].contiguous()
    return gather_segments(values, src_starts, out_offsets, total), out_offsets


def keyed_transpose(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_keys, batch_size = lengths.shape
    offsets = lengths_to_offsets(lengths.reshape(-1), torch.int64)
    out_lengths = lengths.t().contiguous()
    out_offsets = lengths_to_offsets(out_lengths.reshape(-1), torch.int64)
    # Segment (sample b, key f) of the batch-major output starts at (f, b) of the feature-major input.
    src_starts = offsets[:-1].view(num_keys, batch_size).t().contiguous().reshape(-1)
    return gather_segments(values, src_starts, out_offsets, values.shape[0]), out_lengths
