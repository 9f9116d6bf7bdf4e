"""The reference sequence model: a causal transformer over the jagged UIH, candidates scored by target attention.

    UIH tokens  = item embedding + action embedding         (jagged, [N_uih, d])
    encoder     = num_layers pre-norm transformer blocks     (causal softmax attention over each sample's UIH)
    candidates  = sum of their content-id embeddings         ([C_total, d], content ids are jagged per candidate)
    target attn = each candidate attends over its sample's encoded UIH
    head        = MLP(candidate, attended UIH, dense) -> one logit per label column; BCE loss; NE metric

Attention runs through torch's scaled_dot_product_attention over padded batches (CPU and GPU): the UIH encoder
is causal with padding at the end, so it needs no mask and gets the fused kernels; the target attention masks
padded keys with a [B, 1, 1, L] mask. No fbgemm kernel is needed anywhere. The padding is exactly what the
balancer's sparsity metric (Eq. 1) measures, and what variable-batch-size balancing reduces.
Embedding tables are plain ``nn.Embedding`` modules named ``item_embedding`` and ``action_embedding``; the
FreeScale pipeline finds and swaps them by name, so this model's code never changes.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdata.batch import Batch, offsets_to_lengths


@dataclass
class ModelConfig:
    """Sizes of the reference model. Presets: :data:`MODEL_PRESETS`."""

    num_items: int = 20_000
    """Rows of the item table (ids are taken modulo this)."""
    num_actions: int = 8
    """Rows of the action-type table."""
    dim: int = 32
    """Embedding and model width d."""
    num_layers: int = 1
    num_heads: int = 2
    num_labels: int = 1
    """Label columns (tasks) per candidate."""
    dense_dim: int = 4
    """Dense feature width of the data."""
    max_uih: int = 21_000
    """Longest UIH the encoder sees (the most recent items are kept); positional table size."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by num_heads {self.num_heads}")


MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(num_items=20_000, dim=32, num_layers=1, num_heads=2, max_uih=512),
    "small": dict(num_items=200_000, dim=64, num_layers=2, num_heads=4, max_uih=4_096),
    "production": dict(num_items=10_000_000, dim=512, num_layers=4, num_heads=8, max_uih=21_000),
}


