"""The one dispatch point of the jagged attention: ``from kernels.attention import jagged_attention``.

Tokens are packed ``[N, heads, dim]`` with int64 offsets (B + 1 entries); each query attends only to keys of its
own sample: ``causal=True`` (self-attention over one set of offsets, a query sees the keys at or before it) or
``causal=False`` (cross attention between two sets of offsets, every key of the sample: a candidate over its
sample's UIH). A query whose sample has no keys gets zeros. Implementations (:class:`AttentionImpl`):

- ``FLEX``: torch's FlexAttention, compiled, with a block mask built from the offsets in O(blocks)
  (:mod:`kernels.flex.block_mask`). The default for CUDA tensors. FlexAttention has no CPU backward.
- ``TORCH``: one fused SDPA per sample (:mod:`kernels.pytorch.pt_jagged_attention`), the same numbers: the
  default on CPU, and the reference the FlexAttention path is tested against.
- ``PADDED``: every sample padded to the batch's longest, one SDPA: the baseline the jagged paths are measured
  against, never the default.

The offsets are read on the host: pass host tensors (a CUDA tensor is copied back, a device sync). FLEX takes the
``block_mask`` the loader built for the batch (``JaggedBlockMask``, on the device); without one it builds it here.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import torch

from kernels.flex.block_mask import JaggedBlockMask, build_block_mask
from kernels.pytorch import pt_jagged_attention


class AttentionImpl(enum.Enum):
    FLEX = "flex"
    TORCH = "torch"
    PADDED = "padded"


def resolve_impl(impl: Union[AttentionImpl, str, None], device: torch.device) -> AttentionImpl:
    if impl is None:
        return AttentionImpl.FLEX if device.type == "cuda" else AttentionImpl.TORCH
    if isinstance(impl, AttentionImpl):
        return impl
    if isinstance(impl, str):
        try:
            return AttentionImpl(impl.lower())
        except ValueError:
            raise ValueError(f"unknown attention impl {impl!r}; expected one of {[i.value for i in AttentionImpl]}") from None
    raise ValueError(f"attention impl must be an AttentionImpl, a string or None, got {type(impl).__name__}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"kernels.attention.jagged_attention: {message}")


def _host_offsets(name: str, offsets: torch.Tensor, rows: int) -> list[int]:
    _require(offsets.dim() == 1 and offsets.numel() >= 1, f"{name} must be 1-D with at least one entry, got shape {tuple(offsets.shape)}")
    _require(offsets.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {offsets.dtype}")
    values = offsets.tolist()
    _require(values[0] == 0 and values[-1] == rows, f"{name} must run from 0 to the {rows} packed rows, got [{values[0]}, {values[-1]}]")
    bad = next((s for s in range(len(values) - 1) if values[s + 1] < values[s]), None)
    _require(bad is None, f"{name} must be non-decreasing; sample {bad} has a negative length")
    return values


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: Optional[torch.Tensor] = None,
    *,
    causal: bool,
    block_mask: Optional[JaggedBlockMask] = None,
    impl: Union[AttentionImpl, str, None] = None,
) -> torch.Tensor:
    """Softmax attention of packed queries ``q`` [Nq, H, D] over packed keys/values ``k``/``v`` [Nkv, H, D],
    within each sample; returns [Nq, H, D]. ``kv_offsets`` defaults to ``q_offsets`` (causal takes only those)."""
    _require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q, k, v must be [N, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _require(q.shape[1:] == k.shape[1:] == v.shape[1:], f"q, k, v must agree in heads and dim, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _require(k.shape[0] == v.shape[0], f"k and v must have the same rows, got {k.shape[0]} and {v.shape[0]}")
    _require(q.device == k.device == v.device, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if kv_offsets is None:
        kv_offsets = q_offsets
    _require(q_offsets.numel() == kv_offsets.numel(), f"q_offsets has {q_offsets.numel() - 1} samples, kv_offsets {kv_offsets.numel() - 1}")
    if causal:
        _require(q.shape[0] == k.shape[0], f"causal attention needs as many queries as keys, got {q.shape[0]} and {k.shape[0]}")
    kind = resolve_impl(impl, q.device)
    match kind:
        case AttentionImpl.FLEX:
            _require(q.is_cuda, "the FlexAttention path runs on CUDA (it has no CPU backward); use impl='torch' on CPU")
            if block_mask is None:
                block_mask = build_block_mask(q_offsets.cpu(), None if causal else kv_offsets.cpu(), causal=causal).to(q.device)
            _require(block_mask.causal == causal and (block_mask.num_q, block_mask.num_kv) == (q.shape[0], k.shape[0]),
                     f"block_mask is for {'causal' if block_mask.causal else 'cross'} attention of {block_mask.num_q} x "
                     f"{block_mask.num_kv} rows, got {'causal' if causal else 'cross'} {q.shape[0]} x {k.shape[0]}")
            _require(block_mask.device == q.device, f"block_mask is on {block_mask.device}, q on {q.device}")
            if q.shape[0] == 0:
                return q.new_zeros(0, q.shape[1], v.shape[2])
            from kernels.flex import flex_jagged_attention

            return flex_jagged_attention.jagged_attention(q, k, v, block_mask)
        case AttentionImpl.TORCH | AttentionImpl.PADDED:
            qo = _host_offsets("q_offsets", q_offsets, q.shape[0])
            ko = qo if kv_offsets is q_offsets else _host_offsets("kv_offsets", kv_offsets, k.shape[0])
            _require(not causal or qo == ko, "causal attention takes one set of offsets (queries and keys alike)")
            twin = pt_jagged_attention.jagged_attention if kind is AttentionImpl.TORCH else pt_jagged_attention.padded_attention
            return twin(q, k, v, qo, ko, causal)
        case other:
            raise ValueError(f"kernels.attention.jagged_attention: unhandled impl {other}")
