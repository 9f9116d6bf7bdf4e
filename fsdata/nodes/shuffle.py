"""Stage III of Algorithm 1: one AllToAll of whole samples per the plan, giving the balanced local batch.

Every split size follows locally from the gathered lengths and the plan, so the exchange needs no size
AllToAll first. All fields of a sample travel in one int64 buffer (float fields as their 32-bit patterns), laid
out per destination field by field:

    [sample_ids | user_ids | dense | uih_item_ids | uih_action_types? | uih_timestamps? | labels | content_ids
     | the user's extra jagged fields (sorted by name) | the user's extra dense fields (sorted by name)]

The lengths themselves (UIH, candidates, content, extra jagged fields) are not sent: the receiver rebuilds every
offset from the gathered lengths (Stage I gathers the extra fields' lengths beside the UIH's).

Each side reorders its words in one gather, not one per field and rank, because this stage runs in the
training thread (fsdata.nodes.async_stage). A (field, sample) pair is one segment of a [F, n] grid of words. The
sender concatenates its fields (field-major, local order) and gathers the segments in (destination, field, plan
position) order with one jagged indexed permute. The receiver gets (source, field) chunks; when the plan lists
the rank's samples source-major (the built-in partitioners always do) one concatenation of those chunks makes
the fields, otherwise one indexed permute of the (field, sample) segments puts them field-major in plan order.
The fields of the balanced batch are views of that one buffer.

A plan that keeps every sample where it is (the balance gate's identity plan, fsdata.partition.gate) exchanges
nothing: every rank holds the same plan, so every rank skips the collective alike, and the local batch passes
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import numpy as np
import torch
from torchdata.nodes import BaseNode

from fscomm.timing import Timer
from fsdata.balance_measures import imbalance
from fsdata.batch import Batch, Jagged, lengths_to_offsets
from fsdata.item import LoaderItem
from fsdata.nodes.async_stage import AsyncStage
from fsdata.nodes.gather_lengths import extra_layout
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


def _rank_major(rank_of: torch.Tensor, num_fields: int) -> torch.Tensor:
    """Cells ``f * n + k`` of a [F, n] grid ordered by (rank_of[k], f, k); ``rank_of`` [n] must not decrease.

    That is the wire order of an AllToAll buffer: per rank, every field in turn, samples in order within a field.
    """
    key = (rank_of * num_fields).unsqueeze(0) + torch.arange(num_fields).unsqueeze(1)  # [F, n]
    return torch.argsort(key.reshape(-1), stable=True)


def _rank_splits(offsets: torch.Tensor, per_rank: torch.Tensor, num_fields: int) -> list:
    """Words per rank, from the offsets of segments laid out rank-major with ``num_fields`` segments per sample."""
    bounds = torch.zeros(per_rank.numel() + 1, dtype=torch.int64)
    torch.cumsum(per_rank * num_fields, 0, out=bounds[1:])
    return offsets[bounds].diff().tolist()


def _per_rank_stats(values: np.ndarray, offsets: np.ndarray) -> tuple[list, list]:
    """Per rank ``r`` (values[offsets[r]:offsets[r+1]]): token sum and Eq. 1 sparsity (as
    fsdata.balance_measures.sparsity).

    Vectorized in numpy over the ranks: at 256 ranks of 128 samples, a Python loop over the lengths held the GIL
    for milliseconds per step in the stage worker.
    """
    counts = np.diff(offsets)
    prefix = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=prefix[1:])
    tokens = prefix[offsets[1:]] - prefix[offsets[:-1]]
    longest = np.zeros(counts.size, dtype=np.int64)
    nonempty = counts > 0
    if values.size:  # each non-empty segment runs from its start to the next non-empty one's (or the end)
        longest[nonempty] = np.maximum.reduceat(values, offsets[:-1][nonempty])
    padded = longest * counts
    sparse = np.where(padded > 0, 1.0 - tokens / np.maximum(padded, 1), 0.0)
    return tokens.tolist(), sparse.tolist()


@dataclass
class _Kept:
    """A step whose plan keeps every sample local: no exchange in flight."""

    planned: Planned


@dataclass(frozen=True)
class _Field:
    """One field on the wire: where it goes in the balanced batch, its dtype and its per-sample shape."""

    name: str  # a Batch field, or "jagged:<name>" / "dense:<name>" for the user's extra features
    dtype: torch.dtype
    shape: tuple = ()  # per-sample trailing shape of a fixed-size field (dense, labels' row)


def _wire_fields(batch: Batch) -> list[_Field]:
    """The fields of a batch in wire order (the module docstring's layout)."""
    fields = [
        _Field("sample_ids", torch.int64),
        _Field("user_ids", torch.int64),
        _Field("dense", torch.float32, (batch.dense.shape[1],)),
        _Field("uih_item_ids", torch.int64),
    ]
    fields += [_Field(n, torch.int64) for n in ("uih_action_types", "uih_timestamps") if getattr(batch, n) is not None]
    fields += [_Field("candidate_labels", torch.float32, (batch.num_labels,)), _Field("content_ids", torch.int64)]
    jagged, dense = extra_layout(batch)
    fields += [_Field(f"jagged:{k}", batch.extra_jagged[k].values.dtype) for k in jagged]
    fields += [_Field(f"dense:{k}", dtype, shape) for k, dtype, shape in dense]
    return fields


def _local_words(batch: Batch, f: _Field) -> torch.Tensor:
    kind, extra, name = f.name.partition(":")
    if not extra:
        return _as_words(getattr(batch, f.name))
    return _as_words(batch.extra_jagged[name].values if kind == "jagged" else batch.extra_dense[name])


def _words_per_sample(fields: list[_Field], g_uih, g_cand, g_content, extra_lengths) -> torch.Tensor:
    """[F, G] words of every field of every global sample."""
    ones, rows, k = torch.ones_like(g_uih), [], 0
    for f in fields:
        if f.name in ("uih_item_ids", "uih_action_types", "uih_timestamps"):
            rows.append(g_uih)
        elif f.name == "candidate_labels":
            rows.append(g_cand * f.shape[0])
        elif f.name == "content_ids":
            rows.append(g_content)
        elif f.name.startswith("jagged:"):
            rows.append(extra_lengths[:, k])
            k += 1
        else:  # a fixed-size field: sample ids, user ids, dense, extra dense
            rows.append(ones * int(np.prod(f.shape, dtype=np.int64)))
    return torch.stack(rows)


@dataclass
class _InFlight:
    planned: Planned
    handle: Any
    chunk_sizes: list  # [W*F] words received per (source, field), source-major
    recv_offsets: Optional[torch.Tensor]  # [F*m+1] received segments' offsets (arrival order), or None: source-major
    recv_order: Optional[torch.Tensor]  # [F*m] the received segments in (field, plan position) order
    field_totals: list  # [F] words of each field in the balanced batch
    mine: torch.Tensor
    fields: list  # [F] _Field, wire order


class ShuffleSamples(AsyncStage[Planned, Union[_Kept, _InFlight], LoaderItem]):
    """Yields the item with its balanced batch, and ``report``: the step and the balance measures before and after."""

    span_name = "balancer_stage3_wait"

    def __init__(
        self, source: BaseNode[Planned], transport: Any, rank: int, world_size: int, timer: Optional[Timer] = None
    ) -> None:
        super().__init__(source, timer)
        self.transport, self.rank, self.world_size = transport, rank, world_size

    def start(self, p: Planned) -> Union[_Kept, _InFlight]:
        batch, lengths, plan, r, w = p.batch, p.lengths, p.plan, self.rank, self.world_size
        if plan.is_identity(lengths):
            return _Kept(p)

        # [F, G] words of every field (in wire order) of every global sample.
        fields = _wire_fields(batch)
        g_content = torch.from_numpy(lengths.content_lengths_per_sample())
        sizes = _words_per_sample(fields, lengths.uih_lengths, lengths.num_candidates, g_content, p.extra_lengths)
        num_fields = sizes.shape[0]

        # Sender: my fields back to back; segment f * n + i is field f of local sample i. Send them grouped by
        # destination, then field, then plan position.
        lo, hi = int(lengths.rank_offsets[r]), int(lengths.rank_offsets[r + 1])
        n = hi - lo
        position = torch.empty_like(plan.order)
        position[plan.order] = torch.arange(plan.order.numel())
        send_order = torch.argsort(position[lo:hi])  # local samples by plan position, i.e. by destination
        send_dest = plan.destinations()[lo:hi][send_order]
        local = torch.cat([_local_words(batch, f) for f in fields])
        local_sizes = sizes[:, lo:hi]
        cell_segment = (torch.arange(num_fields).unsqueeze(1) * n + send_order.unsqueeze(0)).reshape(-1)
        send_segments = cell_segment[_rank_major(send_dest, num_fields)]
        send, send_offsets = ops.indexed_permute(
            local, lengths_to_offsets(local_sizes.reshape(-1)), send_segments, output_size=int(local_sizes.sum())
        )
        send_splits = _rank_splits(send_offsets, torch.bincount(send_dest, minlength=w), num_fields)

        # Receiver: my samples (plan order) arrive grouped by source rank, each source's field by field.
        mine = plan.rank_samples(r)
        source_rank = torch.searchsorted(lengths.rank_offsets, mine, right=True) - 1
        mine_sizes = sizes[:, mine]  # [F, m]
        chunks = torch.zeros(num_fields, w, dtype=torch.int64).index_add_(1, source_rank, mine_sizes)  # [F, W]
        recv_offsets = recv_order = None
        if not bool((source_rank.diff() >= 0).all()):  # a plan with its own order within a rank
            recv_offsets, recv_order = self._arrival_segments(source_rank, mine_sizes)
        handle = self.transport.all_to_all(send, send_splits, chunks.sum(0).tolist())
        return _InFlight(
            p, handle, chunks.t().reshape(-1).tolist(), recv_offsets, recv_order, chunks.sum(1).tolist(), mine, fields
        )

    @staticmethod
    def _arrival_segments(source_rank: torch.Tensor, mine_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets of the received (field, sample) segments in arrival order, and those segments in plan order.

        Arrival order is (source, field, plan position); the batch wants (field, plan position).
        """
        num_fields, m = mine_sizes.shape
        arrival = torch.argsort(source_rank, stable=True)  # arrival k holds my plan position arrival[k]
        wire = _rank_major(source_rank[arrival], num_fields)  # received segment t is cell wire[t] of [F, arrival]
        cell_to_segment = torch.empty_like(wire)
        cell_to_segment[wire] = torch.arange(wire.numel())
        back = torch.empty_like(arrival)
        back[arrival] = torch.arange(m)  # plan position j arrives at back[j]
        order = cell_to_segment[(torch.arange(num_fields).unsqueeze(1) * m + back.unsqueeze(0)).reshape(-1)]
        return lengths_to_offsets(mine_sizes[:, arrival].reshape(-1)[wire]), order

    def finish(self, f: Union[_Kept, _InFlight]) -> LoaderItem:
        if isinstance(f, _Kept):
            return replace(f.planned.item, report=self._info(f.planned, f.planned.lengths.uih_lengths, moved=False))
        lengths, mine = f.planned.lengths, f.mine
        g_uih, g_cand = lengths.uih_lengths, lengths.num_candidates
        received = f.handle.wait()
        if f.recv_order is None:  # source-major: (source, field) chunks to field-major, one copy
            pieces, nf = received.split(f.chunk_sizes), len(f.field_totals)
            words = torch.cat([pieces[s * nf + k] for k in range(nf) for s in range(self.world_size)])
        else:
            words, _ = ops.indexed_permute(received, f.recv_offsets, f.recv_order, output_size=received.numel())
        received_fields = {spec.name: (spec, part) for spec, part in zip(f.fields, words.split(f.field_totals))}

        def value(name: str) -> torch.Tensor:
            spec, part = received_fields[name]
            out = _from_words(part, spec.dtype)
            if not spec.shape:
                return out
            rows = -1 if name == "candidate_labels" else mine.numel()  # labels: one row per candidate
            return out.reshape(rows, *spec.shape)

        candidate_offsets_global = lengths_to_offsets(g_cand)
        candidate_lengths, _ = ops.indexed_permute(lengths.candidate_lengths, candidate_offsets_global, mine)
        jagged_names = [s.name.partition(":")[2] for s in f.fields if s.name.startswith("jagged:")]
        extra_lengths = f.planned.extra_lengths
        balanced = Batch(
            sample_ids=value("sample_ids"),
            user_ids=value("user_ids"),
            uih_offsets=lengths_to_offsets(g_uih[mine]),
            uih_item_ids=value("uih_item_ids"),
            candidate_offsets=lengths_to_offsets(g_cand[mine]),
            candidate_labels=value("candidate_labels"),
            content_offsets=lengths_to_offsets(candidate_lengths),
            content_ids=value("content_ids"),
            dense=value("dense"),
            uih_action_types=value("uih_action_types") if "uih_action_types" in received_fields else None,
            uih_timestamps=value("uih_timestamps") if "uih_timestamps" in received_fields else None,
            extra_jagged={
                k: Jagged(value(f"jagged:{k}"), lengths_to_offsets(extra_lengths[mine, i]))
                for i, k in enumerate(jagged_names)
            },
            extra_dense={s.name.partition(":")[2]: value(s.name) for s in f.fields if s.name.startswith("dense:")},
        )
        return replace(f.planned.item, batch=balanced, report=self._info(f.planned, g_uih, moved=True))

    def _info(self, p: Planned, g_uih: torch.Tensor, moved: bool) -> dict:
        """Balance measures of this step, before (source ranks) and after (the plan), from the gathered lengths."""
        uih = g_uih.numpy()
        tokens_before, sparsity_before = _per_rank_stats(uih, p.lengths.rank_offsets.numpy())
        tokens_after, sparsity_after = _per_rank_stats(uih[p.plan.order.numpy()], p.plan.dest_offsets.numpy())
        return {
            "step": p.step,
            "global_samples": p.lengths.num_samples,
            "global_candidates": int(p.lengths.num_candidates.sum()),
            "tokens_before": tokens_before,
            "tokens_after": tokens_after,
            "imbalance_before": imbalance([float(x) for x in tokens_before]),
            "imbalance_after": imbalance([float(x) for x in tokens_after]),
            "exchanged": moved,  # False: the plan kept every sample local (no AllToAll)
            "predicted_gain": p.predicted_gain,
            "sparsity_before": sparsity_before,
            "sparsity_after": sparsity_after,
        }
