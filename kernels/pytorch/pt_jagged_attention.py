"""Twins of the jagged attention: per-sample SDPA (the CPU path, and what the kernels are tested against) and the
padded baseline.

The twin runs one fused ``scaled_dot_product_attention`` per sample: the exact jagged computation, with no
padding and no N^2 mask (a masked whole-batch twin would hold N^2 scores). It is the one per-sample loop
among the twins: a sample's attention is already one whole-tensor op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def jagged_attention(q, k, v, q_offsets: list[int], kv_offsets: list[int], causal: bool) -> torch.Tensor:
    """``q`` [Nq, H, D], ``k``/``v`` [Nkv, H, D]; offsets as host lists. A query whose sample has no keys gets 0."""
    parts = []
    for s in range(len(q_offsets) - 1):
        qa, qb, ka, kb = q_offsets[s], q_offsets[s + 1], kv_offsets[s], kv_offsets[s + 1]
        if qb == qa:
            continue
        if kb == ka:
            parts.append(q.new_zeros(qb - qa, q.shape[1], v.shape[2]))
            continue
        one = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1), is_causal=causal
        )
        parts.append(one.transpose(0, 1))
    return torch.cat(parts) if parts else q.new_zeros(0, q.shape[1], v.shape[2])


def _pad(x: torch.Tensor, offsets: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, D] -> [B, H, length, D] and each row's flat slot in [B * length]."""
    b = len(offsets) - 1
    lengths = torch.tensor([offsets[s + 1] - offsets[s] for s in range(b)], dtype=torch.int64, device=x.device)
    starts = torch.tensor(offsets[:-1], dtype=torch.int64, device=x.device)
    sample = torch.repeat_interleave(torch.arange(b, device=x.device), lengths, output_size=x.shape[0])
    slot = sample * length + torch.arange(x.shape[0], device=x.device) - starts[sample]
    padded = x.new_zeros(b * length, *x.shape[1:]).index_copy(0, slot, x)
    return padded.view(b, length, *x.shape[1:]).transpose(1, 2), slot


def padded_attention(q, k, v, q_offsets: list[int], kv_offsets: list[int], causal: bool) -> torch.Tensor:
    """The padded baseline: every sample padded to the batch's longest, one SDPA over ``[B, H, L, D]``. Causal
    attention needs no mask (padding follows each sample's last token, so a real query never sees it) and gets
    the fused kernels; cross attention masks the padded keys. A query whose sample has no keys gets 0."""
    b = len(q_offsets) - 1
    if b == 0 or q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    q_len = max(q_offsets[s + 1] - q_offsets[s] for s in range(b))
    kv_len = max(max(kv_offsets[s + 1] - kv_offsets[s] for s in range(b)), 1)
    qp, q_slot = _pad(q, q_offsets, q_len)
    kp, _ = _pad(k, kv_offsets, kv_len)
    vp, _ = _pad(v, kv_offsets, kv_len)
    if causal:
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    else:
        kv_lengths = torch.tensor([kv_offsets[s + 1] - kv_offsets[s] for s in range(b)], device=q.device)
        valid = torch.arange(kv_len, device=q.device) < kv_lengths[:, None]
        # A sample without keys attends to one zero key instead of none (no NaN), then its output is zeroed.
        valid[:, 0] = True
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=valid[:, None, None, :])
        out = out * (kv_lengths > 0).to(out.dtype)[:, None, None, None]
    return out.transpose(1, 2).reshape(b * q_len, q.shape[1], v.shape[2]).index_select(0, q_slot)
