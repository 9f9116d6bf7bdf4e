"""The one dispatch point of the jagged kernels: ``from kernels import ops``.

Every op validates its inputs once, here, then runs one implementation chosen by :class:`kernels.impl.Impl`:

- ``Impl.TRITON``: the Triton kernel (default for CUDA tensors; on CPU only under ``TRITON_INTERPRET=1``,
  which is how the tests run it).
- ``Impl.TORCH``: the vectorized PyTorch twin (default for CPU tensors; what the tests check the kernels against).
- ``Impl.EAGER``: the naive per-sample loop (kernels/pytorch/pt_eager.py); the benchmark's baseline, never the
  training path.

Shape and dtype checks always run. Checks that read tensor *values* (offsets non-decreasing, indices in range,
a permutation really being one) need a device-to-host sync, so they run on CPU tensors always and on CUDA
tensors only when ``FREESCALE_CHECK_KERNEL_INPUTS=1`` (a debugging switch: the hot path must not sync).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional, Union

import torch

from kernels.impl import Impl, resolve
from kernels.pytorch import pt_eager as eager
from kernels.pytorch import pt_jagged_gather, pt_ranged, pt_segment

_OFFSET_DTYPES = (torch.int32, torch.int64)
CHECK_ENV = "FREESCALE_CHECK_KERNEL_INPUTS"


#: The implementations every op here has.
SUPPORTED = (Impl.TRITON, Impl.TORCH, Impl.EAGER)


def _resolve(op: str, impl: Union[Impl, str, None], tensor: torch.Tensor) -> Impl:
    return resolve(impl, op=f"ops.{op}", supported=SUPPORTED, default=Impl.TRITON if tensor.is_cuda else Impl.TORCH)


def _check_values(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) or os.environ.get(CHECK_ENV, "") == "1"


def _require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise ValueError(f"kernels.ops.{op}: {message}")


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    _require(len(set(devices.values())) == 1, op, f"all inputs must be on one device, got {devices}")


def _check_offsets(op: str, offsets: torch.Tensor, num_values: int, name: str = "offsets", cover: bool = False) -> None:
    _require(
        offsets.dim() == 1 and offsets.numel() >= 1,
        op,
        f"{name} must be 1-D with at least one entry, got shape {tuple(offsets.shape)}",
    )
    _require(offsets.dtype in _OFFSET_DTYPES, op, f"{name} must be int32 or int64, got {offsets.dtype}")
    if not _check_values(offsets):
        return
    if offsets.numel() > 1:
        bad = torch.nonzero(offsets[1:] < offsets[:-1]).flatten()
        _require(
            bad.numel() == 0,
            op,
            f"{name} must be non-decreasing; segment {int(bad[0]) if bad.numel() else -1} has negative length",
        )
    first, last = int(offsets[0]), int(offsets[-1])
    _require(first >= 0, op, f"{name}[0] = {first} is negative")
    _require(last <= num_values, op, f"{name}[-1] = {last} exceeds the {num_values} value rows")
    if cover:
        _require(
            first == 0 and last == num_values,
            op,
            f"{name} must span all {num_values} value rows, got [{first}, {last}]",
        )


def _check_values_tensor(op: str, values: torch.Tensor) -> None:
    _require(values.dim() >= 1, op, "values must have at least one dimension, got a scalar")


def _no_grad_through_triton(op: str, values: torch.Tensor) -> None:
    """Only ranged_combine has a Triton backward; elsewhere a silently detached output would lose gradients."""
    _require(
        not (values.requires_grad and torch.is_grad_enabled()),
        op,
        "the Triton kernel is not differentiable; pass impl=Impl.TORCH for values that require grad",
    )


def _run(
    op: str,
    impl: Union[Impl, str, None],
    tensor: torch.Tensor,
    *,
    triton: Callable[[Any], Any],
    twin: Callable[[], Any],
    eager_loop: Callable[[], Any],
    differentiable_input: Optional[torch.Tensor] = None,
):
    """The one dispatch of every op: ``triton(module)`` gets ``kernels.triton.<module of the op>`` (imported here,
    lazily: CPU runs never need Triton), ``twin()`` and ``eager_loop()`` run the other two. A Triton kernel
    without a backward refuses a ``differentiable_input`` that requires grad."""
    match _resolve(op, impl, tensor):
        case Impl.TRITON:
            if differentiable_input is not None:
                _no_grad_through_triton(op, differentiable_input)
            return triton(importlib.import_module(f"kernels.triton.{_TRITON_MODULE[op]}"))
        case Impl.TORCH:
            return twin()
        case Impl.EAGER:
            return eager_loop()
        case other:
            raise ValueError(f"kernels.ops.{op}: unhandled impl {other}")


# The Triton module that holds each op's kernel.
_TRITON_MODULE = {
    "indexed_permute": "triton_jagged_gather",
    "keyed_transpose": "triton_jagged_gather",
    "ranged_dispatch": "triton_ranged",
    "ranged_combine": "triton_ranged",
    "segment_sum": "triton_segment",
    "collision_mask": "triton_segment",
}


# --------------------------------------------------------------------------------------------------------------
def indexed_permute(
    values: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    *,
    output_size: Optional[int] = None,
    impl: Union[Impl, str, None] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate segments ``order[0], order[1], ...`` of the jagged tensor (values [N, *], offsets [S+1]).

    ``order`` [K] int64 may be a permutation or a selection (repeats allowed). Returns (out_values,
    out_offsets [K+1], offsets' dtype). ``output_size`` (the sum of the selected lengths), when the caller
    knows it, saves the device-to-host sync that sizing the output otherwise needs.
    """
    op = "indexed_permute"
    _check_values_tensor(op, values)
    _check_offsets(op, offsets, values.shape[0])
    _require(
        order.dim() == 1 and order.dtype == torch.int64,
        op,
        f"order must be a 1-D int64 tensor, got {order.dtype} of shape {tuple(order.shape)}",
    )
    _check_same_device(op, values=values, offsets=offsets, order=order)
    num_segments = offsets.numel() - 1
    if order.numel() and _check_values(order):
        lo, hi = int(order.min()), int(order.max())
        _require(
            lo >= 0 and hi < num_segments,
            op,
            f"order holds segment {lo if lo < 0 else hi}, outside [0, {num_segments})",
        )
    _require(output_size is None or output_size >= 0, op, f"output_size must be >= 0, got {output_size}")
    return _run(
        op,
        impl,
        values,
        differentiable_input=values,
        triton=lambda m: m.indexed_permute(values, offsets, order, output_size),
        twin=lambda: pt_jagged_gather.indexed_permute(values, offsets, order, output_size),
        eager_loop=lambda: eager.indexed_permute(values, offsets, order),
    )


