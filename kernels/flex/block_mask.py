"""The sparsity of a jagged attention as FlexAttention's block mask, built from the offsets in O(blocks).

Tokens of a batch are packed ``[N, heads, dim]``; sample ``s`` owns rows ``[offsets[s], offsets[s + 1])``. A query
attends only to keys of its own sample: all of them (``causal=False``: a candidate over its sample's UIH, where
queries and keys have offsets of their own) or those at or before it (``causal=True``: one set of offsets).

FlexAttention skips a (query block, key block) pair unless the block mask lists it, as *full* (every pair in it
attends: no mask evaluated) or *partial* (the mask function decides per pair). ``create_block_mask`` finds both
by evaluating the mask over all N^2 pairs, which at hundreds of thousands of tokens costs more than the attention.
Here the lists come from the offsets directly: the key blocks a query block needs are one contiguous range (from
the first key of its first sample to the last key its last sample may see), and the full ones are a contiguous
range inside it (only when the query block lies within one sample), so each row is two ranges, computed for all
rows at once with a few vectorized ops. The transposed lists (the query blocks of each key block, used by the
backward) come the same way with rows and columns swapped; for ``causal`` that is the anti-causal direction.

Full blocks get lists of their own by default (``separate_full_blocks=True``, create_block_mask's layout), so the
mask function runs only on the partial blocks at the samples' edges and the diagonal. FlexAttention's kernels read
both lists with the partial list's strides, so both are laid out at one width. ``separate_full_blocks=False``
lists every needed block as partial (one contiguous range per row): the same numbers, the mask evaluated on every
pair.

With ``causal=False``, a sample without queries (or without keys) between two that have both may leave its key
(query) blocks inside a partial range: the mask function masks them, so results are exact, and the lists equal
``create_block_mask``'s (partial and full together, when not separated) whenever every sample has at least one
query and one key. With ``causal=True`` they equal them always.

Tensors are built on the host (int32, FlexAttention's index type) so the loader can build them beside the
training step; :class:`JaggedBlockMask` moves to the device with the batch and becomes a ``BlockMask`` there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch

BLOCK_SIZE = 128
"""FlexAttention's default sparse block; its kernels tile inside it."""

_PAD_QUERY, _PAD_KEY = -1, -2  # sample ids of the rows past N that fill the last block: never equal to each other


