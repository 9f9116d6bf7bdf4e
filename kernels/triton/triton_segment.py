"""Triton segment sum and collision marking.

segment_sum: one program per (segment, column block) that walks its segment in row blocks, accumulating in
fp32 (floats) or int64 (integers); segments here are few and even (per-rank ranges of a plan), so the simple
mapping suffices.
collision_mask: ``other`` is sorted once (torch.sort), then every id is looked up by a binary search; a sort of
``other`` plus one pass over ``ids`` instead of the sort of both that a generic membership test does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, fixed_code, flat_width, new_output, next_power_of_2, search_steps
from kernels.triton.search import last_le

SEGMENT_BLOCK_R = 64
SEGMENT_MAX_BLOCK_D = 64
MASK_BLOCK = 1024


@triton.jit
def _segment_sum_kernel(
    values_ptr, offsets_ptr, out_ptr, width, IS_FLOAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    seg = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    col_mask = cols < width
    start = tl.load(offsets_ptr + seg).to(tl.int64)
    end = tl.load(offsets_ptr + seg + 1).to(tl.int64)
    if IS_FLOAT:
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.int64)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows < end)[:, None] & col_mask[None, :]
        v = tl.load(values_ptr + rows[:, None] * width + cols[None, :], mask=mask, other=0)
        acc += v.to(acc.dtype)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + seg * width + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    num_segments = offsets.numel() - 1
    floating = values.is_floating_point()
    out_dtype = values.dtype if floating else torch.int64
    out = new_output((num_segments,) + tuple(values.shape[1:]), out_dtype, values.device)
    flat = values.contiguous().reshape(values.shape[0], flat_width(values))
    width = flat.shape[1]
    if num_segments == 0 or width == 0:
        return out
    block_d = min(next_power_of_2(width), SEGMENT_MAX_BLOCK_D)
    _segment_sum_kernel[(num_segments, cdiv(width, block_d))](
        flat,
        offsets.contiguous(),
        out.view(num_segments, width),
        width,
        IS_FLOAT=floating,
        BLOCK_R=SEGMENT_BLOCK_R,
        BLOCK_D=block_d,
    )
    return out


@triton.jit(**fixed_code("n", "m", "steps"))
def _member_kernel(ids_ptr, sorted_ptr, out_ptr, n, m, steps, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < n
    ids = tl.load(ids_ptr + idx, mask=mask, other=0)
    # Largest position p in [0, m-1] with sorted[p] <= id; the id is present iff sorted[p] == id.
    lo = last_le(sorted_ptr, ids.to(tl.int64), mask, m, steps)
    found = tl.load(sorted_ptr + lo, mask=mask, other=0) == ids
    tl.store(out_ptr + idx, found.to(tl.uint8), mask=mask)


def collision_mask(ids: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    if other.numel() == 0:
        return torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
    out = new_output((ids.numel(),), torch.bool, ids.device)
    if ids.numel() == 0:
        return out
    sorted_other = torch.sort(other).values
    m = sorted_other.numel()
    _member_kernel[(cdiv(ids.numel(), MASK_BLOCK),)](
        ids.contiguous(),
        sorted_other,
        out.view(torch.uint8),
        ids.numel(),
        m,
        search_steps(m),
        BLOCK=MASK_BLOCK,
    )
    return out
