"""Triton ranged dispatch (a stable counting sort of ids by owning shard) and ranged combine (the inverse
scatter, an autograd.Function whose backward gathers the gradients back).

Dispatch is a two-pass counting sort over tiles of ``TILE * TILES_PER_PROGRAM`` ids per program:
1. count: each id's shard by binary search over the boundaries (kept in a scratch array for pass 2); each tile
   adds its per-shard counts to the program's column of a shard-major table ``counts[shard, program]`` and to
   the splits (integer atomics: the sums do not depend on their order).
2. one cumsum over the table, laid out with a leading zero so that entry ``[s, p]`` is the exclusive prefix:
   where program p's ids of shard s start in the send buffer.
3. scatter: the program walks its tiles in order; an id goes to its shard's running start plus its rank among
   the tile's earlier ids of the same shard (a TILE x TILE comparison: the sort stays stable), then the
   tile's counts advance the running starts (the program's own column of the table, so no other program reads
   them; a barrier orders the tiles).
The table has W x programs entries, programs = N / 1024: small next to the ids even at W = 512, and the cost
per id is independent of W apart from the log2(W) search, unlike the per-shard loop whose cost grows with W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import as_bits, cdiv, new_output, search_steps, tile_shape
from kernels.triton.search import last_le

DISPATCH_TILE = 64  # a 64 x 64 rank comparison per tile (larger tiles spill registers on the H200)
DISPATCH_TILES_PER_PROGRAM = 16
DISPATCH_WARPS = 2
COMBINE_ELEMENTS_PER_PROGRAM = 4096
COMBINE_WARPS = 4


@triton.jit
def _tile_counts(shard, TILE: tl.constexpr):
    """Per lane: its rank among the tile's earlier lanes of the same shard, and the shard's count in the tile."""
    same = shard[:, None] == shard[None, :]
    lane = tl.arange(0, TILE)
    earlier = lane[None, :] < lane[:, None]
    return tl.sum((same & earlier).to(tl.int32), axis=1), tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _dispatch_count_kernel(
    ids_ptr, boundaries_ptr, shard_ptr, counts_ptr, splits_ptr, n, world_size, num_programs, steps,
    TILE: tl.constexpr, TILES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    for t in range(TILES):
        idx = (pid * TILES + t) * TILE + tl.arange(0, TILE).to(tl.int64)
        mask = idx < n
        ids = tl.load(ids_ptr + idx, mask=mask, other=0)
        # Largest shard s in [0, W-1] with boundaries[s] <= id (ids were validated to lie in the sharded range).
        shard = tl.where(mask, last_le(boundaries_ptr, ids.to(tl.int64), mask, world_size, steps), world_size)
        tl.store(shard_ptr + idx, shard.to(tl.int32), mask=mask)
        rank, count = _tile_counts(shard, TILE)
        first = mask & (rank == 0)  # one lane per shard present in the tile adds the tile's count
        tl.atomic_add(counts_ptr + 1 + shard * num_programs + pid, count.to(tl.int64), mask=first)
        tl.atomic_add(splits_ptr + shard, count.to(tl.int64), mask=first)


@triton.jit
def _dispatch_scatter_kernel(
    ids_ptr, shard_ptr, start_ptr, send_ptr, perm_ptr, n, num_programs, TILE: tl.constexpr, TILES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    for t in range(TILES):
        idx = (pid * TILES + t) * TILE + tl.arange(0, TILE).to(tl.int64)
        mask = idx < n
        shard = tl.load(shard_ptr + idx, mask=mask, other=-1).to(tl.int64)
        rank, count = _tile_counts(shard, TILE)
        slot = start_ptr + shard * num_programs + pid  # this program's running start of the shard
        dest = tl.load(slot, mask=mask, other=0) + rank
        tl.store(send_ptr + dest, tl.load(ids_ptr + idx, mask=mask), mask=mask)
        tl.store(perm_ptr + dest, idx, mask=mask)
        tl.debug_barrier()  # every lane has read the running starts before they advance
        tl.store(slot, dest - rank + count, mask=mask & (rank == 0))
        tl.debug_barrier()  # the next tile reads the advanced starts


def ranged_dispatch(ids: torch.Tensor, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = ids.numel()
    world_size = boundaries.numel() - 1
    send = new_output((n,), ids.dtype, ids.device)
    perm = new_output((n,), torch.int64, ids.device)
    if n == 0:
        return send, torch.zeros(world_size, dtype=torch.int64, device=ids.device), perm
    ids = ids.contiguous()
    boundaries = boundaries.contiguous()
    per_program = DISPATCH_TILE * DISPATCH_TILES_PER_PROGRAM
    num_programs = cdiv(n, per_program)
    # One zeroed buffer: the splits, then a leading 0 and the count table (its cumsum is the exclusive prefix).
    zeros = torch.zeros(world_size + 1 + world_size * num_programs, dtype=torch.int64, device=ids.device)
    splits, counts = zeros[:world_size], zeros[world_size:]
    shard = torch.empty(n, dtype=torch.int32, device=ids.device)
    grid = (num_programs,)
    meta = dict(TILE=DISPATCH_TILE, TILES=DISPATCH_TILES_PER_PROGRAM, num_warps=DISPATCH_WARPS)
    _dispatch_count_kernel[grid](ids, boundaries, shard, counts, splits, n, world_size, num_programs,
                                 search_steps(world_size), **meta)
    start = torch.cumsum(counts[:-1], 0)  # start[s * programs + p] = ids of earlier (shard, program) cells
    _dispatch_scatter_kernel[grid](ids, shard, start, send, perm, n, num_programs, **meta)
    return send, splits, perm


@triton.jit
def _permute_rows_kernel(src_ptr, out_ptr, perm_ptr, n, width, SCATTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
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
        bits, out.view(bits.dtype).reshape(n, width), perm.contiguous(), n, width,
        SCATTER=scatter, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=COMBINE_WARPS,
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
