"""Triton indexed permute and keyed transpose: one copy kernel that concatenates chosen segments of a jagged
tensor.

Work is split by *output rows*, not by segment: UIH lengths are heavy-tailed (a few thousand typical, up to
21,000), so one program per segment would leave most SMs idle behind the longest ones (the intra-kernel
straggler of paper section 4.1). Each program copies a fixed block of output rows; the segment of each row is
found by a binary search over the output offsets, narrowed first to the segments that this block spans (a
small kernel searches every block's first row once), so most blocks need zero or one search step.

Host overhead matters as much as the copy at these sizes (a local batch is tens of MB, the launches cost tens
of microseconds each): the per-segment metadata (lengths in output order, source starts) is one small kernel,
the prefix sum one in-place cumsum, so an op is four launches (plus a host sync for the output size when the
caller does not pass it).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.triton.common import as_bits, cdiv, fixed_code, new_output, search_steps, tile_shape
from kernels.triton.search import last_le

# Elements (rows x columns) copied per program; from the sweep of scripts/tune_kernels.py.
ELEMENTS_PER_PROGRAM = 1024
NUM_WARPS = 4


@triton.jit(**fixed_code("total"))
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


@triton.jit(**fixed_code("num_blocks", "num_segments", "total", "steps"))
def _block_segment_kernel(
    out_offsets_ptr,
    block_segment_ptr,
    num_blocks,
    num_segments,
    total,
    steps,
    BLOCK_R: tl.constexpr,
    LANES: tl.constexpr,
):
    """block_segment[b] = segment of output row b * BLOCK_R (the last entry: of the last row)."""
    b = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES).to(tl.int64)
    mask = b <= num_blocks
    row = tl.minimum(b * BLOCK_R, total - 1)
    lo = last_le(out_offsets_ptr, row, mask, num_segments, steps)
    tl.store(block_segment_ptr + b, lo, mask=mask)


@triton.jit(**fixed_code("num_picked"))
def _permute_meta_kernel(offsets_ptr, order_ptr, out_offsets_ptr, src_starts_ptr, num_picked, LANES: tl.constexpr):
    """out_offsets[1 + k] = length of segment order[k] (prefix-summed afterwards), src_starts[k] = its start."""
    k = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES).to(tl.int64)
    mask = k < num_picked
    seg = tl.load(order_ptr + k, mask=mask, other=0)
    start = tl.load(offsets_ptr + seg, mask=mask, other=0)
    end = tl.load(offsets_ptr + seg + 1, mask=mask, other=0)
    tl.store(src_starts_ptr + k, start.to(tl.int64), mask=mask)
    tl.store(out_offsets_ptr + 1 + k, end - start, mask=mask)
    tl.store(out_offsets_ptr + k, tl.zeros([LANES], dtype=end.dtype), mask=k == 0)


@triton.jit(**fixed_code("batch_size"))
def _transpose_meta_kernel(
    lengths_ptr,
    in_offsets_ptr,
    out_lengths_ptr,
    out_offsets_ptr,
    src_starts_ptr,
    num_keys,
    batch_size,
    LANES: tl.constexpr,
):
    """Output segment j = b * F + f is input segment f * B + b: its length and input start."""
    j = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES).to(tl.int64)
    mask = j < num_keys * batch_size
    b = j // num_keys
    f = j - b * num_keys
    src = f * batch_size + b
    length = tl.load(lengths_ptr + src, mask=mask, other=0)
    tl.store(out_lengths_ptr + j, length, mask=mask)
    tl.store(out_offsets_ptr + 1 + j, length.to(tl.int64), mask=mask)
    tl.store(out_offsets_ptr + j, tl.zeros([LANES], dtype=tl.int64), mask=j == 0)
    tl.store(src_starts_ptr + j, tl.load(in_offsets_ptr + src, mask=mask, other=0), mask=mask)


META_LANES = 1024


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
    block_segment = torch.empty(num_blocks + 1, dtype=torch.int64, device=values.device)
    _block_segment_kernel[(cdiv(num_blocks + 1, META_LANES),)](
        out_offsets,
        block_segment,
        num_blocks,
        num_segments,
        total,
        search_steps(num_segments),
        BLOCK_R=block_r,
        LANES=META_LANES,
    )
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
    num_picked = order.numel()
    out_offsets = new_output((num_picked + 1,), offsets.dtype, offsets.device)
    src_starts = torch.empty(num_picked, dtype=torch.int64, device=offsets.device)
    if num_picked == 0:
        out_offsets.zero_()
    else:
        _permute_meta_kernel[(cdiv(num_picked, META_LANES),)](
            offsets.contiguous(), order.contiguous(), out_offsets, src_starts, num_picked, LANES=META_LANES
        )
        out_offsets.cumsum_(0)
    total = int(out_offsets[-1]) if output_size is None else int(output_size)
    return gather_segments(values, src_starts, out_offsets, total), out_offsets


def keyed_transpose(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_keys, batch_size = lengths.shape
    count = num_keys * batch_size
    device = lengths.device
    out_lengths = new_output((batch_size, num_keys), lengths.dtype, device)
    out_offsets = torch.empty(count + 1, dtype=torch.int64, device=device)
    src_starts = torch.empty(count, dtype=torch.int64, device=device)
    if count == 0:
        return values.clone(), out_lengths
    lengths = lengths.contiguous()
    in_offsets = torch.cumsum(lengths.view(-1), 0, dtype=torch.int64) - lengths.view(-1)  # exclusive
    _transpose_meta_kernel[(cdiv(count, META_LANES),)](
        lengths, in_offsets, out_lengths, out_offsets, src_starts, num_keys, batch_size, LANES=META_LANES
    )
    out_offsets.cumsum_(0)
    return gather_segments(values, src_starts, out_offsets, values.shape[0]), out_lengths