def _ranges(
    row_offsets: torch.Tensor,
    col_offsets: torch.Tensor,
    num_rows: int,
    direction: str,
    block: int,
    separate_full: bool = True,
):
    """Per row block: the ``[lo, hi]`` range of column blocks it needs and the ``[flo, fhi]`` part of it that is
    full (empty: ``flo = hi + 1``). ``direction``: ``none``, ``causal`` (row >= column) or ``anticausal``."""
    num_row_blocks = -(-num_rows // block)
    r = torch.arange(num_row_blocks, dtype=torch.int64)
    first_row = r * block
    last_row = torch.clamp((r + 1) * block, max=num_rows) - 1
    s_first = torch.searchsorted(row_offsets, first_row, right=True) - 1
    s_last = torch.searchsorted(row_offsets, last_row, right=True) - 1
    lo = torch.div(col_offsets[s_first], block, rounding_mode="floor")
    hi = torch.div(col_offsets[s_last + 1] - 1, block, rounding_mode="floor")
    hi = torch.where(col_offsets[s_last + 1] > col_offsets[s_first], hi, lo - 1)  # its samples have no columns
    flo = torch.div(col_offsets[s_first] + block - 1, block, rounding_mode="floor")
    fhi = torch.div(col_offsets[s_first + 1], block, rounding_mode="floor") - 1
    diagonal_full = int(block == 1)  # a diagonal pair is partial (its upper triangle masked) unless it is one pair
    if direction == "causal":
        hi, fhi = torch.minimum(hi, r), torch.minimum(fhi, r - 1 + diagonal_full)
    elif direction == "anticausal":
        lo, flo = torch.maximum(lo, r), torch.maximum(flo, r + 1 - diagonal_full)
    # A full pair needs every row of the row block in one sample (and present: the last block's missing rows
    # count as masked, as create_block_mask pads them).
    single = (s_first == s_last) & ((r + 1) * block <= num_rows)
    has_full = single & (fhi >= flo) & (hi >= lo) & separate_full
    flo = torch.where(has_full, flo, hi + 1)
    fhi = torch.where(has_full, fhi, hi)
    return lo, hi, flo, fhi


def _lists(lo, hi, flo, fhi, num_cols: int, block: int, separate_full: bool) -> tuple[Optional[torch.Tensor], ...]:
    """(num, indices, full_num, full_indices) in FlexAttention's layout [1, 1, rows(, width)], int32 (the full ones
    None unless ``separate_full``). The partial blocks are ``[lo, flo)`` then ``(fhi, hi]``. The width is the longest
    list plus one, not the number of column blocks: the kernels read the lists through their strides, and may read
    one entry past a row's count."""
    lo, hi, flo, fhi = (t.to(torch.int32) for t in (lo, hi, flo, fhi))
    last_col = max(-(-num_cols // block) - 1, 0)

    def indices(width: int, start: torch.Tensor, jump_at=None, jump_to=None) -> torch.Tensor:
        """Row i: ``start[i], start[i] + 1, ...``, continuing at ``jump_to[i]`` from entry ``jump_at[i]``."""
        k = torch.arange(width + 1, dtype=torch.int32)
        if jump_at is None:
            out = start[:, None] + k
        else:
            out = torch.where(k < jump_at[:, None], start[:, None], (jump_to - jump_at)[:, None]).add_(k)
        return out.clamp_(0, last_col)[None, None]

    widest = lambda t: int(t.max()) if t.numel() else 0  # noqa: E731
    if not separate_full:  # one contiguous range per row
        count = torch.clamp(hi - lo + 1, min=0)
        return count[None, None].contiguous(), indices(widest(count), lo), None, None
    n_pre = torch.clamp(flo - lo, min=0)
    partial = n_pre + torch.clamp(hi - fhi, min=0)
    full = torch.clamp(fhi - flo + 1, min=0)
    # One width for both lists: FlexAttention's kernels address the full list with the partial list's strides.
    width = max(widest(partial), widest(full))
    return (
        partial[None, None].contiguous(),
        indices(width, lo, n_pre, fhi + 1),
        full[None, None].contiguous(),
        indices(width, flo),
    )


def _sample_ids(offsets: torch.Tensor, num_rows: int, block: int, pad: int) -> torch.Tensor:
    """Each row's sample (int32), padded to whole blocks with ``pad`` so the mask function never reads past N.
    A running count of the sample starts passed (cheaper than a repeat_interleave of the lengths)."""
    padded = -(-num_rows // block) * block
    starts = torch.zeros(padded + 1, dtype=torch.int32)
    starts.index_add_(0, offsets[1:-1], torch.ones(offsets.numel() - 2, dtype=torch.int32))
    ids = torch.cumsum(starts[:padded], 0, dtype=torch.int32)
    ids[num_rows:] = pad
    return ids


@dataclass
class JaggedBlockMask:
    """The block mask of one jagged attention, as plain tensors (pin, move, send like a batch's fields)."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: Optional[torch.Tensor]
    full_kv_indices: Optional[torch.Tensor]
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: Optional[torch.Tensor]
    full_q_indices: Optional[torch.Tensor]
    q_sample: torch.Tensor
    """Each query row's sample, int32, padded to whole blocks."""
    kv_sample: torch.Tensor
    num_q: int
    num_kv: int
    causal: bool
    block_size: int = BLOCK_SIZE

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def _map(self, fn) -> "JaggedBlockMask":
        return dataclasses.replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "JaggedBlockMask":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "JaggedBlockMask":
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream) -> None:
        for t in self.tensors().values():
            t.record_stream(stream)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def block_mask(self):
        """FlexAttention's ``BlockMask`` over these tensors (no copy, no computation)."""
        from torch.nn.attention.flex_attention import BlockMask

        q_sample, kv_sample = self.q_sample, self.kv_sample
        if self.causal:

            def mask_mod(b, h, q_idx, kv_idx):
                return (q_sample[q_idx] == kv_sample[kv_idx]) & (q_idx >= kv_idx)
        else:

            def mask_mod(b, h, q_idx, kv_idx):
                return q_sample[q_idx] == kv_sample[kv_idx]

        return BlockMask(
            (self.num_q, self.num_kv),
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            self.q_num_blocks,
            self.q_indices,
            self.full_q_num_blocks,
            self.full_q_indices,
            BLOCK_SIZE=(self.block_size, self.block_size),
            mask_mod=mask_mod,
        )


def build_block_mask(
    q_offsets: torch.Tensor,
    kv_offsets: Optional[torch.Tensor] = None,
    *,
    causal: bool,
    block_size: int = BLOCK_SIZE,
    separate_full_blocks: bool = True,
) -> JaggedBlockMask:
    """The block mask of queries packed by ``q_offsets`` over keys packed by ``kv_offsets`` (host int tensors of
    B + 1 entries each, from 0 to the number of rows; ``causal`` takes one set of offsets). Full blocks get lists
    of their own only with ``separate_full_blocks`` (module docstring)."""
    if kv_offsets is None:
        kv_offsets = q_offsets
    if causal and kv_offsets is not q_offsets and not torch.equal(kv_offsets, q_offsets):
        raise ValueError("build_block_mask: causal attention takes one set of offsets (queries and keys alike)")
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"build_block_mask: {q_offsets.numel() - 1} query samples but {kv_offsets.numel() - 1} key samples"
        )
    if block_size < 1:
        raise ValueError(f"build_block_mask: block_size must be >= 1, got {block_size}")
    q_offsets = q_offsets.to(device="cpu", dtype=torch.int64)
    kv_offsets = kv_offsets.to(device="cpu", dtype=torch.int64)
    num_q, num_kv = int(q_offsets[-1]), int(kv_offsets[-1])
    split = separate_full_blocks
    forward = _lists(
        *_ranges(q_offsets, kv_offsets, num_q, "causal" if causal else "none", block_size, split),
        num_kv,
        block_size,
        split,
    )
    backward = _lists(
        *_ranges(kv_offsets, q_offsets, num_kv, "anticausal" if causal else "none", block_size, split),
        num_q,
        block_size,
        split,
    )
    q_sample = _sample_ids(q_offsets, num_q, block_size, _PAD_QUERY)
    if causal:
        kv_sample = q_sample.clone()
        kv_sample[num_kv:] = _PAD_KEY
    else:
        kv_sample = _sample_ids(kv_offsets, num_kv, block_size, _PAD_KEY)
    return JaggedBlockMask(
        *forward,
        *backward,
        q_sample=q_sample,
        kv_sample=kv_sample,
        num_q=num_q,
        num_kv=num_kv,
        causal=causal,
        block_size=block_size,
    )
