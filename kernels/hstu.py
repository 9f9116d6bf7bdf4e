"""The one dispatch point of the jagged HSTU attention: ``from kernels.hstu import hstu_attention``.

HSTU (Hierarchical Sequential Transduction Units) replaces softmax by a pointwise SiLU:

    A = SiLU(alpha * Q K^T + rab) / n * mask,   out = A V

over packed tokens ``[N, heads, dim]`` with int offsets (B + 1 entries). The mask is causal; the last
``num_targets[s]`` tokens of sample ``s`` are its targets (candidates), which see the history and themselves but not
each other (their positions are clamped to the first target's); ``window`` > 0 keeps only keys at most that many
positions back. ``n`` is ``seq_norm`` (the model's longest sequence) or, when None, each sample's own length.
``rab``, the relative attention bias, is a learned weight per head and per bucket of position distance
(``position_weights`` [H, P]) plus one per bucket of the absolute time gap between the query's and the key's
``timestamps`` (``time_weights`` [H, T]); buckets: :func:`kernels.pytorch.pt_hstu_attention.position_bucket`
and ``time_bucket`` (exact below 16 positions / 1 s, then log-spaced). Either weight may be None (rab off).

Implementations (:class:`kernels.impl.Impl`):

- ``TRITON``: the fused kernel (:mod:`kernels.triton.triton_hstu_attention`): rab read from the batch's pair buckets
  where they fit ``pair_budget`` (and where dS fits too, from a per-pair bias one pass gathers for each layer's
  forward and, above head dim 64, another for its dK/dV pass), else computed inside from positions and
  timestamps; no dense score tensor; backward in two passes (keys, then queries) with no atomics, the second
  reading the score gradients the first kept where they fit ``pair_budget`` (else recomputing them), the bucket
  weights' gradients by per-program sums: the same bits on every run. A torch operator
  (``freescale::hstu_attention``) with its own autograd formula, so torch.compile traces a layer through it. The
  default on CUDA.
- ``TORCH``: per-sample dense twin (:mod:`kernels.pytorch.pt_hstu_attention`), autograd for the backward: the
  default on CPU and the twin the kernel is tested against.
- ``PADDED``: the batch padded to its longest sample, one [B, H, L, L] score tensor: the baseline.

A model runs the attention in every layer over one batch: :func:`hstu_sequences` checks the batch's offsets,
targets and timestamps once and makes what the kernel reads on the device once (int32 offsets, the samples'
order), and every layer passes the :class:`HSTUSequences` in place of the offsets. Bad inputs end in one line:
``num_targets`` outside [0, the sample's length], timestamps that are not integers. Timestamps are any int64
(the kernel's time buckets are exact for every gap); the buckets are log-spaced in the timestamps' unit, which
the HSTU model takes to be seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from kernels.attention import Offsets, PackedOffsets, _host_offsets
from kernels.impl import Impl, resolve
from kernels.pytorch import pt_hstu_attention

#: The buckets rab reads, for a model that embeds positions and time gaps the same way.
position_bucket = pt_hstu_attention.position_bucket
time_bucket = pt_hstu_attention.time_bucket

SUPPORTED = (Impl.TRITON, Impl.TORCH, Impl.PADDED)


def resolve_impl(impl: Union[Impl, str, None], device: torch.device) -> Impl:
    """``impl`` as given, else TRITON on CUDA and TORCH elsewhere."""
    return resolve(impl, op="hstu", supported=SUPPORTED, default=Impl.TRITON if device.type == "cuda" else Impl.TORCH)


def _require(cond: bool, message: Union[str, Callable[[], str]]) -> None:
    """Refuses in one line. ``message`` may be a function, called only on failure: a message that formats a size
    must not be built on the way, since under torch.compile a symbolic size in an f-string breaks the graph."""
    if not cond:
        raise ValueError(f"kernels.hstu.hstu_attention: {message() if callable(message) else message}")


@dataclass(frozen=True)
class HSTUSequences:
    """One batch's packed sequences as an implementation reads them, checked once (:func:`hstu_sequences`) and
    passed to the attention of every layer in place of the offsets."""

    impl: Impl
    offsets: PackedOffsets  # host offsets, and their int32 device copy for TRITON
    num_tokens: int
    num_targets: Optional[torch.Tensor]  # [B]: int32 on the device for TRITON, host int64 otherwise
    timestamps: Optional[torch.Tensor]  # [N] int64 on the tokens' device
    order: Optional[torch.Tensor]  # TRITON: the samples longest first (int32, device)
    # TRITON: where each sample's causal pairs start in a per-pair tensor (int64 [B], device) and their count
    # (:func:`kernels.triton.triton_hstu_attention.pair_layout`); the bytes per-pair tensors may take
    # (``pair_budget``); the pairs' rab buckets for tables of ``rab_buckets`` sizes where computed once.
    pair_layout: Optional[tuple[torch.Tensor, int]] = None
    pair_budget: int = 0
    pair_buckets: Optional[torch.Tensor] = None
    rab_buckets: Optional[tuple[int, int]] = None


def hstu_sequences(
    offsets: Offsets,
    *,
    num_targets: Optional[torch.Tensor] = None,
    timestamps: Optional[torch.Tensor] = None,
    impl: Union[Impl, str, None] = None,
    device: Union[torch.device, str],
    pair_budget: Optional[int] = None,
    rab_buckets: Optional[tuple[int, int]] = None,
) -> HSTUSequences:
    """``offsets`` (host, or :class:`PackedOffsets`), ``num_targets`` [B] and ``timestamps`` [N] checked and put in
    the form ``impl`` reads on ``device``. ``num_targets`` on the host costs no sync (on a device it is copied back
    once to be checked). For the Triton kernel, ``pair_budget`` bounds the bytes of each tensor kept per causal pair
    of tokens (sum L (L + 1) / 2 pairs): the backward's score gradients (heads x 2 or 4 bytes a pair; kept with rab
    or a head dim above 64, where they pay), so that its dQ pass is one matmul instead of recomputing the scores,
    and, with ``rab_buckets`` (the sizes of the position and time weight tables every layer passes, each at most
    256), the pairs' buckets (4 bytes a pair: a key-major and a query-major copy, each pass reading the one that
    runs along its tiles), computed once for all layers and heads instead of in every pass; a batch over it
    computes them where they are needed. With both, each layer's forward also reads its per-pair bias (as large as
    dS, made by one pass over the pairs) instead of gathering the bias per score.
    None: an eighth of the device's memory (the host's for the CPU, where Triton's interpreter runs the kernel);
    0: nothing kept."""
    device = torch.device(device)
    kind = resolve_impl(impl, device)
    host = offsets.host if isinstance(offsets, PackedOffsets) else offsets.cpu()
    values = _host_offsets("offsets", host, int(host[-1]) if host.numel() else 0)
    batch, tokens = len(values) - 1, values[-1]
    if num_targets is not None:
        _require(
            num_targets.shape == (batch,) and not num_targets.is_floating_point(),
            f"num_targets must be [B={batch}] integers, got {tuple(num_targets.shape)} {num_targets.dtype}",
        )
        targets = num_targets.cpu().to(torch.int64)
        lengths = torch.tensor(values[1:]) - torch.tensor(values[:-1])
        bad = ((targets < 0) | (targets > lengths)).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(
                f"kernels.hstu.hstu_attention: num_targets of sample {s} is {int(targets[s])}, outside [0, its "
                f"length {int(lengths[s])}]"
            )
    if timestamps is not None:
        _require(
            timestamps.shape == (tokens,) and timestamps.dtype in (torch.int64, torch.int32),
            f"timestamps must be [N={tokens}] int64 (seconds), got {tuple(timestamps.shape)} {timestamps.dtype}",
        )
        timestamps = timestamps.to(device=device, dtype=torch.int64)
    if kind is not Impl.TRITON:
        host_targets = targets if num_targets is not None else None
        return HSTUSequences(kind, PackedOffsets.from_host(host), tokens, host_targets, timestamps, None)
    from kernels.triton import triton_hstu_attention

    packed = offsets if isinstance(offsets, PackedOffsets) and offsets.device is not None else None
    packed = packed or PackedOffsets.from_host(host, device)
    dev = packed.device.to(device=device, dtype=torch.int32)
    if num_targets is not None:
        num_targets = num_targets.to(device=device, dtype=torch.int32, non_blocking=True)
    order = triton_hstu_attention.sample_order(dev)
    if pair_budget is None:
        pair_budget = _device_memory(device) // 8
    _require(pair_budget >= 0, lambda: f"pair_budget must be >= 0 bytes, got {pair_budget}")
    layout = buckets = None
    if pair_budget:  # nothing per pair is kept without a budget: no layout to build
        base, pairs = triton_hstu_attention.pair_layout(host[1:] - host[:-1])
        layout = (base.to(device, non_blocking=True), pairs)
    paired = rab_buckets is not None and max(rab_buckets) <= triton_hstu_attention.PAIRED_BUCKETS
    if layout is not None and paired and 0 < 4 * layout[1] <= pair_budget:
        buckets = triton_hstu_attention.pair_buckets(
            dev, order, packed.max_len, layout, num_targets, timestamps, rab_buckets
        )
    offsets = PackedOffsets(host, dev, packed.max_len)
    return HSTUSequences(
        kind, offsets, tokens, num_targets, timestamps, order, layout, pair_budget, buckets, rab_buckets
    )


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: Union[Offsets, HSTUSequences],
    *,
    alpha: float,
    seq_norm: Optional[int] = None,
    num_targets: Optional[torch.Tensor] = None,
    window: int = 0,
    position_weights: Optional[torch.Tensor] = None,
    time_weights: Optional[torch.Tensor] = None,
    timestamps: Optional[torch.Tensor] = None,
    impl: Union[Impl, str, None] = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """HSTU attention of packed ``q``, ``k`` [N, H, D] and ``v`` [N, H, Dv] within each sample; returns [N, H, Dv].
    ``offsets``: host offsets or :class:`PackedOffsets` with ``num_targets`` [B] integers (None: no targets) and
    ``timestamps`` [N] int64 (needed with ``time_weights``); or an :class:`HSTUSequences` that holds all three
    (and the implementation: ``impl`` must then be None or the same). Every implementation's backward gives the
    same bits on every run; ``deterministic`` makes the Triton kernel's also equal across processes (one fixed
    launch configuration instead of the autotuner's timed pick, which could tile, and so sum, differently)."""
    if isinstance(offsets, HSTUSequences):
        seqs = offsets
        _require(
            num_targets is None and timestamps is None,
            "num_targets and timestamps come inside the HSTUSequences, not beside them",
        )
        _require(
            impl is None or resolve_impl(impl, q.device) is seqs.impl,
            f"impl {impl} differs from the HSTUSequences' {seqs.impl.value}",
        )
    else:
        seqs = hstu_sequences(offsets, num_targets=num_targets, timestamps=timestamps, impl=impl, device=q.device)
    _validate(q, k, v, seqs, window, seq_norm, position_weights, time_weights)
    timed = time_weights is not None
    if seqs.impl is Impl.TRITON:
        from kernels.triton import triton_hstu_attention

        return triton_hstu_attention.hstu_attention(
            q,
            k,
            v,
            seqs.offsets.device,
            seqs.offsets.max_len,
            alpha=alpha,
            seq_norm=seq_norm,
            num_targets=seqs.num_targets,
            window=window,
            position_weights=position_weights,
            time_weights=time_weights,
            timestamps=seqs.timestamps if timed else None,
            order=seqs.order,
            fixed=deterministic,
            layout=seqs.pair_layout,
            keep_ds=_keeps_score_grads(seqs, q, position_weights is not None or time_weights is not None),
            pair_buckets=_pair_buckets(seqs, position_weights, time_weights),
        )
    twin = pt_hstu_attention.hstu_attention if seqs.impl is Impl.TORCH else pt_hstu_attention.padded_hstu_attention
    return twin(
        q,
        k,
        v,
        seqs.offsets.host.tolist(),
        alpha=alpha,
        seq_norm=seq_norm,
        num_targets=seqs.num_targets.tolist() if seqs.num_targets is not None else None,
        window=window,
        position_weights=position_weights,
        time_weights=time_weights,
        timestamps=seqs.timestamps if timed else None,
    )


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _keeps_score_grads(seqs: HSTUSequences, q: torch.Tensor, rab: bool) -> bool:
    """Whether the backward keeps dS: where it fits the sequences' budget, and pays. With rab it saves the dQ pass
    the bias and its two matmuls, and a head dim above 64 makes those matmuls the larger cost; at 64 without rab,
    the store and the reads of dS cost more than the recomputed scores they replace (BENCHMARKS.md)."""
    if seqs.pair_layout is None or not (rab or q.shape[2] > 64):
        return False
    return 0 < seqs.pair_layout[1] * q.shape[1] * q.element_size() <= seqs.pair_budget