def keyed_transpose(
    values: torch.Tensor, lengths: torch.Tensor, *, impl: Union[Impl, str, None] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major jagged layout (KeyedJaggedTensor order: lengths [F, B], all samples of key 0, then key 1,
    ...) -> batch-major (sample 0's keys, then sample 1's, ...). Returns (out_values, out_lengths [B, F])."""
    op = "keyed_transpose"
    _check_values_tensor(op, values)
    _require(lengths.dim() == 2, op, f"lengths must be 2-D [num_keys, batch_size], got shape {tuple(lengths.shape)}")
    _require(lengths.dtype in _OFFSET_DTYPES, op, f"lengths must be int32 or int64, got {lengths.dtype}")
    _check_same_device(op, values=values, lengths=lengths)
    if lengths.numel() and _check_values(lengths):
        _require(int(lengths.min()) >= 0, op, "lengths must be non-negative")
        total = int(lengths.sum())
        _require(total == values.shape[0], op, f"lengths sum to {total} but values has {values.shape[0]} rows")
    return _run(
        op,
        impl,
        values,
        differentiable_input=values,
        triton=lambda m: m.keyed_transpose(values, lengths),
        twin=lambda: pt_jagged_gather.keyed_transpose(values, lengths),
        eager_loop=lambda: eager.keyed_transpose(values, lengths),
    )


# --------------------------------------------------------------------------------------------------------------
def ranged_dispatch(
    ids: torch.Tensor,
    boundaries: torch.Tensor,
    *,
    offsets: Optional[torch.Tensor] = None,
    impl: Union[Impl, str, None] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group ids by owning shard (shard r owns rows [boundaries[r], boundaries[r+1])), stably.

    Returns (send_ids [N], splits [W] int64, perm [N] int64) with ``send_ids[j] == ids[perm[j]]``: the send
    buffer and splits of the ID AllToAll; ``perm`` is what :func:`ranged_combine` inverts on the way back.
    ``offsets`` (the samples' id ranges) is used only by the eager baseline (one sample at a time).
    """
    op = "ranged_dispatch"
    _require(
        ids.dim() == 1 and ids.dtype == torch.int64,
        op,
        f"ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}",
    )
    _require(
        boundaries.dim() == 1 and boundaries.numel() >= 2 and boundaries.dtype == torch.int64,
        op,
        f"boundaries must be 1-D int64 with world_size + 1 >= 2 entries, got {boundaries.dtype} of shape "
        f"{tuple(boundaries.shape)}",
    )
    _check_same_device(op, ids=ids, boundaries=boundaries)
    if _check_values(boundaries, ids):
        bad = torch.nonzero(boundaries[1:] < boundaries[:-1]).flatten()
        _require(
            bad.numel() == 0,
            op,
            f"boundaries must be sorted; shard {int(bad[0]) if bad.numel() else -1} ends before it starts",
        )
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            b0, bw = int(boundaries[0]), int(boundaries[-1])
            _require(lo >= b0 and hi < bw, op, f"id {lo if lo < b0 else hi} is outside the sharded rows [{b0}, {bw})")
    return _run(
        op,
        impl,
        ids,
        triton=lambda m: m.ranged_dispatch(ids, boundaries),
        twin=lambda: pt_ranged.ranged_dispatch(ids, boundaries),
        eager_loop=lambda: eager.ranged_dispatch(ids, boundaries, offsets),
    )


def ranged_combine(
    values: torch.Tensor,
    perm: torch.Tensor,
    *,
    splits: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    impl: Union[Impl, str, None] = None,
) -> torch.Tensor:
    """Inverse of the dispatch permutation: ``out[perm[j]] = values[j]`` (values [N, *], e.g. the embeddings
    that came back in shard-major order). Differentiable: the backward gathers ``grad_out[perm]``.
    ``splits`` and ``offsets`` (the samples' rows of the output) are used only by the eager baseline (one
    scatter per sample and source shard)."""
    op = "ranged_combine"
    _check_values_tensor(op, values)
    _require(
        perm.dim() == 1 and perm.dtype == torch.int64,
        op,
        f"perm must be a 1-D int64 tensor, got {perm.dtype} of shape {tuple(perm.shape)}",
    )
    _require(
        perm.numel() == values.shape[0], op, f"perm has {perm.numel()} entries but values has {values.shape[0]} rows"
    )
    _check_same_device(op, values=values, perm=perm)
    if perm.numel() and _check_values(perm):
        lo, hi = int(perm.min()), int(perm.max())
        _require(lo >= 0 and hi < perm.numel(), op, f"perm holds {lo if lo < 0 else hi}, outside [0, {perm.numel()})")
        _require(
            bool((torch.bincount(perm, minlength=perm.numel()) == 1).all()),
            op,
            "perm is not a permutation (an index repeats)",
        )
    return _run(
        op,
        impl,
        values,
        triton=lambda m: m.ranged_combine(values, perm),
        twin=lambda: pt_ranged.ranged_combine(values, perm),
        eager_loop=lambda: eager.ranged_combine(values, perm, splits, offsets),
    )


# --------------------------------------------------------------------------------------------------------------
def segment_sum(values: torch.Tensor, offsets: torch.Tensor, *, impl: Union[Impl, str, None] = None) -> torch.Tensor:
    """Sum of each jagged segment (values [N, *], offsets [S+1] spanning all N rows) -> [S, *].

    Integers sum in (and return) int64; floats accumulate in fp32 and return in their own dtype. E.g. the
    AllToAll send splits from per-sample lengths in plan order and the plan's dest_offsets.
    """
    op = "segment_sum"
    _check_values_tensor(op, values)
    _require(values.dtype != torch.bool, op, "values must be numeric, got bool")
    _check_offsets(op, offsets, values.shape[0], cover=True)
    _check_same_device(op, values=values, offsets=offsets)
    return _run(
        op,
        impl,
        values,
        differentiable_input=values,
        triton=lambda m: m.segment_sum(values, offsets),
        twin=lambda: pt_segment.segment_sum(values, offsets),
        eager_loop=lambda: eager.segment_sum(values, offsets),
    )


def collision_mask(
    ids: torch.Tensor,
    other: torch.Tensor,
    *,
    offsets: Optional[torch.Tensor] = None,
    impl: Union[Impl, str, None] = None,
) -> torch.Tensor:
    """BoolTensor[len(ids)]: ``ids[i] in other`` (Algorithm 2's collision marking between batch i and i+1).
    ``offsets`` is used only by the eager baseline (one membership test per segment, e.g. per sample)."""
    op = "collision_mask"
    _require(
        ids.dim() == 1 and other.dim() == 1,
        op,
        f"ids and other must be 1-D, got shapes {tuple(ids.shape)} and {tuple(other.shape)}",
    )
    _require(
        ids.dtype in _OFFSET_DTYPES and other.dtype == ids.dtype,
        op,
        f"ids and other must share an integer dtype (int32/int64), got {ids.dtype} and {other.dtype}",
    )
    _check_same_device(op, ids=ids, other=other)
    return _run(
        op,
        impl,
        ids,
        triton=lambda m: m.collision_mask(ids, other),
        twin=lambda: pt_segment.collision_mask(ids, other),
        eager_loop=lambda: eager.collision_mask(ids, other, offsets),
    )
