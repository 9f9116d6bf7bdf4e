"""Triton row-wise optimizer update: fsembed.optim's duplicate-row sum and a row's update in one pass.

One program per segment of the stably sorted ids (a segment: one row's entries, in arrival order). It sums the
row's gradient entries in fp32, in an order fixed by that list alone (:func:`_summed`), and updates the row, its
moments and its per-row state from the sum, one column block at a time; the segments past the unique rows are
empty (the segment offsets come from a ``nonzero_static`` of the segment starts, so the count of unique rows never
reaches the host). No atomics. Against the eager optimizers (a sum pass, then a dozen index_select / arithmetic /
index_copy_ passes over every entry's [M, D] rows) it reads each gradient entry once and each touched row's
weight and state once, and writes them once.

Kinds (``KIND``): 0 SGD, 1 row-wise Adagrad (``row_state``: the accumulator; the row's mean of g^2 needs the whole
row first, so its segment is summed twice), 2 Adam (``row_state``: the step count; ``m``, ``v`` per element). The
arithmetic is fsembed.optim's, in its order, in fp32 (beta^step in fp64, rounded to fp32 as torch's fp32 pow is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import next_power_of_2

KINDS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
ROW_BLOCK_D = 256  # columns per step of a program's walk along its row
ROW_BLOCK_E = 16  # a segment's entries summed at once


@triton.jit
def _summed(grads, order, start, end, stride_g, cols, mask, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """The segment's gradient entries at ``cols``, summed in fp32: ``BLOCK_E`` entries at a time into a tile that
    starts at the segment's first entry, then the tile's rows (a popular row's thousands of entries load in
    parallel; the order depends on the segment's entries alone)."""
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        entries = e0 + tl.arange(0, BLOCK_E)
        inside = entries < end
        src = tl.load(order + entries, mask=inside, other=0).to(tl.int64)
        at = src[:, None] * stride_g + cols[None, :]
        acc += tl.load(grads + at, mask=inside[:, None] & mask[None, :], other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _correction(step, beta):
    """1 - beta^step, the power in fp64 and rounded to fp32 (torch's fp32 pow of beta as fp32)."""
    b = tl.cast(beta, tl.float64)
    return 1.0 - tl.exp(step.to(tl.float64) * tl.log(b)).to(tl.float32)


@triton.jit
def _rowwise_update_kernel(
    sorted_ids, order, offsets, grads, weight, m_state, v_state, row_state,
    width, stride_g, stride_w, lr, beta1, beta2, eps,
    KIND: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(offsets + seg)
    end = tl.load(offsets + seg + 1)
    if start < end:
        row = tl.load(sorted_ids + start).to(tl.int64)
        base = tl.arange(0, BLOCK_D)
        mult = lr
        c1 = 1.0
        c2 = 1.0
        if KIND == 1:  # acc += mean over the row of g^2, then w -= lr g / (sqrt(acc) + eps)
            squares = tl.zeros([BLOCK_D], dtype=tl.float32)
            for c0 in range(0, width, BLOCK_D):
                cols = c0 + base
                g = _summed(grads, order, start, end, stride_g, cols, cols < width, BLOCK_E, BLOCK_D)
                squares += g * g
            acc = tl.load(row_state + row) + tl.sum(squares, axis=0) / width
            tl.store(row_state + row, acc)
            mult = lr / (tl.sqrt(acc) + eps)
        if KIND == 2:  # the row's step count, then its bias corrections
            step = tl.load(row_state + row) + 1.0
            tl.store(row_state + row, step)
            c1 = _correction(step, beta1)
            c2 = _correction(step, beta2)
        for c0 in range(0, width, BLOCK_D):
            cols = c0 + base
            mask = cols < width
            g = _summed(grads, order, start, end, stride_g, cols, mask, BLOCK_E, BLOCK_D)
            at = row * stride_w + cols
            w = tl.load(weight + at, mask=mask).to(tl.float32)
            if KIND == 2:
                m = tl.load(m_state + at, mask=mask) * beta1 + g * (1 - beta1)
                v = tl.load(v_state + at, mask=mask) * beta2 + g * g * (1 - beta2)
                tl.store(m_state + at, m, mask=mask)
                tl.store(v_state + at, v, mask=mask)
                new = w - lr * (m / c1) / (tl.sqrt(v / c2) + eps)
            else:
                new = w - mult * g
            tl.store(weight + at, new.to(weight.dtype.element_ty), mask=mask)


def rowwise_update(
    kind: str,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    sorted_ids: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    beta1: float = 0.0,
    beta2: float = 0.0,
    eps: float = 0.0,
) -> None:
    """Updates ``weight`` [R, D] (rows contiguous) and ``state`` in place from ``grads`` [M, D]: segment k of the
    sorted ids is entries ``order[offsets[k]:offsets[k+1]]`` of one row (:func:`fsembed.optim.duplicate_segments`).
    ``state``: ``sum`` [R] (rowwise_adagrad), or ``m``, ``v`` [R, D] fp32 and ``step`` [R] (adam)."""
    entries, width = grads.shape
    if entries == 0 or width == 0:
        return
    if weight.stride(1) != 1 or any(not t.is_contiguous() for t in state.values()):
        raise ValueError("kernels.triton_rowwise: the weight's rows and the optimizer state must be dense")
    grads = grads if grads.stride(1) == 1 else grads.contiguous()
    unused = weight  # never read: the kind's flag keeps its loads off
    row_state = state.get("sum", state.get("step", unused))
    _rowwise_update_kernel[(entries,)](
        sorted_ids, order, offsets, grads, weight, state.get("m", unused), state.get("v", unused), row_state,
        width, grads.stride(0), weight.stride(0), float(lr), float(beta1), float(beta2), float(eps),
        KIND=KINDS[kind], BLOCK_E=ROW_BLOCK_E, BLOCK_D=min(ROW_BLOCK_D, next_power_of_2(width)),
    )  # fmt: skip
