"""The one dispatch point of the jagged attention: ``from kernels.attention import jagged_attention``.

Tokens are packed ``[N, heads, dim]`` with int64 offsets (B + 1 entries); each query attends only to keys of its
own sample: ``causal=True`` (self-attention over one set of offsets, a query sees the keys at or before it) or
``causal=False`` (cross attention between two sets of offsets, every key of the sample: a candidate over its
sample's UIH). A query whose sample has no keys gets zeros. Implementations (:class:`kernels.impl.Impl`):

- ``VARLEN``: PyTorch's variable-length FlashAttention (:mod:`kernels.varlen.varlen_jagged_attention`) over
  int32 device offsets: no block mask, no compilation, no host work per call when the offsets come as
  :class:`PackedOffsets`. The default for CUDA tensors. bf16/fp16 kernels (fp32 inputs are cast for the call).
  Its backward is bitwise reproducible only under ``torch.use_deterministic_algorithms(True)``, which slows it.
- ``FLEX``: torch's FlexAttention, compiled, with a block mask built from the offsets in O(blocks)
  (:mod:`kernels.flex.block_mask`). Bitwise reproducible as it is: the default of the deterministic mode
  (``resolve_impl(None, device, deterministic=True)``). FlexAttention has no CPU backward.
- ``TORCH``: one fused SDPA per sample (:mod:`kernels.pytorch.pt_jagged_attention`), the same numbers: the
  default on CPU, and the twin the FlexAttention path is tested against.
- ``PADDED``: every sample padded to the batch's longest, one SDPA: the baseline the jagged paths are measured
  against, never the default.

Offsets come as host int64 tensors or as :class:`PackedOffsets` (the host offsets beside their int32 device copy
and the longest length), which a model builds once per batch. TORCH and PADDED read host values (a CUDA tensor is
copied back, a device sync); VARLEN reads the device copy (made here from host offsets when absent); FLEX takes
the ``block_mask`` the loader built for the batch (``JaggedBlockMask``, on the device), else builds it here.
Which implementations need a host-built plan: :data:`NEEDS_BLOCK_MASK`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kernels.flex.block_mask import JaggedBlockMask, build_block_mask
from kernels.impl import Impl, resolve
from kernels.pytorch import pt_jagged_attention

#: The implementations of the jagged attention (kernels.impl names every kernel implementation).
SUPPORTED = (Impl.VARLEN, Impl.FLEX, Impl.TORCH, Impl.PADDED)


#: The implementations whose kernels take a block mask built on the host from the batch's offsets: a model using
#: one wants the loader's attention-plan stage; the others need no plan.
NEEDS_BLOCK_MASK = frozenset({Impl.FLEX})
#: Where torch's varlen FlashAttention runs (its CPU build imports but raises): the dispatch refuses other devices.
VARLEN_DEVICE_TYPES = ("cuda",)


def resolve_impl(impl: Union[Impl, str, None], device: torch.device, *, deterministic: bool = False) -> Impl:
    """The implementation to run: ``impl`` as given, else the default for ``device`` (VARLEN on CUDA, TORCH on
    CPU), where ``deterministic`` picks FLEX on CUDA (reproducible without the global deterministic flag, and
    faster than VARLEN under it)."""
    default = Impl.TORCH if device.type != "cuda" else (Impl.FLEX if deterministic else Impl.VARLEN)
    return resolve(impl, op="attention", supported=SUPPORTED, default=default)


def is_deterministic(impl: Impl, device: torch.device) -> bool:
    """Whether ``impl``'s backward gives the same bits on every run, as the process is set up now: on CPU every
    implementation is; on CUDA FLEX always, the SDPA/FlashAttention ones only under
    ``torch.use_deterministic_algorithms(True)`` (torch then selects their deterministic backward)."""
    if device.type != "cuda" or impl is Impl.FLEX:
        return True
    return torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True)
class PackedOffsets:
    """One set of packed-sequence offsets in every form the implementations read, built once per batch: ``host``
    int64 on the CPU (B + 1 entries, from 0 to the packed rows), ``device`` the same as int32 on the tokens'
    device (VARLEN's ``cu_seqlens``; None on CPU-only paths), ``max_len`` the longest sample."""

    host: torch.Tensor
    device: Optional[torch.Tensor]
    max_len: int

    @classmethod
    def from_host(
        cls, host: torch.Tensor, device: Union[str, torch.device, None] = None, on_device: Optional[torch.Tensor] = None
    ) -> "PackedOffsets":
        """From host offsets; the device copy is ``on_device`` (any integer dtype, e.g. offsets a model already
        computed there) as int32, else a copy of ``host`` to ``device`` (none without a device)."""
        _require(
            host.device.type == "cpu" and host.dim() == 1 and host.numel() >= 1,
            f"PackedOffsets.host must be a 1-D CPU tensor with at least one entry, got {tuple(host.shape)} on "
            f"{host.device}",
        )
        host = host.to(torch.int64)
        longest = int((host[1:] - host[:-1]).max()) if host.numel() > 1 else 0
        if on_device is not None:
            dev = on_device.to(torch.int32)
        elif device is not None:
            dev = host.to(torch.int32).to(device, non_blocking=True)
        else:
            dev = None
        return cls(host, dev, longest)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"kernels.attention.jagged_attention: {message}")


