"""The HSTU model (Hierarchical Sequential Transduction Units, "Actions Speak Louder than Words"):
each sample's kept UIH followed by its candidates, as one jagged sequence through pointwise-attention layers.

    tokens    = [history..., candidates...] per sample      (packed [N_uih + C_total, d], no padding)
    history   = item embedding + action embedding           (the most recent ``max_uih`` events)
    candidate = sum of its content-id embeddings            (as the softmax model's)
    layer     = x + Linear(u * LayerNorm(hstu_attention(q, k, v)))   u, v, q, k = SiLU(Linear(LayerNorm(x)))
    head      = MLP(LayerNorm(candidate's output token), dense) -> one logit per label column; BCE loss

The candidates are the sequence's targets (kernels.hstu): each sees its sample's history and itself, never
another candidate, so a candidate's logit does not depend on what else is scored beside it. Positions and time
gaps enter as a learned relative attention bias (``rab``) per head and bucket, computed inside the kernel, and/or
(``position_embeddings``) as learned embeddings of each token's recency and age added to its input, as
generative-recommenders' and NVIDIA recsys-examples' HSTU preprocessors do: per token, not per score.

The attention kernel is kernels.hstu's: the Triton kernel on CUDA, its PyTorch twin on CPU. Both read the
batch's offsets alone, so the model asks the loader for no plan (:meth:`HSTUModel.needs_plan` is False).

The embedding tables are ``nn.Embedding`` modules named ``item_embedding`` and ``action_embedding``, looked up
once per forward (:meth:`HSTUModel.item_ids`), exactly as in the softmax model: FreeScale's wrap swaps them by
name and the loader prefetches :meth:`HSTUModel.embedding_ids`, so the job trains either model the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fsdata.batch import Batch
from kernels.attention import PackedOffsets
from kernels.hstu import HSTUSequences, hstu_attention, hstu_sequences, position_bucket, time_bucket
from kernels.hstu import resolve_impl as resolve_hstu_impl
from kernels.impl import Impl
from pipelines.models.softmax import Kept, truncate

#: How the attention weights are normalized: ``max`` by one constant, the longest sequence the model is sized
#: for (``max_uih + max_candidates``); ``sample`` by each sample's own length.
SEQ_NORMS = ("max", "sample")
#: The HSTU attention kernels a config may name (kernels.impl.Impl); None: the device's default.
HSTU_ATTENTION_IMPLS = ("triton", "torch")
#: The residual stream's dtype under autocast (:attr:`HSTUConfig.fp32_residual`), as the job and the bench name it.
RESIDUALS = ("fp32", "bf16")

#: ``--model`` presets of the HSTU model. ``hstu``: small enough for CPU CI. ``hstu-large``: the shape of
#: NVIDIA recsys-examples' HSTU benchmarks (8 layers, width 1024, 4 heads of 256), for GPU benchmarks.
HSTU_PRESETS: dict[str, dict] = {
    "hstu": dict(num_items=20_000, dim=32, num_layers=2, num_heads=2, head_dim=16, max_uih=512),
    "hstu-large": dict(num_items=1_000_000, dim=1024, num_layers=8, num_heads=4, head_dim=256, max_uih=4_096),
}


@dataclass
class HSTUConfig:
    """Sizes and switches of the HSTU model. Presets: :data:`HSTU_PRESETS`."""

    num_items: int = 20_000
    """Rows of the item table (ids are taken modulo this)."""
    num_actions: int = 8
    """Rows of the action-type table."""
    dim: int = 32
    """Embedding and model width d."""
    num_layers: int = 2
    """HSTU layers."""
    num_heads: int = 2
    """Attention heads."""
    head_dim: int = 16
    """Width of each head's queries and keys, and of its values (u, v, q, k are each num_heads x head_dim)."""
    num_labels: int = 1
    """Label columns (tasks) per candidate."""
    dense_dim: int = 4
    """Dense feature width of the data."""
    max_uih: int = 512
    """Longest UIH the model sees (each sample's most recent events are kept)."""
    max_candidates: int = 16
    """The candidates per sample that ``seq_norm = "max"`` counts in its constant; a sample may have more."""
    seq_norm: str = "max"
    """Attention normalizer n: ``max`` (max_uih + max_candidates, the same for every sample) or ``sample`` (each
    sample's own sequence length)."""
    rab: bool = True
    """Learned relative attention bias per head: by position distance, and by time gap where the batch has
    timestamps."""
    position_embeddings: bool = False
    """Learned embeddings added to each input token: of its recency (a history event's distance in events from
    the sample's end, 1 for the latest; 0 for a candidate) by position bucket, and of its age (seconds before
    the sample's last event; 0 for a candidate) by time bucket where the batch has timestamps. The peers' input
    positions: they cost a gather per token, where ``rab`` costs work per score."""
    position_buckets: int = 64
    """Buckets of position distance (kernels.hstu.position_bucket), for rab and the recency embedding."""
    time_buckets: int = 64
    """Buckets of time gap in seconds (kernels.hstu.time_bucket), for rab and the age embedding."""
    window: int = 0
    """Keys at most this many positions back are seen; 0: the whole history."""
    dropout: float = 0.0
    """Dropout on each layer's output before the residual sum."""
    attention_impl: Optional[str] = None
    """The attention's kernel on CUDA: ``triton`` or ``torch`` (the per-sample twin); None: triton. CPU always runs
    ``torch``."""
    deterministic: bool = False
    """The Triton attention runs one fixed launch configuration instead of the autotuner's timed pick, so that two
    processes (two jobs to compare) sum in the same order and get the same bits; every run's backward already gives
    the same bits in one process."""
    fp32_residual: bool = True
    """Under autocast, the residual stream (each layer's input and output, and their gradients) in fp32. False: in
    autocast's dtype, as Megatron-based trainers run it by default: every pass over the stream moves half the bytes,
    and each layer's sum is rounded to bf16 (LayerNorm still computes in fp32). No effect without autocast."""
    compile: Optional[bool] = None
    """Each layer under torch.compile (inductor, dynamic shapes: one compile for every token count), the attention
    one opaque operator inside it, so that its memory-bound work (norms, SiLU, casts, the split, the gating and the
    residual) fuses into few kernels. None: on CUDA with the Triton attention; the eager layer is the twin. True
    where the torch twin runs (CPU) is refused (:meth:`HSTUModel.compiles`)."""

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "dim", "num_layers", "num_heads", "head_dim", "num_labels"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("dense_dim", "max_uih", "max_candidates", "window"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _check(self.max_uih + self.max_candidates >= 1, "max_uih + max_candidates must be >= 1")
        _check(self.seq_norm in SEQ_NORMS, f"seq_norm must be one of {', '.join(SEQ_NORMS)}, got {self.seq_norm!r}")
        for name in ("position_buckets", "time_buckets"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(0.0 <= self.dropout < 1.0, f"dropout must lie in [0, 1), got {self.dropout}")
        _check(
            self.attention_impl is None or self.attention_impl in HSTU_ATTENTION_IMPLS,
            f"attention_impl must be one of {', '.join(HSTU_ATTENTION_IMPLS)} or None, got {self.attention_impl!r}",
        )


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"HSTUConfig: {message}")


@dataclass
class Packing:
    """One batch's packed [history..., candidates...] sequences, what every layer's attention reads."""

    offsets: PackedOffsets  # per sample: kept UIH length + number of candidates
    attention: HSTUSequences  # the offsets, the candidates as targets and the timestamps, as the kernel reads them
    timestamps: Optional[torch.Tensor]  # [N] int64: events' own; a candidate's is its sample's last event's
    # Read by the input position embeddings alone: None when they are off (age also without timestamps);
    # a candidate's recency and age are 0.
    recency: Optional[torch.Tensor]  # [N] a history event's distance in events from its sample's end (latest 1)
    age: Optional[torch.Tensor]  # [N] seconds before the sample's last event (candidates 0)
    source: torch.Tensor  # [N] each packed token's row in cat([history tokens, candidate tokens])
    candidate_slot: torch.Tensor  # [C_total] each candidate's packed position
    sample_of_candidate: torch.Tensor  # [C_total]


class HSTULayer(nn.Module):
    """One HSTU layer: ``x + Linear(u * LayerNorm(A v))`` with A the pointwise (SiLU) attention of kernels.hstu and
    u, v, q, k = SiLU of one projection of LayerNorm(x) (generative-recommenders' default)."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.num_heads * config.head_dim
        self.norm = nn.LayerNorm(config.dim)
        self.uvqk = nn.Linear(config.dim, 4 * hidden)
        self.attention_norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.position_weights = self.time_weights = None
        if config.rab:  # zeros: training starts without a bias, as if rab were off
            self.position_weights = nn.Parameter(torch.zeros(config.num_heads, config.position_buckets))
            self.time_weights = nn.Parameter(torch.zeros(config.num_heads, config.time_buckets))

    def forward(self, x: torch.Tensor, seq: Packing) -> torch.Tensor:
        c = self.config
        heads = lambda t: t.view(t.shape[0], c.num_heads, c.head_dim)  # noqa: E731
        # Views of one projection's output: the Triton attention reads q, k and v in place.
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).chunk(4, dim=-1)
        timed = seq.timestamps is not None and self.time_weights is not None
        attended = hstu_attention(
            heads(q),
            heads(k),
            heads(v),
            seq.attention,
            alpha=1.0 / math.sqrt(c.head_dim),
            seq_norm=c.max_uih + c.max_candidates if c.seq_norm == "max" else None,
            window=c.window,
            position_weights=self.position_weights,
            time_weights=self.time_weights if timed else None,
            deterministic=c.deterministic,
        )
        y = u * self.attention_norm(attended.flatten(1))
        return x + self.dropout(self.output(y))


class HSTUModel(nn.Module):
    """Takes a :class:`Batch`, returns per-candidate logits [C_total, num_labels] (the softmax model's contract:
    its default loss is pipelines.metrics.binary_cross_entropy_sum)."""

    # Its relative bias and age embeddings read the gaps between events' times: the job's loader refuses histories
    # out of time order or with negative times for it (fsdata.parquet, --unordered-timestamps).
    reads_time_gaps = True

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.item_embedding = nn.Embedding(config.num_items, d)
        self.action_embedding = nn.Embedding(config.num_actions, d)
        self.position_embedding = self.time_embedding = None
        if config.position_embeddings:
            self.position_embedding = nn.Embedding(config.position_buckets, d)
            self.time_embedding = nn.Embedding(config.time_buckets, d)
            for table in (self.position_embedding, self.time_embedding):
                nn.init.zeros_(table.weight)  # training starts without them, as if they were off
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        # The layers under torch.compile, made at the first forward that wants them.
        self._compiled: Optional[list] = None
        self.norm = nn.LayerNorm(d)
        self.dense_proj = nn.Linear(config.dense_dim, d)
        self.head = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, config.num_labels))
        for emb in (self.item_embedding, self.action_embedding):
            nn.init.normal_(emb.weight, std=0.02)

    # ---------------------------------------------------------------- what the job and the wrap call
    def item_ids(self, batch: Batch, kept: Optional[Kept] = None) -> torch.Tensor:
        """Every item-table id one forward looks up, in one tensor: the kept UIH items, then the content ids (the
        softmax model's order, so a sharded table exchanges the whole step's ids at once)."""
        flat = (kept if kept is not None else truncate(batch, self.config.max_uih)).flat
        return torch.cat([batch.uih_item_ids[flat], batch.content_ids]) % self.config.num_items

    @property
    def num_items(self) -> int:
        """Rows of the item table."""
        return self.config.num_items

    def embedding_ids(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The ids of the forward's one sharded lookup, by the module's name: the features of FreeScale's wrap."""
        return {"item_embedding": self.item_ids(batch)}

    def attention_impl(self, device: torch.device) -> Impl:
        """The attention's kernel on ``device``: the configured one on CUDA (default Triton), the twin elsewhere."""
        if device.type != "cuda":
            return Impl.TORCH
        return resolve_hstu_impl(self.config.attention_impl, device)

    def compiles(self, device: torch.device) -> bool:
        """Whether the layers run under torch.compile on ``device`` (:attr:`HSTUConfig.compile`). Only around the
        Triton attention, one opaque operator: the torch twin, the eager reference, loops over samples in Python,
        which a graph does not hold (inductor fails on its symbolic sizes)."""
        triton = self.attention_impl(device) is Impl.TRITON
        if self.config.compile and not triton:
            raise ValueError(
                f"HSTUConfig: compile=True needs the Triton attention, and on {device.type} the layers run the torch "
                "twin: leave compile None (compiled where the Triton attention runs) or set it False"
            )
        return triton if self.config.compile is None else self.config.compile

    def _layer_calls(self, device: torch.device) -> list:
        if not self.compiles(device):
            return list(self.layers)
        if self._compiled is None:  # compiled wrappers, not submodules: the state dict is the eager layers'
            self._compiled = [torch.compile(layer, dynamic=True) for layer in self.layers]
        return self._compiled

    def needs_plan(self, device: torch.device) -> bool:
        """False: the HSTU kernels read the batch's offsets alone, no host-built plan."""
        return False

    def plan_function(self) -> None:
        """None: there is no plan to build (:meth:`needs_plan`)."""
        return None

    # ---------------------------------------------------------------- forward
    def _pack(self, batch: Batch, kept: Kept) -> Packing:
        """Where each history and candidate token goes in the packed sequences. Sizes from host offsets only: the
        combined offsets are the sums of the kept UIH's and the candidates' (both cumulative)."""
        device = kept.offsets.device
        b = batch.batch_size
        host = kept.uih.host + batch.host_offsets("candidate_offsets")
        offsets = kept.offsets + batch.candidate_offsets
        total, num_history = int(host[-1]), int(kept.uih.host[-1])
        kept_lengths = kept.offsets[1:] - kept.offsets[:-1]
        sample = torch.repeat_interleave(torch.arange(b, device=device), offsets[1:] - offsets[:-1], output_size=total)
        pos = torch.arange(total, device=device) - offsets[:-1][sample]
        history = pos < kept_lengths[sample]
        source = torch.where(
            history,
            kept.offsets[:-1][sample] + pos,
            num_history + batch.candidate_offsets[:-1][sample] + pos - kept_lengths[sample],
        )
        num_candidates = batch.num_candidates
        num_cand = batch.content_offsets.numel() - 1
        sample_of_candidate = torch.repeat_interleave(
            torch.arange(b, device=device), num_candidates, output_size=num_cand
        )
        candidate_slot = torch.arange(num_cand, device=device) + kept.offsets[1:][sample_of_candidate]
        embeds = self.config.position_embeddings
        recency = torch.where(history, kept_lengths[sample] - pos, 0) if embeds else None
        timestamps = age = None
        if batch.uih_timestamps is not None:
            events = batch.uih_timestamps[kept.flat]
            last = torch.zeros(b, dtype=torch.int64, device=device)
            if batch.uih_timestamps.numel():  # a sample without events keeps 0 for its candidates
                at_end = batch.uih_timestamps[(batch.uih_offsets[1:] - 1).clamp(min=0)]
                last = torch.where(kept_lengths > 0, at_end, last)
            timestamps = torch.cat([events, last[sample_of_candidate]])[source]
            age = last[sample] - timestamps if embeds else None
        packed = PackedOffsets.from_host(host, on_device=offsets if device.type == "cuda" else None)
        attention = hstu_sequences(
            packed,
            num_targets=batch.host_offsets("candidate_offsets").diff(),
            timestamps=timestamps if self.config.rab else None,
            impl=self.attention_impl(device),
            device=device,
            rab_buckets=(self.config.position_buckets, self.config.time_buckets) if self.config.rab else None,
        )
        return Packing(packed, attention, timestamps, recency, age, source, candidate_slot, sample_of_candidate)

    def forward(
        self,
        batch: Batch,
        attention_plan: None = None,
        embedding_ids: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """``attention_plan``: none is taken (:meth:`needs_plan`); ``embedding_ids``: this batch's
        :meth:`embedding_ids` where the step has them (pipelines.models.protocol), else computed here."""
        kept = truncate(batch, self.config.max_uih)
        ids = embedding_ids["item_embedding"] if embedding_ids is not None else self.item_ids(batch, kept)
        rows = self.item_embedding(ids)
        if batch.batch_size == 0:
            # Still tied to the embedding lookup, so a sharded table's backward exchange runs on this rank too.
            return rows.new_zeros(0, self.config.num_labels) + rows.sum() * 0
        num_content = batch.content_ids.numel()
        history, content = rows[: rows.shape[0] - num_content], rows[rows.shape[0] - num_content :]
        if batch.uih_action_types is not None:
            history = history + self.action_embedding(batch.uih_action_types[kept.flat] % self.config.num_actions)
        # A candidate's token: the sum of its content-id rows (a candidate without content gets a zero vector).
        candidates = torch.segment_reduce(content, "sum", lengths=batch.candidate_lengths, axis=0, unsafe=True)
        seq = self._pack(batch, kept)
        x = torch.cat([history, candidates])[seq.source]
        if self.position_embedding is not None:
            x = x + self.position_embedding(position_bucket(seq.recency, self.config.position_buckets))
            if seq.age is not None:
                x = x + self.time_embedding(time_bucket(seq.age, self.config.time_buckets))
        if not self.config.fp32_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self._layer_calls(x.device):
            x = layer(x, seq)
        out = self.norm(x)[seq.candidate_slot]
        dense = self.dense_proj(batch.dense)[seq.sample_of_candidate]
        return self.head(torch.cat([out, dense], dim=-1))
