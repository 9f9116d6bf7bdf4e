"""The naive per-sample PyTorch loops: what an op looks like written the obvious way, one sample at a time
(and, where ids go to row-wise shards, one shard at a time within the sample).

Kept only as the benchmark's baseline (paper section 4.2, Figure 7: its cost grows with the number of segments
and ranks). Every function returns exactly what the twin and the Triton kernel return, so the benchmark can
check the three agree; nothing in the training path calls these.
"""

from __future__ import annotations

from typing import Optional

import torch


def indexed_permute(
    values: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = offsets.tolist()
    pieces = []
    out_offsets = [0]
    for k in order.tolist():
        pieces.append(values[starts[k] : starts[k + 1]])
        out_offsets.append(out_offsets[-1] + starts[k + 1] - starts[k])
    out = torch.cat(pieces) if pieces else values[:0].clone()
    return out, torch.tensor(out_offsets, dtype=offsets.dtype, device=offsets.device)


def ranged_dispatch(
    ids: torch.Tensor, boundaries: torch.Tensor, offsets: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample (``offsets``: the samples' id ranges; None: one sample), per shard: pick the sample's ids
    that the shard owns, append them to the shard's piece of the send buffer."""
    bounds = boundaries.tolist()
    world_size = len(bounds) - 1
    starts = [0, ids.numel()] if offsets is None else offsets.tolist()
    pieces: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for s in range(len(starts) - 1):
        sample = ids[starts[s] : starts[s + 1]]
        for r in range(world_size):
            pieces[r].append(starts[s] + torch.nonzero((sample >= bounds[r]) & (sample < bounds[r + 1])).flatten())
    empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
    per_shard = [torch.cat(p) if p else empty for p in pieces]
    perm = torch.cat(per_shard) if per_shard else empty
    splits = torch.tensor([p.numel() for p in per_shard], dtype=torch.int64, device=ids.device)
    return ids[perm], splits, perm


def ranged_combine(
    values: torch.Tensor,
    perm: torch.Tensor,
    splits: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per sample (``offsets``: the samples' rows of the output; None: one sample), per source shard
    (``splits``: the dispatch's per-shard counts; None: one shard): scatter the sample's rows that came back
    from the shard to where they belong."""
    if offsets is not None and splits is None:
        raise ValueError("eager ranged_combine: walking samples (offsets) needs the per-shard splits too")
    out = torch.empty_like(values)
    sizes = [values.shape[0]] if splits is None else splits.tolist()
    bounds = [0, values.shape[0]] if offsets is None else offsets.tolist()
    shard_starts = [0]
    for size in sizes:
        shard_starts.append(shard_starts[-1] + size)
    # Within a shard's block the rows keep batch order, so each sample's rows are one contiguous run of it.
    cuts = [
        torch.searchsorted(perm[a:b], torch.tensor(bounds, device=perm.device)).tolist()
        for a, b in zip(shard_starts[:-1], shard_starts[1:])
    ]
    for s in range(len(bounds) - 1):
        for r, start in enumerate(shard_starts[:-1]):
            a, b = start + cuts[r][s], start + cuts[r][s + 1]
            if b > a:
                out[perm[a:b]] = values[a:b]
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
    """Sample by sample: each row (e.g. one sample's length in plan order) is added to its segment's total
    (e.g. its destination rank's send split)."""
    floating = values.is_floating_point()
    acc = torch.float32 if floating else torch.int64
    bounds = offsets.tolist()
    out = torch.zeros((len(bounds) - 1,) + tuple(values.shape[1:]), dtype=acc, device=values.device)
    for s in range(len(bounds) - 1):
        for row in range(bounds[s], bounds[s + 1]):
            out[s] += values[row].to(acc)
    return out.to(values.dtype) if floating else out


def collision_mask(ids: torch.Tensor, other: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One membership test per segment of ``ids`` (``offsets``: e.g. per source rank; None: one segment)."""
    bounds = [0, ids.numel()] if offsets is None else offsets.tolist()
    pieces = [torch.isin(ids[bounds[s] : bounds[s + 1]], other) for s in range(len(bounds) - 1)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool, device=ids.device)