def _host_offsets(name: str, offsets: torch.Tensor, rows: int) -> list[int]:
    _require(
        offsets.dim() == 1 and offsets.numel() >= 1,
        f"{name} must be 1-D with at least one entry, got shape {tuple(offsets.shape)}",
    )
    _require(offsets.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {offsets.dtype}")
    values = offsets.tolist()
    _require(
        values[0] == 0 and values[-1] == rows,
        f"{name} must run from 0 to the {rows} packed rows, got [{values[0]}, {values[-1]}]",
    )
    bad = next((s for s in range(len(values) - 1) if values[s + 1] < values[s]), None)
    _require(bad is None, f"{name} must be non-decreasing; sample {bad} has a negative length")
    return values


Offsets = Union[torch.Tensor, PackedOffsets]


def _host(offsets: Offsets) -> torch.Tensor:
    return offsets.host if isinstance(offsets, PackedOffsets) else offsets


def _packed(name: str, offsets: Offsets, rows: int, device: torch.device) -> PackedOffsets:
    """VARLEN's view of ``offsets``: as given when packed with a device copy (checked by shape only: reading its
    values would cost the host work and sync it exists to avoid), else packed here from validated host values."""
    if isinstance(offsets, PackedOffsets) and offsets.device is not None:
        _require(
            offsets.device.device == device and offsets.device.numel() == offsets.host.numel(),
            f"{name}: the device offsets ({offsets.device.numel()} entries on {offsets.device.device}) must match "
            f"the host ones ({offsets.host.numel()}) and be on {device}",
        )
        return offsets
    host = _host(offsets).cpu()
    _host_offsets(name, host, rows)
    return PackedOffsets.from_host(host, device)


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: Offsets,
    kv_offsets: Optional[Offsets] = None,
    *,
    causal: bool,
    block_mask: Optional[JaggedBlockMask] = None,
    impl: Union[Impl, str, None] = None,
) -> torch.Tensor:
    """Softmax attention of packed queries ``q`` [Nq, H, D] over packed keys/values ``k``/``v`` [Nkv, H, D],
    within each sample; returns [Nq, H, D]. ``kv_offsets`` defaults to ``q_offsets`` (causal takes only those)."""
    _require(
        q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
        f"q, k, v must be [N, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}",
    )
    _require(
        q.shape[1:] == k.shape[1:] == v.shape[1:],
        f"q, k, v must agree in heads and dim, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}",
    )
    _require(k.shape[0] == v.shape[0], f"k and v must have the same rows, got {k.shape[0]} and {v.shape[0]}")
    _require(q.device == k.device == v.device, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if kv_offsets is None:
        kv_offsets = q_offsets
    _require(
        _host(q_offsets).numel() == _host(kv_offsets).numel(),
        f"q_offsets has {_host(q_offsets).numel() - 1} samples, kv_offsets {_host(kv_offsets).numel() - 1}",
    )
    if causal:
        _require(
            q.shape[0] == k.shape[0],
            f"causal attention needs as many queries as keys, got {q.shape[0]} and {k.shape[0]}",
        )
    kind = resolve_impl(impl, q.device)
    match kind:
        case Impl.VARLEN:
            _require(
                q.device.type in VARLEN_DEVICE_TYPES,
                "the VARLEN path runs on CUDA (FlashAttention); use impl='torch' on CPU",
            )
            qp = _packed("q_offsets", q_offsets, q.shape[0], q.device)
            kp = qp if kv_offsets is q_offsets else _packed("kv_offsets", kv_offsets, k.shape[0], q.device)
            from kernels.varlen import varlen_jagged_attention

            return varlen_jagged_attention.jagged_attention(
                q, k, v, qp.device, kp.device, qp.max_len, kp.max_len, causal
            )
        case Impl.FLEX:
            _require(q.is_cuda, "the FlexAttention path runs on CUDA (it has no CPU backward); use impl='torch' on CPU")
            if block_mask is None:
                qh, kh = _host(q_offsets).cpu(), _host(kv_offsets).cpu()
                block_mask = build_block_mask(qh, None if causal else kh, causal=causal).to(q.device)
            _require(
                block_mask.causal == causal and (block_mask.num_q, block_mask.num_kv) == (q.shape[0], k.shape[0]),
                f"block_mask is for {'causal' if block_mask.causal else 'cross'} attention of {block_mask.num_q} x "
                f"{block_mask.num_kv} rows, got {'causal' if causal else 'cross'} {q.shape[0]} x {k.shape[0]}",
            )
            _require(block_mask.device == q.device, f"block_mask is on {block_mask.device}, q on {q.device}")
            if q.shape[0] == 0:
                return q.new_zeros(0, q.shape[1], v.shape[2])
            from kernels.flex import flex_jagged_attention

            return flex_jagged_attention.jagged_attention(q, k, v, block_mask)
        case Impl.TORCH | Impl.PADDED:
            qo = _host_offsets("q_offsets", _host(q_offsets), q.shape[0])
            ko = qo if kv_offsets is q_offsets else _host_offsets("kv_offsets", _host(kv_offsets), k.shape[0])
            _require(not causal or qo == ko, "causal attention takes one set of offsets (queries and keys alike)")
            twin = pt_jagged_attention.jagged_attention if kind is Impl.TORCH else pt_jagged_attention.padded_attention
            return twin(q, k, v, qo, ko, causal)
        case other:
            raise ValueError(f"kernels.attention.jagged_attention: unhandled impl {other}")
