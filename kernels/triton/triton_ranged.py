"""Triton ranged dispatch (a stable counting sort of ids by owning shard) and ranged combine (the inverse
scatter, an autograd.Function whose backward gathers the gradients back).

Dispatch runs in two passes over the ids, each program owning one block of BLOCK ids:
1. count: each id's shard by binary search over the boundaries; the block's per-shard counts go to a
   shard-major table counts[shard, block].
2. a prefix sum over that table (shard-major, so entry [s, b] minus block b's own count is where block b's
   ids of shard s start in the send buffer), then scatter (which also writes the splits): each id goes to its block's
   base for its shard plus its rank
   among the block's earlier ids of the same shard (a BLOCK x BLOCK comparison, which keeps the sort stable).
The cost is independent of the world size apart from the log2(W) search and the W x blocks table, unlike the
per-shard loop whose cost grows linearly with W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import as_bits, cdiv, fixed_code, new_output, search_steps, tile_shape
from kernels.triton.search import last_le

# From the sweep of scripts/tune_kernels.py: a 64 x 64 rank comparison per block, one warp.
DISPATCH_BLOCK = 64
DISPATCH_WARPS = 1
COMBINE_ELEMENTS_PER_PROGRAM = 4096
COMBINE_WARPS = 4


@triton.jit
def _shard_and_rank(ids_ptr, boundaries_ptr, n, world_size, steps, pid, BLOCK: tl.constexpr):
    idx = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < n
    ids = tl.load(ids_ptr + idx, mask=mask, other=0)
    # Largest shard s in [0, W-1] with boundaries[s] <= id (ids were validated to lie in the sharded range).
    lo = last_le(boundaries_ptr, ids.to(tl.int64), mask, world_size, steps)
    shard = tl.where(mask, lo, world_size)  # padding lanes get a shard of their own that nothing reads
    same = shard[:, None] == shard[None, :]
    lane = tl.arange(0, BLOCK)
    earlier = lane[None, :] < lane[:, None]
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    return idx, mask, ids, shard, rank, count


@triton.jit(**fixed_code("n", "num_blocks", "steps"))
def _dispatch_count_kernel(ids_ptr, boundaries_ptr, counts_ptr, n, world_size, num_blocks, steps, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, ids, shard, rank, count = _shard_and_rank(ids_ptr, boundaries_ptr, n, world_size, steps, pid, BLOCK)
    tl.store(counts_ptr + shard * num_blocks + pid, count, mask=mask & (rank == 0))


@triton.jit(**fixed_code("n", "num_blocks", "steps"))
def _dispatch_scatter_kernel(
    ids_ptr,
    boundaries_ptr,
    inclusive_ptr,
    send_ptr,
    perm_ptr,
    splits_ptr,
    n,
    world_size,
    num_blocks,
    steps,
    BLOCK: tl.constexpr,
    SPLIT_LANES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, ids, shard, rank, count = _shard_and_rank(ids_ptr, boundaries_ptr, n, world_size, steps, pid, BLOCK)
    # inclusive[s, b] - count = where block b's ids of shard s start (the exclusive prefix sum).
    base = tl.load(inclusive_ptr + shard * num_blocks + pid, mask=mask, other=0) - count
    dest = base + rank
    tl.store(send_ptr + dest, ids, mask=mask)
    tl.store(perm_ptr + dest, idx, mask=mask)
    if pid == 0:  # splits[s] = inclusive[s, last block] - inclusive[s - 1, last block]
        for s0 in range(0, world_size, SPLIT_LANES):
            s = s0 + tl.arange(0, SPLIT_LANES).to(tl.int64)
            smask = s < world_size
            end = tl.load(inclusive_ptr + s * num_blocks + num_blocks - 1, mask=smask, other=0)
            begin = tl.load(inclusive_ptr + s * num_blocks - 1, mask=smask & (s > 0), other=0)
            tl.store(splits_ptr + s, end - begin, mask=smask)


def ranged_dispatch(ids: torch.Tensor, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = ids.numel()
    world_size = boundaries.numel() - 1
    send = new_output((n,), ids.dtype, ids.device)
    perm = new_output((n,), torch.int64, ids.device)
    if n == 0:
        return send, torch.zeros(world_size, dtype=torch.int64, device=ids.device), perm
    splits = new_output((world_size,), torch.int64, ids.device)
    ids = ids.contiguous()
    boundaries = boundaries.contiguous()
    num_blocks = cdiv(n, DISPATCH_BLOCK)
    steps = search_steps(world_size)
    counts = torch.zeros(world_size * num_blocks, dtype=torch.int32, device=ids.device)
    grid = (num_blocks,)
    _dispatch_count_kernel[grid](
        ids, boundaries, counts, n, world_size, num_blocks, steps, BLOCK=DISPATCH_BLOCK, num_warps=DISPATCH_WARPS
    )
    inclusive = torch.cumsum(counts, 0, dtype=torch.int64)
    _dispatch_scatter_kernel[grid](
        ids,
        boundaries,
        inclusive,
        send,
        perm,
        splits,
        n,
        world_size,
        num_blocks,
        steps,
        BLOCK=DISPATCH_BLOCK,
        SPLIT_LANES=256,
        num_warps=DISPATCH_WARPS,
    )
    return send, splits, perm


@triton.jit(**fixed_code("n"))
def _permute_rows_kernel(
    src_ptr, out_ptr, perm_ptr, n, width, SCATTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """SCATTER: out[perm[j]] = src[j] (combine); else out[j] = src[perm[j]] (its backward)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_mask = rows < n
    target = tl.load(perm_ptr + rows, mask=row_mask, other=0)
    for d0 in range(0, width, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        mask = row_mask[:, None] & (cols < width)[None, :]
        if SCATTER:
            v = tl.load(src_ptr + rows[:, None] * width + cols[None, :], mask=mask)
            tl.store(out_ptr + target[:, None] * width + cols[None, :], v, mask=mask)
        else:
            v = tl.load(src_ptr + target[:, None] * width + cols[None, :], mask=mask)
            tl.store(out_ptr + rows[:, None] * width + cols[None, :], v, mask=mask)


def _permute_rows(values: torch.Tensor, perm: torch.Tensor, scatter: bool) -> torch.Tensor:
    out = new_output(values.shape, values.dtype, values.device)
    bits = as_bits(values)
    n, width = bits.shape
    if n == 0 or width == 0:
        return out
    block_r, block_d = tile_shape(width, COMBINE_ELEMENTS_PER_PROGRAM)
    _permute_rows_kernel[(cdiv(n, block_r),)](
        bits,
        out.view(bits.dtype).reshape(n, width),
        perm.contiguous(),
        n,
        width,
        SCATTER=scatter,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=COMBINE_WARPS,
    )
    return out


class _RangedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(perm)
        return _permute_rows(values, perm, scatter=True)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (perm,) = ctx.saved_tensors
        return _permute_rows(grad_out, perm, scatter=False), None


def ranged_combine(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return _RangedCombine.apply(values, perm)
