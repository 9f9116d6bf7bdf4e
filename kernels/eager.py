"""The naive per-sample (per-segment, per-shard) PyTorch loops: what a stage looks like written the obvious way.

Kept only as the benchmark's baseline (paper section 4.2, Figure 7: its cost grows with the number of segments
and ranks). Every function returns exactly what the twin and the Triton kernel return, so the benchmark can
check the three agree; nothing in the training path calls these.
"""

from __future__ import annotations

from typing import Optional

import torch


def indexed_permute(values: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = offsets.tolist()
    pieces = []
    out_offsets = [0]
    for k in order.tolist():
        pieces.append(values[starts[k] : starts[k + 1]])
        out_offsets.append(out_offsets[-1] + starts[k + 1] - starts[k])
    out = torch.cat(pieces) if pieces else values[:0].clone()
    return out, torch.tensor(out_offsets, dtype=offsets.dtype, device=offsets.device)


def ranged_dispatch(ids: torch.Tensor, boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    send, splits, perms = [], [], []
    bounds = boundaries.tolist()
    for r in range(len(bounds) - 1):
        index = torch.nonzero((ids >= bounds[r]) & (ids < bounds[r + 1])).flatten()
        perms.append(index)
        send.append(ids[index])
        splits.append(index.numel())
    perm = torch.cat(perms)
    return torch.cat(send), torch.tensor(splits, dtype=torch.int64, device=ids.device), perm


def ranged_combine(values: torch.Tensor, perm: torch.Tensor, splits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One scatter per source shard (``splits``: the dispatch's per-shard counts; None: a single piece)."""
    out = torch.empty_like(values)
    sizes = [values.shape[0]] if splits is None else splits.tolist()
    start = 0
    for size in sizes:
        out[perm[start : start + size]] = values[start : start + size]
        start += size
    return out


def keyed_transpose(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_keys, batch_size = lengths.shape
    flat = lengths.reshape(-1).tolist()
    starts = [0]
    for n in flat:
        starts.append(starts[-1] + n)
    pieces = []
    for b in range(batch_size):
        for f in range(num_keys):
            k = f * batch_size + b
            pieces.append(values[starts[k] : starts[k + 1]])
    out = torch.cat(pieces) if pieces else values[:0].clone()
    return out, lengths.t().contiguous()


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    floating = values.is_floating_point()
    acc = torch.float32 if floating else torch.int64
    bounds = offsets.tolist()
    sums = [values[bounds[s] : bounds[s + 1]].to(acc).sum(0) for s in range(len(bounds) - 1)]
    if not sums:
        return torch.zeros((0,) + tuple(values.shape[1:]), dtype=values.dtype if floating else acc, device=values.device)
    out = torch.stack(sums)
    return out.to(values.dtype) if floating else out


def collision_mask(ids: torch.Tensor, other: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One membership test per segment of ``ids`` (``offsets``: e.g. per source rank; None: one segment)."""
    bounds = [0, ids.numel()] if offsets is None else offsets.tolist()
    pieces = [torch.isin(ids[bounds[s] : bounds[s + 1]], other) for s in range(len(bounds) - 1)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool, device=ids.device)
