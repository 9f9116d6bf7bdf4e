"""Jagged attention through ``torch.nn.attention.varlen.varlen_attn``: FlashAttention over packed tokens.

The kernel reads int32 cumulative offsets on the device and the longest length as host ints, so a caller that
keeps both for its batch (:class:`kernels.attention.PackedOffsets`) pays no host work and no device sync per
call: no block mask, no compilation. Causal self-attention is the window ``(-1, 0)``; cross attention (every
key of the sample) is ``(-1, -1)`` with separate query and key offsets.

Precision. FlashAttention takes fp16 and bf16 only. Inputs in fp32 (a model run without autocast) are cast to
bf16 for the kernel call and the output cast back: the attention itself then runs in bf16, which is what the
tolerances against the fp32 per-sample twin state (tests/kernels/test_attention_gpu.py). Under autocast q, k and
v may arrive in different dtypes (a LayerNorm's fp32 output beside a Linear's bf16 one): all three take the
autocast dtype, else q's low precision, else bf16.

A query whose sample has no keys gets zeros: the kernel's output for such rows is replaced by zeros through a
``where`` on a per-query flag computed on the device, so the contract does not rest on the kernel's handling
of empty key ranges (and its gradient into those rows is zero).

Arguments are passed by keyword: the signature grows between torch releases (2.13 adds several).
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def kernel_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the kernel runs in for these inputs (see the module docstring)."""
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        if dtype in LOW_PRECISION:
            return dtype
    for t in tensors:
        if t.dtype in LOW_PRECISION:
            return t.dtype
    return torch.bfloat16


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q: int,
    max_kv: int,
    causal: bool,
) -> torch.Tensor:
    """``q`` [Nq, H, D], ``k``/``v`` [Nkv, H, D]; ``cu_q``/``cu_kv`` int32 [B + 1] on q's device."""
    from torch.nn.attention.varlen import varlen_attn

    dtype = kernel_dtype(q, k, v)
    if q.shape[0] == 0 or max_q == 0 or max_kv == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2]).to(q.dtype)
    # Autocast does not cover this custom op: the casts are explicit, and the call runs with autocast off so
    # its own internals see exactly these dtypes.
    with torch.autocast("cuda", enabled=False):
        out = varlen_attn(
            query=q.to(dtype),
            key=k.to(dtype),
            value=v.to(dtype),
            cu_seq_q=cu_q,
            cu_seq_k=cu_kv,
            max_q=int(max_q),
            max_k=int(max_kv),
            window_size=(-1, 0) if causal else (-1, -1),
        )
    if not causal:
        out = torch.where(_has_keys(cu_q, cu_kv, q.shape[0])[:, None, None], out, out.new_zeros(()))
    return out if out.dtype == q.dtype or torch.is_autocast_enabled("cuda") else out.to(q.dtype)


def _has_keys(cu_q: torch.Tensor, cu_kv: torch.Tensor, rows: int) -> torch.Tensor:
    """Per query row, whether its sample has at least one key; on the device, sized from ``rows`` (no sync)."""
    q_lengths = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    has = (cu_kv[1:] - cu_kv[:-1]) > 0
    return torch.repeat_interleave(has, q_lengths, output_size=rows)
