"""The softmax model: a causal transformer over the jagged UIH, candidates scored by target attention.

    UIH tokens  = item embedding + action embedding         (jagged, [N_uih, d])
    encoder     = num_layers pre-norm transformer blocks     (causal softmax attention over each sample's UIH)
    candidates  = sum of their content-id embeddings         ([C_total, d], content ids are jagged per candidate)
    target attn = each candidate attends over its sample's encoded UIH
    head        = MLP(candidate, attended UIH, dense) -> one logit per label column (loss and NE: pipelines.metrics)

Attention (``SoftmaxConfig.attention``):

* ``jagged`` (default): no padding. Tokens stay packed [N, heads, dim] and each sample attends only within itself
  (kernels.attention). A step then costs what its samples' sum of L^2 costs, which is what the balancer balances.
  The kernel is ``SoftmaxConfig.attention_impl``: on CUDA by default PyTorch's varlen FlashAttention, which reads
  the kept offsets as int32 on the device (computed there from the batch's lengths, no sync) and their longest
  length (from the batch's host offsets, once per batch): no plan, no host work per attention call. ``flex``
  (FlexAttention, the deterministic mode's choice) needs block masks: :func:`attention_plan` is the pure
  function of a batch's host offsets that a loader stage (fsdata.nodes.attention_plan) runs for a batch ahead
  when :meth:`SoftmaxModel.needs_plan` says so, and ``forward(batch, attention_plan)`` takes its result;
  without one the forward builds it. On CPU, one fused SDPA per sample.
* ``padded``: torch's scaled_dot_product_attention over batches padded to their longest sample. The UIH encoder
  is causal with padding at the end, so it needs no mask and gets the fused kernels; the target attention masks
  padded keys with a [B, 1, 1, L] mask. The padding is exactly what the balancer's sparsity metric (Eq. 1)
  measures, and what variable-batch-size balancing reduces. Kept for comparison: the same numbers as ``jagged``.

No fbgemm kernel is needed anywhere.
Embedding tables are plain ``nn.Embedding`` modules named ``item_embedding`` and ``action_embedding``; the
FreeScale wrap (``wrap_model``) finds and swaps them by name, so this model's code never changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from fsdata.batch import Batch, offsets_to_lengths
from kernels.attention import NEEDS_BLOCK_MASK, PackedOffsets, jagged_attention, resolve_impl
from kernels.flex.block_mask import JaggedBlockMask, build_block_mask
from kernels.impl import Impl

ATTENTIONS = ("jagged", "padded")
#: The kernels of the jagged attention a model may name (kernels.impl.Impl); None: the device's default.
ATTENTION_IMPLS = ("varlen", "flex", "torch")


@dataclass
class SoftmaxConfig:
    """Sizes of the softmax model. Presets: :data:`SOFTMAX_PRESETS`."""

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
    attention: str = "jagged"
    """``jagged`` (packed tokens, no padding) or ``padded`` (SDPA over batches padded to their longest sample)."""
    attention_impl: Optional[str] = None
    """The jagged attention's kernel on CUDA: ``varlen``, ``flex`` or ``torch`` (per-sample SDPA); None: varlen
    (``resolve_impl``'s default). CPU always runs ``torch``."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"model attention_impl must be one of {', '.join(ATTENTION_IMPLS)} or None, got {self.attention_impl!r}"
            )


@dataclass
class AttentionPlan:
    """The block masks of one batch's jagged attention: the UIH encoder's (causal) and the target attention's
    (candidates over their sample's UIH). Tensors only: it is pinned and copied to the device with its batch."""

    uih: JaggedBlockMask
    target: JaggedBlockMask

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "AttentionPlan":
        return AttentionPlan(self.uih.to(device, non_blocking), self.target.to(device, non_blocking))

    def pin_memory(self) -> "AttentionPlan":
        return AttentionPlan(self.uih.pin_memory(), self.target.pin_memory())

    def record_stream(self, stream) -> None:
        self.uih.record_stream(stream)
        self.target.record_stream(stream)

    @property
    def device(self) -> torch.device:
        return self.uih.device


def kept_offsets(uih_offsets: torch.Tensor, max_uih: int) -> torch.Tensor:
    """Host offsets of the UIH the encoder sees: each sample's most recent ``max_uih`` events."""
    kept = offsets_to_lengths(uih_offsets).clamp(max=max_uih)
    out = torch.zeros(kept.numel() + 1, dtype=torch.int64)
    torch.cumsum(kept, 0, out=out[1:])
    return out


def attention_plan(uih_offsets: torch.Tensor, candidate_offsets: torch.Tensor, *, max_uih: int) -> AttentionPlan:
    """The pure function from a batch's host offsets to its attention plan (after the model's truncation to
    ``max_uih``). O(blocks) host work; what the loader's attention-plan stage runs for a batch ahead."""
    uih = kept_offsets(uih_offsets.to(torch.int64), max_uih)
    return AttentionPlan(
        build_block_mask(uih, causal=True), build_block_mask(candidate_offsets.to(torch.int64), uih, causal=False)
    )


