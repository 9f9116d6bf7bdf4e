"""Twins of the jagged HSTU attention: per-sample dense (the CPU path, and what the kernel is tested against) and
the padded baseline.

Both materialize each sample's (or the padded batch's) L x L scores, which is what the Triton kernel never does;
autograd gives their backward. Every quantity is computed in fp32 and cast back to the inputs' dtype at the end,
so the twin is the accuracy yardstick for the kernel's bf16 path.

The bucket functions here are the definition the kernel mirrors bit for bit (integer and float-exponent
arithmetic only, no transcendental whose rounding could differ between the two).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

#: Distances below this get a bucket each; above it, :data:`POSITION_SUB_BITS` bits per octave (log buckets).
POSITION_LINEAR = 16
POSITION_SUB_BITS = 2
#: Time gaps (seconds) below this get a bucket each; above it, :data:`TIME_SUB_BITS` bits per octave.
TIME_LINEAR = 1
TIME_SUB_BITS = 1


def log_bucket(x: torch.Tensor, linear: int, sub_bits: int, num_buckets: int) -> torch.Tensor:
    """Bucket of each non-negative integer in ``x``: itself below ``linear`` (a power of two), else ``linear`` plus
    ``2**sub_bits`` buckets per octave above it, read from the float32 exponent and top mantissa bits (exact, no
    log); clamped to ``num_buckets - 1``."""
    xf = x.clamp(min=1).to(torch.float32)
    bits = xf.view(torch.int32)
    exponent = (bits >> 23) - 127
    mantissa = (bits >> (23 - sub_bits)) & ((1 << sub_bits) - 1)
    log_part = linear + ((exponent - (linear.bit_length() - 1)) << sub_bits) + mantissa
    return torch.where(x < linear, x.to(torch.int32), log_part).clamp(0, num_buckets - 1)


def position_bucket(distance: torch.Tensor, num_buckets: int) -> torch.Tensor:
    return log_bucket(distance, POSITION_LINEAR, POSITION_SUB_BITS, num_buckets)


def time_bucket(gap: torch.Tensor, num_buckets: int) -> torch.Tensor:
    return log_bucket(gap.abs(), TIME_LINEAR, TIME_SUB_BITS, num_buckets)


def _positions(length: int, targets: int, device) -> torch.Tensor:
    """Each token's position, the targets' clamped to the first target's (every candidate is equally 'next')."""
    return torch.arange(length, device=device).clamp(max=length - targets)


def sample_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    length: int,
    targets: int,
    *,
    alpha: float,
    window: int,
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's fp32 scores ``alpha * q k^T + rab`` [H, L, L] and its validity mask [L, L]: a query sees
    itself and the keys at earlier positions (targets share one position, so they see the history and
    themselves), and with ``window`` > 0 only keys at most ``window`` positions back."""
    pos = _positions(length, targets, q.device)
    dist = pos[:, None] - pos[None, :]
    ar = torch.arange(length, device=q.device)
    valid = (dist > 0) | (ar[:, None] == ar[None, :])
    if window > 0:
        valid &= dist <= window
    s = alpha * torch.einsum("ihd,jhd->hij", q.float(), k.float())
    if position_weights is not None:
        s = s + position_weights.float()[:, position_bucket(dist.clamp(min=0), position_weights.shape[1])]
    if time_weights is not None:
        gap = timestamps[:, None] - timestamps[None, :]
        s = s + time_weights.float()[:, time_bucket(gap, time_weights.shape[1])]
    return s, valid


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    *,
    alpha: float,
    seq_norm: Optional[int],
    num_targets: Optional[list[int]],
    window: int,
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
) -> torch.Tensor:
    """``SiLU(alpha q k^T + rab) / n`` masked, times ``v``, per sample (host ``offsets``); [N, H, Dv]."""
    parts = []
    for s in range(len(offsets) - 1):
        a, b = offsets[s], offsets[s + 1]
        if b == a:
            continue
        scores, valid = sample_scores(
            q[a:b],
            k[a:b],
            b - a,
            num_targets[s] if num_targets is not None else 0,
            alpha=alpha,
            window=window,
            position_weights=position_weights,
            time_weights=time_weights,
            timestamps=timestamps[a:b] if timestamps is not None else None,
        )
        weights = F.silu(scores) * valid / (seq_norm if seq_norm is not None else b - a)
        parts.append(torch.einsum("hij,jhd->ihd", weights, v[a:b].float()).to(v.dtype))
    return torch.cat(parts) if parts else v[:0]  # a slice: still part of the autograd graph


def padded_hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    *,
    alpha: float,
    seq_norm: Optional[int],
    num_targets: Optional[list[int]],
    window: int,
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
) -> torch.Tensor:
    """The padded baseline: the batch padded to its longest sample, one [B, H, L, L] score tensor in the inputs'
    dtype (what a dense implementation holds), masked per sample."""
    b = len(offsets) - 1
    if b == 0 or q.shape[0] == 0:
        return v.new_zeros(0, *v.shape[1:])
    device = q.device
    lengths = torch.tensor([offsets[s + 1] - offsets[s] for s in range(b)], device=device)
    longest = int(lengths.max())
    starts = torch.tensor(offsets[:-1], device=device)
    ar = torch.arange(longest, device=device)
    real = ar[None, :] < lengths[:, None]  # [B, L]
    index = (starts[:, None] + ar[None, :]).clamp(max=max(q.shape[0] - 1, 0))

    def pad(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [B, H, L, D], zero past each sample's end
        return (x[index] * real[..., None, None].to(x.dtype)).transpose(1, 2)

    targets = torch.tensor(num_targets, device=device) if num_targets is not None else torch.zeros_like(lengths)
    pos = torch.minimum(ar[None, :], (lengths - targets)[:, None])  # [B, L]
    dist = pos[:, :, None] - pos[:, None, :]
    valid = ((dist > 0) | torch.eye(longest, dtype=torch.bool, device=device)) & real[:, :, None] & real[:, None, :]
    if window > 0:
        valid &= dist <= window
    s = alpha * (pad(q) @ pad(k).transpose(-1, -2))
    if position_weights is not None:
        bucket = position_bucket(dist.clamp(min=0), position_weights.shape[1])
        s = s + position_weights.to(s.dtype)[:, bucket].transpose(0, 1)
    if time_weights is not None:
        ts = timestamps[index]
        bucket = time_bucket(ts[:, :, None] - ts[:, None, :], time_weights.shape[1])
        s = s + time_weights.to(s.dtype)[:, bucket].transpose(0, 1)
    norm = float(seq_norm) if seq_norm is not None else lengths.clamp(min=1).to(s.dtype)[:, None, None, None]
    weights = F.silu(s) * valid[:, None] / norm
    out = (weights @ pad(v)).transpose(1, 2)  # [B, L, H, Dv]
    return out[real]