def _pair_buckets(seqs: HSTUSequences, position_weights, time_weights) -> Optional[torch.Tensor]:
    """The batch's precomputed pair buckets where they were computed for tables of these sizes, else None."""
    if seqs.pair_buckets is None:
        return None
    sizes = seqs.rab_buckets
    fits = position_weights is None or position_weights.shape[1] == sizes[0]
    fits = fits and (time_weights is None or (seqs.timestamps is not None and time_weights.shape[1] == sizes[1]))
    return seqs.pair_buckets if fits else None


def _validate(q, k, v, seqs: HSTUSequences, window, seq_norm, position_weights, time_weights) -> None:
    """Shapes, devices and options, each refused in one line naming the argument (no tensor values read: this
    runs in every layer, under torch.compile too, where it must trace into the layer's one graph: the messages
    that format sizes are built only on failure)."""
    _require(
        q.dim() == 3 and k.shape == q.shape and v.dim() == 3 and v.shape[:2] == q.shape[:2],
        lambda: (
            f"q and k must be [N, heads, dim] alike and v [N, heads, dim_v], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        ),
    )
    _require(q.shape[0] == seqs.num_tokens, lambda: f"q has {q.shape[0]} rows, the offsets {seqs.num_tokens}")
    _require(
        q.device == k.device == v.device,
        lambda: f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}",
    )
    _require(window >= 0, lambda: f"window must be >= 0 (0: no window), got {window}")
    _require(seq_norm is None or seq_norm > 0, lambda: f"seq_norm must be positive or None, got {seq_norm}")
    heads = q.shape[1]
    for name, w in (("position_weights", position_weights), ("time_weights", time_weights)):
        _require(
            w is None or (w.dim() == 2 and w.shape[0] == heads and w.shape[1] >= 1),
            lambda: f"{name} must be [heads={heads}, buckets], got {None if w is None else tuple(w.shape)}",
        )
    _require(
        time_weights is None or seqs.timestamps is not None,
        lambda: f"time_weights need timestamps [N={seqs.num_tokens}]",
    )