SOFTMAX_PRESETS: dict[str, dict] = {
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


class Kept(NamedTuple):
    """A batch's UIH after the model's truncation to ``max_uih`` (see ``SoftmaxModel._truncate``)."""

    offsets: torch.Tensor  # kept offsets, int64 on the batch's device
    flat: torch.Tensor  # flat index of each kept token in the batch's UIH
    pos: torch.Tensor  # each kept token's position in its sample
    uih: PackedOffsets  # the kept offsets for the attention kernels (host, int32 device copy, longest)
    candidates: PackedOffsets  # the candidate offsets likewise


def truncate(batch: Batch, max_uih: int) -> Kept:
    """Keeps each sample's most recent ``max_uih`` events (:class:`Kept`). The sizes come from the batch's host
    offsets: no device sync. A dozen small ops on a host that, for a small model, is the bottleneck: a model's
    forward computes it once and hands it to its parts (the HSTU model, pipelines.models.hstu, shares it)."""
    host_offsets = kept_offsets(batch.host_offsets("uih_offsets"), max_uih)
    total = int(host_offsets[-1])
    lengths = batch.uih_lengths
    kept = lengths.clamp(max=max_uih)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(kept, 0, out=offsets[1:])
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), kept, output_size=total)
    pos = torch.arange(total, device=lengths.device) - offsets[:-1][sample]
    flat = batch.uih_offsets[:-1][sample] + (lengths - kept)[sample] + pos
    cuda = lengths.device.type == "cuda"  # the int32 device copies only where a CUDA kernel reads them
    uih = PackedOffsets.from_host(host_offsets, on_device=offsets if cuda else None)
    candidates = PackedOffsets.from_host(
        batch.host_offsets("candidate_offsets"), on_device=batch.candidate_offsets if cuda else None
    )
    return Kept(offsets, flat, pos, uih, candidates)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``x``: [B, L, d] (padded) or [N, d] (packed); ``attend(q, k, v)`` takes and returns [..., heads, d /
        heads]."""
        h, d = self.num_heads, x.shape[-1]
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, h, d // h)).unbind(-3)
        x = x + self.proj(attend(q, k, v).flatten(-2))
        return x + self.mlp(self.norm2(x))


def _padded_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, L, h, dh] each. Causal, no mask: padding sits after each sample's last event, so a real token never
    attends to it, and SDPA picks its fused (flash / memory-efficient) kernel: memory O(B*L), not O(B*L^2)."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


class SoftmaxModel(nn.Module):
    """Takes a :class:`Batch`, returns per-candidate logits [C_total, num_labels]."""

    def __init__(self, config: SoftmaxConfig) -> None:
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

    def _truncate(self, batch: Batch) -> Kept:
        """The batch's UIH after this model's truncation to ``max_uih`` (:func:`truncate`)."""
        return truncate(batch, self.config.max_uih)

    def item_ids(self, batch: Batch, kept: Optional[Kept] = None) -> torch.Tensor:
        """Every item-table id one forward looks up, in one tensor: the kept UIH items, then the content ids
        (``kept``: the batch's truncation, where the caller has it).

        One lookup per step lets a sharded embedding module swapped in for ``item_embedding`` exchange the ids
        of the whole step at once (:meth:`embedding_ids` gives the loader's ID prefetch this same function).
        """
        flat = (kept if kept is not None else self._truncate(batch)).flat
        return torch.cat([batch.uih_item_ids[flat], batch.content_ids]) % self.config.num_items

    @property
    def num_items(self) -> int:
        """Rows of the item table."""
        return self.config.num_items

    def embedding_ids(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The ids of the forward's one sharded lookup, by the module's name: the features of FreeScale's embedding
        wrap (computed once per batch, by the loader's ID prefetch or by the step)."""
        return {"item_embedding": self.item_ids(batch)}

    def plan_function(self) -> Callable[[torch.Tensor, torch.Tensor], AttentionPlan]:
        """The pure function from a batch's host ``uih_offsets`` and ``candidate_offsets`` to its
        :class:`AttentionPlan` (picklable, holds no module): what the loader's attention-plan stage runs."""
        return functools.partial(attention_plan, max_uih=self.config.max_uih)

    def attention_impl(self, device: torch.device) -> Impl:
        """The kernel of this model's attention on ``device``: PADDED for the padded model; for the jagged one the
        configured kernel (default: the device's, kernels.attention.resolve_impl) where its head dim suits it
        (FlexAttention's kernels need >= 16, FlashAttention's a multiple of 8 up to 256), else the per-sample twin."""
        if self.config.attention == "padded":
            return Impl.PADDED
        if device.type != "cuda":
            return Impl.TORCH
        impl = resolve_impl(self.config.attention_impl, device)
        head_dim = self.config.dim // self.config.num_heads
        if impl is Impl.FLEX and head_dim < 16:
            return Impl.TORCH
        if impl is Impl.VARLEN and (head_dim % 8 or head_dim > 256):
            return Impl.TORCH
        return impl

    def needs_plan(self, device: torch.device) -> bool:
        """Whether this model's attention on ``device`` takes a host-built plan (block masks) from the loader."""
        return self.attention_impl(device) in NEEDS_BLOCK_MASK

    def _tokens(self, batch: Batch, uih_rows: torch.Tensor, kept: Kept) -> torch.Tensor:
        flat, pos = kept.flat, kept.pos
        tokens = uih_rows + self.position(pos)
        if batch.uih_action_types is not None:
            tokens = tokens + self.action_embedding(batch.uih_action_types[flat] % self.config.num_actions)
        return tokens

    def encode_uih(
        self,
        batch: Batch,
        uih_rows: torch.Tensor,
        plan: Optional[AttentionPlan] = None,
        kept: Optional[Kept] = None,
    ) -> torch.Tensor:
        """Encoded UIH from the kept UIH items' embedding rows: packed [N, d] (jagged) or padded [B, L, d]
        (``kept``: the batch's truncation, where the caller has it)."""
        kept = kept if kept is not None else self._truncate(batch)
        tokens = self._tokens(batch, uih_rows, kept)
        if self.config.attention == "padded":
            x, _, _ = _pad(tokens, kept.offsets, max(kept.uih.max_len, 1))
            attend = _padded_causal
        else:
            x, impl = tokens, self.attention_impl(tokens.device)
            mask = plan.uih if plan is not None else None
            attend = lambda q, k, v: jagged_attention(q, k, v, kept.uih, causal=True, block_mask=mask, impl=impl)  # noqa: E731
        for block in self.blocks:
            x = block(x, attend)
        return self.norm(x)

    def forward(
        self,
        batch: Batch,
        attention_plan: Optional[AttentionPlan] = None,
        embedding_ids: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """``attention_plan``: the batch's block masks from the loader, read where the kernel takes them
        (:meth:`needs_plan`) and built here when absent; ignored by the other kernels. ``embedding_ids``: this
        batch's :meth:`embedding_ids` where the step has them (pipelines.models.protocol), else computed here."""
        kept = self._truncate(batch)
        ids = embedding_ids["item_embedding"] if embedding_ids is not None else self.item_ids(batch, kept)
        rows = self.item_embedding(ids)
        if batch.batch_size == 0:
            # Still tied to the embedding lookup, so a sharded table's backward exchange runs on this rank too.
            return rows.new_zeros(0, self.config.num_labels) + rows.sum() * 0
        num_content = batch.content_ids.numel()
        uih_rows, content_rows = rows[: rows.shape[0] - num_content], rows[rows.shape[0] - num_content :]
        b, h, d = batch.batch_size, self.config.num_heads, self.config.dim
        plan = attention_plan
        impl = self.attention_impl(rows.device)
        if impl not in NEEDS_BLOCK_MASK:
            plan = None
        else:
            if plan is None:
                plan = self.plan_function()(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets"))
            if plan.device != rows.device:
                plan = plan.to(rows.device, non_blocking=True)
        uih = self.encode_uih(batch, uih_rows, plan, kept)
        # Candidate vectors: sum of their content-id rows (a candidate without content gets a zero vector).
        cand = torch.segment_reduce(content_rows, "sum", lengths=batch.candidate_lengths, axis=0, unsafe=True)
        # Target attention: each candidate queries its own sample's encoded UIH.
        if self.config.attention == "padded":
            uih_mask = torch.arange(max(kept.uih.max_len, 1), device=uih.device).unsqueeze(0) < offsets_to_lengths(
                kept.offsets
            ).unsqueeze(1)
            c_max = int(offsets_to_lengths(batch.host_offsets("candidate_offsets")).max())
            q, _, cand_slot = _pad(self.target_q(cand), batch.candidate_offsets, max(c_max, 1))  # [B, Cmax, d]
            heads = lambda t: t.view(b, t.shape[1], h, d // h).transpose(1, 2)  # noqa: E731
            attended = F.scaled_dot_product_attention(
                heads(q), heads(uih), heads(uih), attn_mask=uih_mask[:, None, None, :]
            )
            attended = attended.transpose(1, 2).reshape(-1, d).index_select(0, cand_slot)  # back to jagged [C_total, d]
        else:
            heads = lambda t: t.view(t.shape[0], h, d // h)  # noqa: E731
            attended = jagged_attention(
                heads(self.target_q(cand)),
                heads(uih),
                heads(uih),
                kept.candidates,
                kept.uih,
                causal=False,
                block_mask=plan.target if plan is not None else None,
                impl=impl,
            ).reshape(-1, d)
        sample_of_cand = torch.repeat_interleave(
            torch.arange(b, device=cand.device), batch.num_candidates, output_size=cand.shape[0]
        )
        dense = self.dense_proj(batch.dense)[sample_of_cand]
        return self.head(torch.cat([cand, attended, dense], dim=-1))
