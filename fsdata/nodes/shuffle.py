"""Stage III of Algorithm 1: one AllToAll of whole samples per the plan, giving the balanced local batch.

Every split size follows locally from the gathered lengths and the plan, so the exchange needs no size
AllToAll first. All fields of a sample travel in one int64 buffer (float fields as their 32-bit patterns), laid
out per destination field by field:

    [sample_ids | user_ids | dense | uih_item_ids | uih_action_types? | uih_timestamps? | labels | content_ids]

The lengths themselves (UIH, candidates, content) are not sent: the receiver rebuilds every offset from the
gathered lengths. The sender groups its samples by destination in plan order with the jagged indexed permute;
the receiver gets them grouped by source rank, and permutes once more into plan order only when the plan asks
for an order that is not source-major (the built-in partitioners never do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torchdata.nodes import BaseNode

from fscomm.timing import Timer
from fsdata.batch import Batch, lengths_to_offsets
from fsdata.metrics import imbalance, sparsity
from fsdata.nodes.async_stage import AsyncStage
from fsdata.nodes.partition_stage import Planned
from kernels import ops


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """Flat int64 words of a tensor (int64 as is; float32 by its bit pattern, widened)."""
    if t.dtype == torch.int64:
        return t.reshape(-1)
    if t.dtype == torch.float32:
        return t.reshape(-1).view(torch.int32).to(torch.int64)
    raise ValueError(f"ShuffleSamples cannot send dtype {t.dtype}")


def _from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return words if dtype == torch.int64 else words.to(torch.int32).view(torch.float32)


@dataclass
class _InFlight:
    planned: Planned
    handle: Any
    recv_counts: list
    field_sizes: list
    mine: torch.Tensor
    arrival: torch.Tensor
    has_actions: bool
    has_times: bool
    dense_dim: int
    num_labels: int


class ShuffleSamples(AsyncStage[Planned, _InFlight, tuple]):
    """Yields ``(balanced_batch, info)``; ``info`` holds the step and the balance metrics before and after."""

    span_name = "balancer_stage3_wait"

    def __init__(self, source: BaseNode[Planned], transport: Any, rank: int, world_size: int, timer: Optional[Timer] = None) -> None:
        super().__init__(source, timer)
        self.transport, self.rank, self.world_size = transport, rank, world_size

    def start(self, p: Planned) -> _InFlight:
        batch, lengths, plan, r, w = p.batch, p.lengths, p.plan, self.rank, self.world_size
        dense_dim, num_labels = batch.dense.shape[1], batch.num_labels

        # Per global sample: words of every field (in wire order).
        g_uih, g_cand = lengths.uih_lengths, lengths.num_candidates
        g_content = torch.from_numpy(lengths.content_lengths_per_sample())
        ones = torch.ones_like(g_uih)
        n_uih_fields = 1 + (batch.uih_action_types is not None) + (batch.uih_timestamps is not None)
        field_sizes = [ones, ones, ones * dense_dim] + [g_uih] * n_uih_fields + [g_cand * num_labels, g_content]

        # Sender: local samples sorted by plan position, i.e. grouped by destination.
        position = torch.empty_like(plan.order)
        position[plan.order] = torch.arange(plan.order.numel())
        lo, hi = int(lengths.rank_offsets[r]), int(lengths.rank_offsets[r + 1])
        send_order = torch.argsort(position[lo:hi])
        send_dest = plan.destinations()[lo:hi][send_order]
        local_fields = [
            batch.sample_ids,
            batch.user_ids,
            _as_words(batch.dense),
            batch.uih_item_ids,
            *[t for t in (batch.uih_action_types, batch.uih_timestamps) if t is not None],
            _as_words(batch.candidate_labels),
            batch.content_ids,
        ]
        send_parts, send_counts = [], []
        for values, sizes in zip(local_fields, field_sizes):
            permuted, _ = ops.indexed_permute(values, lengths_to_offsets(sizes[lo:hi]), send_order)
            send_parts.append(permuted)
            send_counts.append(torch.zeros(w, dtype=torch.int64).index_add_(0, send_dest, sizes[lo:hi][send_order]))
        send = self._interleave(send_parts, send_counts)

        # Receiver: my samples in plan order arrive grouped by source rank.
        mine = plan.rank_samples(r)
        source_rank = torch.searchsorted(lengths.rank_offsets, mine, right=True) - 1
        arrival = torch.argsort(source_rank, stable=True)  # arrival k holds mine[arrival[k]]
        arrived = mine[arrival]
        recv_counts = [
            torch.zeros(w, dtype=torch.int64).index_add_(0, source_rank[arrival], sizes[arrived]) for sizes in field_sizes
        ]
        handle = self.transport.all_to_all(
            send, torch.stack(send_counts).sum(0).tolist(), torch.stack(recv_counts).sum(0).tolist()
        )
        return _InFlight(
            p, handle, recv_counts, field_sizes, mine, arrival,
            batch.uih_action_types is not None, batch.uih_timestamps is not None, dense_dim, num_labels,
        )

    def finish(self, f: _InFlight) -> tuple:
        lengths, mine, arrival, field_sizes = f.planned.lengths, f.mine, f.arrival, f.field_sizes
        arrived = mine[arrival]
        g_uih, g_cand = lengths.uih_lengths, lengths.num_candidates
        n_uih_fields = 1 + f.has_actions + f.has_times
        fields = self._deinterleave(f.handle.wait(), f.recv_counts)
        if not torch.equal(arrival, torch.arange(arrival.numel())):  # a plan with its own order within a rank
            back = torch.argsort(arrival)
            fields = [ops.indexed_permute(v, lengths_to_offsets(s[arrived]), back)[0] for v, s in zip(fields, field_sizes)]

        candidate_offsets_global = lengths_to_offsets(g_cand)
        candidate_lengths, _ = ops.indexed_permute(lengths.candidate_lengths, candidate_offsets_global, mine)
        uih_fields = fields[3 : 3 + n_uih_fields]
        balanced = Batch(
            sample_ids=fields[0],
            user_ids=fields[1],
            uih_offsets=lengths_to_offsets(g_uih[mine]),
            uih_item_ids=uih_fields[0],
            candidate_offsets=lengths_to_offsets(g_cand[mine]),
            candidate_labels=_from_words(fields[-2], torch.float32).reshape(-1, f.num_labels),
            content_offsets=lengths_to_offsets(candidate_lengths),
            content_ids=fields[-1],
            dense=_from_words(fields[2], torch.float32).reshape(-1, f.dense_dim),
            uih_action_types=uih_fields[1] if f.has_actions else None,
            uih_timestamps=uih_fields[-1] if f.has_times else None,
        )
        return balanced, self._info(f.planned, g_uih)

    def _interleave(self, parts: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
        """Field-major per-destination layout: for each destination, its slice of every field in turn."""
        splits = [part.split(c.tolist()) for part, c in zip(parts, counts)]
        return torch.cat([s[d] for d in range(self.world_size) for s in splits])

    def _deinterleave(self, received: torch.Tensor, counts: list[torch.Tensor]) -> list[torch.Tensor]:
        per_source = torch.stack(counts, 1).reshape(-1).tolist()  # source-major, then field
        pieces = received.split(per_source)
        nf = len(counts)
        return [torch.cat([pieces[s * nf + f] for s in range(self.world_size)]) for f in range(nf)]

    def _info(self, p: Planned, g_uih: torch.Tensor) -> dict:
        """Balance metrics of this step, before (source ranks) and after (the plan), from the gathered lengths."""
        before = [g_uih[int(a) : int(b)] for a, b in zip(p.lengths.rank_offsets[:-1], p.lengths.rank_offsets[1:])]
        after = [g_uih[p.plan.rank_samples(q)] for q in range(self.world_size)]
        return {
            "step": p.step,
            "global_samples": p.lengths.num_samples,
            "global_candidates": int(p.lengths.num_candidates.sum()),
            "tokens_before": [int(x.sum()) for x in before],
            "tokens_after": [int(x.sum()) for x in after],
            "imbalance_before": imbalance([float(x.sum()) for x in before]),
            "imbalance_after": imbalance([float(x.sum()) for x in after]),
            "sparsity_before": [sparsity(x) for x in before],
            "sparsity_after": [sparsity(x) for x in after],
        }