def _pad(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jagged [N, d] -> padded [B, max_len, d], a bool mask [B, max_len] (True = real token) and each value's
    slot in the flattened [B * max_len] padding.

    By slot index, not by mask: a boolean-mask assignment and its backward each read the mask's count back to
    the host, a device sync that, in the backward, idles the GPU while the host queues the rest of it."""
    lengths = offsets[1:] - offsets[:-1]
    b, n = lengths.numel(), values.shape[0]
    sample = torch.repeat_interleave(torch.arange(b, device=values.device), lengths, output_size=n)
    slot = sample * max_len + torch.arange(n, device=values.device) - offsets[:-1][sample]
    padded = values.new_zeros(b * max_len, values.shape[-1]).index_copy(0, slot, values)
    mask = torch.arange(max_len, device=values.device).unsqueeze(0) < lengths.unsqueeze(1)
    return padded.view(b, max_len, values.shape[-1]), mask, slot


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        # Causal, no mask: padding sits after each sample's last event, so a real token never attends to it, and
        # SDPA picks its fused (flash / memory-efficient) kernel: memory O(B*L), not the O(B*L^2) of a mask.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(out.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class SequenceModel(nn.Module):
    """Takes a :class:`Batch`, returns per-candidate logits [C_total, num_labels]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.item_embedding = nn.Embedding(config.num_items, d)
        self.action_embedding = nn.Embedding(config.num_actions, d)
        self.position = nn.Embedding(config.max_uih, d)
        self.blocks = nn.ModuleList(Block(d, config.num_heads) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(d)
        self.target_q = nn.Linear(d, d)
        self.dense_proj = nn.Linear(config.dense_dim, d)
        self.head = nn.Sequential(nn.Linear(3 * d, d), nn.GELU(), nn.Linear(d, config.num_labels))
        for emb in (self.item_embedding, self.action_embedding, self.position):
            nn.init.normal_(emb.weight, std=0.02)
        # Per thread, the last batch's truncation: a step asks for it three times (the embedding stage's
        # features, then item_ids and encode_uih in the forward), and each is a dozen small ops on a host that,
        # for a small model, is the bottleneck. Keyed by the batch's identity (batches are never changed in
        # place); per thread because the loader's ID-prefetch stage calls item_ids on the next batch meanwhile.
        self._truncated: dict[int, tuple] = {}

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_truncated": {}}  # weak references do not pickle, and the cache is only a cache

    def _truncate(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Keeps each sample's most recent ``max_uih`` events: offsets and the flat index and position of the kept
        tokens, and the longest kept length. The sizes come from the batch's host offsets: no device sync."""
        thread = threading.get_ident()
        last = self._truncated.get(thread)
        if last is not None and last[0]() is batch:
            return last[1]
        result = self._truncate_now(batch)
        self._truncated[thread] = (weakref.ref(batch), result)
        return result

    def _truncate_now(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        host_kept = offsets_to_lengths(batch.host_offsets("uih_offsets")).clamp(max=self.config.max_uih)
        total, longest = int(host_kept.sum()), int(host_kept.max()) if host_kept.numel() else 0
        lengths = batch.uih_lengths
        kept = lengths.clamp(max=self.config.max_uih)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(kept, 0, out=offsets[1:])
        sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), kept, output_size=total)
        pos = torch.arange(total, device=lengths.device) - offsets[:-1][sample]
        flat = batch.uih_offsets[:-1][sample] + (lengths - kept)[sample] + pos
        return offsets, flat, pos, longest

    def item_ids(self, batch: Batch) -> torch.Tensor:
        """Every item-table id one forward looks up, in one tensor: the kept UIH items, then the content ids.

        One lookup per step lets a sharded embedding stage swapped in for ``item_embedding`` exchange the ids
        of the whole step at once (pipelines use this same function to prefetch the next batch's ids).
        """
        _, flat, _, _ = self._truncate(batch)
        return torch.cat([batch.uih_item_ids[flat], batch.content_ids]) % self.config.num_items

    def encode_uih(self, batch: Batch, uih_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoded UIH, padded [B, L, d], with its mask [B, L], from the kept UIH items' embedding rows."""
        offsets, flat, pos, max_len = self._truncate(batch)
        tokens = uih_rows + self.position(pos)
        if batch.uih_action_types is not None:
            tokens = tokens + self.action_embedding(batch.uih_action_types[flat] % self.config.num_actions)
        x, mask, _ = _pad(tokens, offsets, max(max_len, 1))
        for block in self.blocks:
            x = block(x)
        return self.norm(x), mask

    def forward(self, batch: Batch) -> torch.Tensor:
        rows = self.item_embedding(self.item_ids(batch))
        if batch.batch_size == 0:
            # Still tied to the embedding lookup, so a sharded table's backward exchange runs on this rank too.
            return rows.new_zeros(0, self.config.num_labels) + rows.sum() * 0
        num_content = batch.content_ids.numel()
        uih_rows, content_rows = rows[: rows.shape[0] - num_content], rows[rows.shape[0] - num_content :]
        uih, uih_mask = self.encode_uih(batch, uih_rows)
        # Candidate vectors: sum of their content-id rows (a candidate without content gets a zero vector).
        cand = torch.segment_reduce(content_rows, "sum", lengths=batch.candidate_lengths, axis=0, unsafe=True)
        # Target attention: candidates padded per sample query their own sample's encoded UIH.
        c_max = int(offsets_to_lengths(batch.host_offsets("candidate_offsets")).max())
        q, _, cand_slot = _pad(self.target_q(cand), batch.candidate_offsets, max(c_max, 1))  # [B, Cmax, d]
        b, h, d = batch.batch_size, self.config.num_heads, self.config.dim
        heads = lambda t: t.view(b, t.shape[1], h, d // h).transpose(1, 2)  # noqa: E731
        attended = F.scaled_dot_product_attention(heads(q), heads(uih), heads(uih), attn_mask=uih_mask[:, None, None, :])
        attended = attended.transpose(1, 2).reshape(-1, d).index_select(0, cand_slot)  # back to jagged [C_total, d]
        sample_of_cand = torch.repeat_interleave(
            torch.arange(b, device=cand.device), batch.num_candidates, output_size=cand.shape[0]
        )
        dense = self.dense_proj(batch.dense)[sample_of_cand]
        return self.head(torch.cat([cand, attended, dense], dim=-1))


def bce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-label BCE over the local candidates (the trainer scales it to the global mean)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


def normalized_entropy(bce_total: float, positives: float, count: float) -> float:
    """NE = mean BCE / entropy of the base rate (lower is better, 1.0 = predicting the base rate)."""
    if count <= 0:
        return float("nan")
    p = min(max(positives / count, 1e-7), 1 - 1e-7)
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return (bce_total / count) / base
