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

- ``TRITON``: the fused kernel (:mod:`kernels.triton.triton_hstu_attention`): rab computed inside from positions and
  timestamps, never an L x L tensor; backward in two passes (keys, then queries) with no atomics, the bucket
  weights' gradients by per-program sums: the same bits on every run. The default on CUDA.
- ``TORCH``: per-sample dense twin (:mod:`kernels.pytorch.pt_hstu_attention`), autograd for the backward: the
  default on CPU and the reference.
- ``PADDED``: the batch padded to its longest sample, one [B, H, L, L] score tensor: the baseline.
"""

from __future__ import annotations

from typing import Optional, Union

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


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"kernels.hstu.hstu_attention: {message}")


def _validate(q, k, v, host, window, seq_norm, num_targets, position_weights, time_weights, timestamps) -> None:
    """Shapes, devices and options, each refused in one line naming the argument."""
    _require(
        q.dim() == 3 and k.shape == q.shape and v.dim() == 3 and v.shape[:2] == q.shape[:2],
        f"q and k must be [N, heads, dim] alike and v [N, heads, dim_v], got {tuple(q.shape)}, {tuple(k.shape)}, "
        f"{tuple(v.shape)}",
    )
    _require(q.device == k.device == v.device, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    _require(window >= 0, f"window must be >= 0 (0: no window), got {window}")
    _require(seq_norm is None or seq_norm > 0, f"seq_norm must be positive or None, got {seq_norm}")
    heads = q.shape[1]
    for name, w in (("position_weights", position_weights), ("time_weights", time_weights)):
        _require(
            w is None or (w.dim() == 2 and w.shape[0] == heads and w.shape[1] >= 1),
            f"{name} must be [heads={heads}, buckets], got {None if w is None else tuple(w.shape)}",
        )
    if time_weights is not None:
        _require(
            timestamps is not None and timestamps.shape == (q.shape[0],),
            f"time_weights need timestamps [N={q.shape[0]}], got "
            f"{None if timestamps is None else tuple(timestamps.shape)}",
        )
    batch = host.numel() - 1
    if num_targets is not None:
        _require(num_targets.shape == (batch,), f"num_targets must be [B={batch}], got {tuple(num_targets.shape)}")


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: Offsets,
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
    """HSTU attention of packed ``q``, ``k`` [N, H, D] and ``v`` [N, H, Dv] within each sample of ``offsets``;
    returns [N, H, Dv]. ``num_targets``: [B] integers (None: no targets). ``timestamps``: [N] int64, needed with
    ``time_weights``. ``deterministic``: accepted for the callers of a deterministic mode; every implementation's
    backward already gives the same bits on every run (the Triton one has no atomics)."""
    host = offsets.host if isinstance(offsets, PackedOffsets) else offsets
    _validate(q, k, v, host, window, seq_norm, num_targets, position_weights, time_weights, timestamps)
    kind = resolve_impl(impl, q.device)
    if kind is Impl.TRITON:
        from kernels.triton import triton_hstu_attention

        packed = offsets if isinstance(offsets, PackedOffsets) else None
        if packed is None or packed.device is None:
            _host_offsets("offsets", host.cpu(), q.shape[0])
            packed = PackedOffsets.from_host(host.cpu(), q.device)
        return triton_hstu_attention.hstu_attention(
            q,
            k,
            v,
            packed.device,
            packed.max_len,
            alpha=alpha,
            seq_norm=seq_norm,
            num_targets=num_targets,
            window=window,
            position_weights=position_weights,
            time_weights=time_weights,
            timestamps=timestamps,
        )
    values = _host_offsets("offsets", host.cpu(), q.shape[0])
    twin = pt_hstu_attention.hstu_attention if kind is Impl.TORCH else pt_hstu_attention.padded_hstu_attention
    return twin(
        q,
        k,
        v,
        values,
        alpha=alpha,
        seq_norm=seq_norm,
        num_targets=num_targets.tolist() if num_targets is not None else None,
        window=window,
        position_weights=position_weights,
        time_weights=time_weights,
        timestamps=timestamps,
    )
