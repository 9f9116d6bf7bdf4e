"""Triton jagged HSTU attention, forward and backward, with the relative attention bias computed inside.

Layout. Tokens packed [N, H, D] (rows contiguous), int32 device offsets, the batch's longest length from the host
(the grid; never read back from the device). One program per (query or key block, head, sample): the grid's
first axis walks a sample's blocks from the last (the most keys under the causal mask) to the first, its second
axis the samples longest first (a device argsort, no sync), so the heaviest programs start first and the short
ones fill the tail. A block beyond its sample's length returns at once.

Scores. s = alpha * q k^T + rab, A = SiLU(s) / n: no softmax, so no running max or row sums, and a query block
accumulates ``A V`` in one pass. A tile needs the mask only where it crosses the diagonal, the targets, the window
or the sample's end (one scalar test per tile). rab is gathered per element from the [H, buckets] weight tables
(small enough to stay in L1/L2) by the buckets of kernels.pytorch.pt_hstu_attention, mirrored here with the same
integer and float-exponent arithmetic, so the twin and the kernel agree on every bucket.

Backward, deterministic for q, k and v: one pass over key blocks accumulates dK and dV in registers (FlashAttention
2's order), a second over query blocks recomputes the scores and accumulates dQ; no atomics, no locks. The dQ
pass repeats two of the five matmuls (q k^T and dO v^T): 7 instead of 5, the price of no atomics. The bucket
weights' gradient is the sum of dS over each bucket. Along a key's row of the transposed tile the buckets come in
runs (position buckets always; time buckets when the timestamps are ordered), so a row's prefix sum of dS adds
each run with two atomics at its ends instead of one per element. ``deterministic``: each program sums its tiles'
buckets in registers instead (a loop over the buckets a tile holds) and writes one row per program, reduced by
torch in a fixed order.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.pytorch.pt_hstu_attention import POSITION_LINEAR, POSITION_SUB_BITS, TIME_LINEAR, TIME_SUB_BITS
from kernels.triton.common import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _log_bucket(x, LINEAR: tl.constexpr, LOG2_LINEAR: tl.constexpr, SUB: tl.constexpr, num_buckets):
    xf = tl.maximum(x, 1).to(tl.float32)
    bits = xf.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = (bits >> (23 - SUB)) & ((1 << SUB) - 1)
    log_part = LINEAR + ((exponent - LOG2_LINEAR) << SUB) + mantissa
    bucket = tl.where(x < LINEAR, x.to(tl.int32), log_part)
    return tl.minimum(tl.maximum(bucket, 0), num_buckets - 1)


@triton.jit
def _position_bucket(dist, num_buckets, P_LINEAR: tl.constexpr, P_LOG2: tl.constexpr, P_SUB: tl.constexpr):
    return _log_bucket(tl.maximum(dist, 0), P_LINEAR, P_LOG2, P_SUB, num_buckets)


@triton.jit
def _time_bucket(gap, num_buckets, T_LINEAR: tl.constexpr, T_LOG2: tl.constexpr, T_SUB: tl.constexpr):
    return _log_bucket(tl.abs(gap), T_LINEAR, T_LOG2, T_SUB, num_buckets)


@triton.jit
def _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS: tl.constexpr):
    """This program's sample: its first row, length, and history length (its first target's position)."""
    sample = tl.load(ORDER + tl.program_id(1))
    start = tl.load(OFFSETS + sample)
    length = tl.load(OFFSETS + sample + 1) - start
    history = length
    if HAS_TARGETS:
        history = tl.maximum(length - tl.load(TARGETS + sample), 0)
    return start.to(tl.int64), length, history


@triton.jit
def _valid(rows_q, rows_k, pos_q, pos_k, length, window, HAS_WINDOW: tl.constexpr):
    """Which (query, key) pairs attend: a query sees itself and keys at earlier (clamped) positions, within the
    window, inside the sample. 2-D when rows_q is [M, 1] and rows_k [1, N] (or transposed)."""
    dist = pos_q - pos_k
    valid = ((dist > 0) | (rows_q == rows_k)) & (rows_k < length) & (rows_q < length)
    if HAS_WINDOW:
        valid = valid & (dist <= window)
    return valid


@triton.jit
def _is_full(q0, q_rows, k0, k_rows, length, history, window, HAS_WINDOW: tl.constexpr):
    """Whether every pair of a query block [q0, q0 + q_rows) and key block [k0, k0 + k_rows) attends (no mask)."""
    full = (k0 + k_rows - 1 <= q0) & (k0 + k_rows <= history) & (q0 + q_rows <= length)
    if HAS_WINDOW:
        full = full & (tl.minimum(q0 + q_rows - 1, history) - k0 <= window)
    return full


@triton.jit
def _bias(
    dist,
    gap,
    h,
    PW,
    TW,
    num_pb,
    num_tb,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
):
    bias = tl.zeros(dist.shape, dtype=tl.float32)
    if HAS_POS:
        bias += tl.load(PW + h * num_pb + _position_bucket(dist, num_pb, P_LINEAR, P_LOG2, P_SUB))
    if HAS_TIME:
        bias += tl.load(TW + h * num_tb + _time_bucket(gap, num_tb, T_LINEAR, T_LOG2, T_SUB))
    return bias


@triton.jit
def _rows(X, start, rows, h, length, H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [len(rows), BLOCK_D] tile of head ``h`` of packed [N, H, DIM] rows (zeros past the sample's end)."""
    cols = tl.arange(0, BLOCK_D)
    ptrs = X + (start + rows.to(tl.int64))[:, None] * (H * DIM) + h * DIM + cols[None, :]
    return tl.load(ptrs, mask=(rows < length)[:, None] & (cols < DIM)[None, :], other=0.0)


@triton.jit
def _store_rows(X, tile, start, rows, h, length, H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    ptrs = X + (start + rows.to(tl.int64))[:, None] * (H * DIM) + h * DIM + cols[None, :]
    tl.store(ptrs, tile.to(X.dtype.element_ty), mask=(rows < length)[:, None] & (cols < DIM)[None, :])


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    OUT,
    OFFSETS,
    ORDER,
    TARGETS,
    TS,
    PW,
    TW,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PER_SAMPLE_NORM: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    PRECISION: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % H
    m0 = (tl.num_programs(0) // H - 1 - pid // H) * BLOCK_M
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    if m0 >= length:
        return
    if PER_SAMPLE_NORM:
        inv_norm = 1.0 / length.to(tl.float32)
    rows_q = m0 + tl.arange(0, BLOCK_M)
    pos_q = tl.minimum(rows_q, history)
    q = _rows(Q, start, rows_q, h, length, H, D, BLOCK_D)
    ts_q = tl.zeros([BLOCK_M], dtype=tl.int64)
    if HAS_TIME:
        ts_q = tl.load(TS + start + rows_q, mask=rows_q < length, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.minimum(m0, history) - window, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M, length)
    for n0 in range(lo, hi, BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pos_k = tl.minimum(rows_k, history)
        k = _rows(K, start, rows_k, h, length, H, D, BLOCK_D)
        v = _rows(V, start, rows_k, h, length, H, DV, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        if HAS_POS or HAS_TIME:
            ts_k = tl.zeros([BLOCK_N], dtype=tl.int64)
            if HAS_TIME:
                ts_k = tl.load(TS + start + rows_k, mask=rows_k < length, other=0)
            s += _bias(
                pos_q[:, None] - pos_k[None, :],
                ts_q[:, None] - ts_k[None, :],
                h,
                PW,
                TW,
                num_pb,
                num_tb,
                HAS_POS,
                HAS_TIME,
                P_LINEAR,
                P_LOG2,
                P_SUB,
                T_LINEAR,
                T_LOG2,
                T_SUB,
            )
        a = s * tl.sigmoid(s) * inv_norm
        if not _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW):
            valid = _valid(rows_q[:, None], rows_k[None, :], pos_q[:, None], pos_k[None, :], length, window, HAS_WINDOW)
            a = tl.where(valid, a, 0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
    _store_rows(OUT, acc, start, rows_q, h, length, H, DV, BLOCK_DV)


@triton.jit
def _bucket_sums(acc, buckets, ds, BUCKETS: tl.constexpr):
    """``acc`` [BUCKETS] plus the sum of ``ds`` over each bucket of the tile, by a loop over the buckets the
    tile holds (deterministic: no atomics)."""
    ids = tl.arange(0, BUCKETS)
    live = ds != 0.0
    lo = tl.min(tl.where(live, buckets, BUCKETS))
    hi = tl.max(tl.where(live, buckets, -1))
    for b in range(lo, hi + 1):
        total = tl.sum(tl.sum(tl.where(buckets == b, ds, 0.0), axis=1), axis=0)
        acc = tl.where(ids == b, acc + total, acc)
    return acc


@triton.jit
def _bucket_atomics(DW, buckets, next_buckets, ds, last_col):
    """Adds the sum of ``ds`` over each bucket to DW: along each row the buckets come in runs, so the row's
    prefix sum at a run's end goes to its bucket, and is taken from the next run's bucket (two atomics per run)."""
    prefix = tl.cumsum(ds, axis=1)
    end = (buckets != next_buckets) | last_col
    live = end & (prefix != 0.0)
    tl.atomic_add(DW + buckets, prefix, mask=live, sem="relaxed")
    tl.atomic_add(DW + next_buckets, -prefix, mask=live & ~last_col, sem="relaxed")


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV_OUT,
    OFFSETS,
    ORDER,
    TARGETS,
    TS,
    PW,
    TW,
    DPW,
    DTW,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PER_SAMPLE_NORM: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    PRECISION: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    PB: tl.constexpr,
    TB: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % H
    n0 = (tl.num_programs(0) // H - 1 - pid // H) * BLOCK_N
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    if n0 >= length:
        return
    if PER_SAMPLE_NORM:
        inv_norm = 1.0 / length.to(tl.float32)
    rows_k = n0 + tl.arange(0, BLOCK_N)
    pos_k = tl.minimum(rows_k, history)
    k = _rows(K, start, rows_k, h, length, H, D, BLOCK_D)
    v = _rows(V, start, rows_k, h, length, H, DV, BLOCK_DV)
    ts_k = tl.zeros([BLOCK_N], dtype=tl.int64)
    if HAS_TIME:
        ts_k = tl.load(TS + start + rows_k, mask=rows_k < length, other=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dpw = tl.zeros([PB], dtype=tl.float32)
    dtw = tl.zeros([TB], dtype=tl.float32)
    hi = length
    if HAS_WINDOW:
        # Rows of the history see keys at most ``window`` back; the targets (all at ``history``) see keys from
        # ``history - window`` on: past both, no query of the sample sees this key block.
        if n0 + BLOCK_N - 1 < history - window:
            hi = tl.minimum(length, n0 + BLOCK_N + window)
    for m0 in range(n0 // BLOCK_M * BLOCK_M, hi, BLOCK_M):
        rows_q = m0 + tl.arange(0, BLOCK_M)
        pos_q = tl.minimum(rows_q, history)
        q = _rows(Q, start, rows_q, h, length, H, D, BLOCK_D)
        do = _rows(DO, start, rows_q, h, length, H, DV, BLOCK_DV)
        # The transposed tile: keys along rows, queries along columns.
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * alpha
        dist = pos_q[None, :] - pos_k[:, None]
        ts_q = tl.zeros([BLOCK_M], dtype=tl.int64)
        if HAS_POS or HAS_TIME:
            if HAS_TIME:
                ts_q = tl.load(TS + start + rows_q, mask=rows_q < length, other=0)
            s += _bias(
                dist,
                ts_q[None, :] - ts_k[:, None],
                h,
                PW,
                TW,
                num_pb,
                num_tb,
                HAS_POS,
                HAS_TIME,
                P_LINEAR,
                P_LOG2,
                P_SUB,
                T_LINEAR,
                T_LOG2,
                T_SUB,
            )
        sig = tl.sigmoid(s)
        a = s * sig * inv_norm
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = dp * (sig * (1.0 + s * (1.0 - sig)) * inv_norm)
        if not _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW):
            valid = _valid(rows_q[None, :], rows_k[:, None], pos_q[None, :], pos_k[:, None], length, window, HAS_WINDOW)
            a = tl.where(valid, a, 0.0)
            ds = tl.where(valid, ds, 0.0)
        dv += tl.dot(a.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
        if HAS_POS:
            buckets = _position_bucket(dist, num_pb, P_LINEAR, P_LOG2, P_SUB)
            if DETERMINISTIC:
                dpw = _bucket_sums(dpw, buckets, ds, PB)
            else:
                next_pos = tl.minimum(rows_q + 1, history)
                nxt = _position_bucket(next_pos[None, :] - pos_k[:, None], num_pb, P_LINEAR, P_LOG2, P_SUB)
                last = (tl.arange(0, BLOCK_M) == BLOCK_M - 1)[None, :]
                _bucket_atomics(DPW + h * num_pb, buckets, nxt, ds, last)
        if HAS_TIME:
            buckets = _time_bucket(ts_q[None, :] - ts_k[:, None], num_tb, T_LINEAR, T_LOG2, T_SUB)
            if DETERMINISTIC:
                dtw = _bucket_sums(dtw, buckets, ds, TB)
            else:
                ts_next = tl.load(TS + start + rows_q + 1, mask=rows_q + 1 < length, other=0)
                nxt = _time_bucket(ts_next[None, :] - ts_k[:, None], num_tb, T_LINEAR, T_LOG2, T_SUB)
                last = (tl.arange(0, BLOCK_M) == BLOCK_M - 1)[None, :]
                _bucket_atomics(DTW + h * num_tb, buckets, nxt, ds, last)
    _store_rows(DK, dk * alpha, start, rows_k, h, length, H, D, BLOCK_D)
    _store_rows(DV_OUT, dv, start, rows_k, h, length, H, DV, BLOCK_DV)
    if DETERMINISTIC:
        program = (tl.program_id(1) * tl.num_programs(0) + pid).to(tl.int64)
        if HAS_POS:
            tl.store(DPW + program * PB + tl.arange(0, PB), dpw)
        if HAS_TIME:
            tl.store(DTW + program * TB + tl.arange(0, TB), dtw)


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    OFFSETS,
    ORDER,
    TARGETS,
    TS,
    PW,
    TW,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PER_SAMPLE_NORM: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    PRECISION: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % H
    m0 = (tl.num_programs(0) // H - 1 - pid // H) * BLOCK_M
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    if m0 >= length:
        return
    if PER_SAMPLE_NORM:
        inv_norm = 1.0 / length.to(tl.float32)
    rows_q = m0 + tl.arange(0, BLOCK_M)
    pos_q = tl.minimum(rows_q, history)
    q = _rows(Q, start, rows_q, h, length, H, D, BLOCK_D)
    do = _rows(DO, start, rows_q, h, length, H, DV, BLOCK_DV)
    ts_q = tl.zeros([BLOCK_M], dtype=tl.int64)
    if HAS_TIME:
        ts_q = tl.load(TS + start + rows_q, mask=rows_q < length, other=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.minimum(m0, history) - window, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M, length)
    for n0 in range(lo, hi, BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pos_k = tl.minimum(rows_k, history)
        k = _rows(K, start, rows_k, h, length, H, D, BLOCK_D)
        v = _rows(V, start, rows_k, h, length, H, DV, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        if HAS_POS or HAS_TIME:
            ts_k = tl.zeros([BLOCK_N], dtype=tl.int64)
            if HAS_TIME:
                ts_k = tl.load(TS + start + rows_k, mask=rows_k < length, other=0)
            s += _bias(
                pos_q[:, None] - pos_k[None, :],
                ts_q[:, None] - ts_k[None, :],
                h,
                PW,
                TW,
                num_pb,
                num_tb,
                HAS_POS,
                HAS_TIME,
                P_LINEAR,
                P_LOG2,
                P_SUB,
                T_LINEAR,
                T_LOG2,
                T_SUB,
            )
        sig = tl.sigmoid(s)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = dp * (sig * (1.0 + s * (1.0 - sig)) * inv_norm)
        if not _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW):
            valid = _valid(rows_q[:, None], rows_k[None, :], pos_q[:, None], pos_k[None, :], length, window, HAS_WINDOW)
            ds = tl.where(valid, ds, 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_rows(DQ, dq * alpha, start, rows_q, h, length, H, D, BLOCK_D)


# Launch configurations, tried by Triton's autotuner once per (head dims, rab, mode), per head-width class: {class:
# [(BLOCK_M, BLOCK_N, warps, stages)]}. The forward and the dQ pass hold a query block and stream keys, the dK/dV
# pass the reverse. Wider heads need smaller blocks to stay within shared memory and registers; FALLBACK fits every
# supported head, fp32 at 256 included.
_FWD_CONFIGS = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
}
_DKDV_CONFIGS = {
    64: [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    256: [(64, 64, 8, 2), (32, 64, 4, 2)],
}
_DQ_CONFIGS = {
    64: [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2)],
    256: [(128, 32, 8, 2), (64, 32, 4, 2)],
}
_FALLBACK = (32, 32, 4, 1)
#: Under the interpreter one small block, so that a short sample still spans several blocks.
_INTERPRETED = {1 << 30: [(16, 16, 1, 1)]}
_SMALLEST_BLOCK = 16 if _INTERPRET else 32


def _tuned(kernel, table: dict[int, list[tuple[int, int, int, int]]], **options):
    """``kernel`` autotuned over the configs of the call's head-width class (the smallest class that holds
    max(BLOCK_D, BLOCK_DV)) and the fallback; with FREESCALE_HSTU_AUTOTUNE=0 (tests: fewer compiles) the class's
    first and the fallback."""
    table = _INTERPRETED if _INTERPRET else {**table, 1 << 30: [_FALLBACK]}
    configs, width_class = [], {}
    for width, rows in sorted(table.items()):
        for m, n, w, st in rows:
            config = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            configs.append(config)
            width_class[id(config)] = width

    def prune(candidates, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head = max(args["BLOCK_D"], args["BLOCK_DV"])
        fits = min((width for width in table if width >= head), default=max(table))
        kept = [c for c in candidates if width_class[id(c)] == fits]
        if os.environ.get("FREESCALE_HSTU_AUTOTUNE") == "0":
            kept = kept[:1]
        return kept + [c for c in candidates if width_class[id(c)] == 1 << 30 and c not in kept]

    return triton.autotune(configs, prune_configs_by={"early_config_prune": prune}, **options)(kernel)


_KEY = ["D", "DV", "H", "HAS_POS", "HAS_TIME", "HAS_TARGETS", "HAS_WINDOW"]
_fwd = _tuned(_fwd_kernel, _FWD_CONFIGS, key=_KEY)
_dkdv = _tuned(_dkdv_kernel, _DKDV_CONFIGS, key=_KEY + ["DETERMINISTIC"], reset_to_zero=["DPW", "DTW"])
_dq = _tuned(_dq_kernel, _DQ_CONFIGS, key=_KEY)

_BUCKET_CONSTANTS = dict(
    P_LINEAR=POSITION_LINEAR,
    P_LOG2=POSITION_LINEAR.bit_length() - 1,
    P_SUB=POSITION_SUB_BITS,
    T_LINEAR=TIME_LINEAR,
    T_LOG2=TIME_LINEAR.bit_length() - 1,
    T_SUB=TIME_SUB_BITS,
)


class _Launch:
    """What the three kernels share for one call: tensors, flags and the grid (blocks of the longest sample)."""

    def __init__(self, q, v, offsets, order, targets, timestamps, pw, tw, max_len, alpha, seq_norm, window):
        self.batch, self.heads, self.max_len = offsets.numel() - 1, q.shape[1], max_len
        self.pw, self.tw = pw, tw
        dummy = offsets  # a valid pointer for the absent optional tensors (never read: their flag is off)
        self.tensors = dict(
            OFFSETS=offsets,
            ORDER=order,
            TARGETS=targets if targets is not None else dummy,
            TS=timestamps if timestamps is not None else dummy,
            PW=pw if pw is not None else q,
            TW=tw if tw is not None else q,
        )
        self.scalars = dict(
            alpha=float(alpha),
            inv_norm=1.0 / seq_norm if seq_norm is not None else 1.0,
            window=int(window),
            num_pb=pw.shape[1] if pw is not None else 1,
            num_tb=tw.shape[1] if tw is not None else 1,
        )
        self.flags = dict(
            H=q.shape[1],
            D=q.shape[2],
            DV=v.shape[2],
            BLOCK_D=max(16, next_power_of_2(q.shape[2])),
            BLOCK_DV=max(16, next_power_of_2(v.shape[2])),
            PER_SAMPLE_NORM=seq_norm is None,
            HAS_TARGETS=targets is not None,
            HAS_WINDOW=window > 0,
            HAS_POS=pw is not None,
            HAS_TIME=tw is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            **_BUCKET_CONSTANTS,
        )

    def grid(self, block: str):
        return lambda meta: (cdiv(max(self.max_len, 1), meta[block]) * self.heads, self.batch)


def _forward(launch: _Launch, q, k, v) -> torch.Tensor:
    out = torch.empty_like(v)
    if q.shape[0] and launch.batch:
        _fwd[launch.grid("BLOCK_M")](q, k, v, out, **launch.tensors, **launch.scalars, **launch.flags)
    return out


def _backward(launch: _Launch, q, k, v, dout, deterministic: bool):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    heads = launch.heads

    def bucket_grad(weights):
        if weights is None:
            return None, q
        if not deterministic:
            buffer = torch.zeros(heads, weights.shape[1], dtype=torch.float32, device=q.device)
            return buffer, buffer
        # One row per program of the dK/dV pass at its smallest key block, a multiple of ``heads`` per sample.
        rows = launch.batch * cdiv(max(launch.max_len, 1), _SMALLEST_BLOCK) * heads
        buffer = torch.zeros(rows, next_power_of_2(weights.shape[1]), dtype=torch.float32, device=q.device)
        return buffer, buffer

    dpw, dpw_ptr = bucket_grad(launch.pw)
    dtw, dtw_ptr = bucket_grad(launch.tw)
    if q.shape[0] and launch.batch:
        pb = next_power_of_2(launch.pw.shape[1]) if launch.pw is not None else 1
        tb = next_power_of_2(launch.tw.shape[1]) if launch.tw is not None else 1
        _dkdv[launch.grid("BLOCK_N")](
            q,
            k,
            v,
            dout,
            dk,
            dv,
            **launch.tensors,
            DPW=dpw_ptr,
            DTW=dtw_ptr,
            **launch.scalars,
            **launch.flags,
            DETERMINISTIC=deterministic,
            PB=pb,
            TB=tb,
        )
        _dq[launch.grid("BLOCK_M")](q, k, v, dout, dq, **launch.tensors, **launch.scalars, **launch.flags)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()

    def finish(buffer, weights):
        if buffer is None:
            return None
        if deterministic:
            buffer = buffer.view(-1, heads, buffer.shape[1]).sum(0)[:, : weights.shape[1]]
        return buffer.to(weights.dtype)

    return dq, dk, dv, finish(dpw, launch.pw), finish(dtw, launch.tw)


class _HSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pw, tw, launch: _Launch, deterministic: bool):
        ctx.save_for_backward(q, k, v)
        ctx.launch, ctx.deterministic = launch, deterministic
        return _forward(launch, q, k, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv, dpw, dtw = _backward(ctx.launch, q, k, v, dout.contiguous(), ctx.deterministic)
        return dq, dk, dv, dpw, dtw, None, None


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    alpha: float,
    seq_norm: Optional[int],
    num_targets: Optional[torch.Tensor],
    window: int,
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
    deterministic: bool,
) -> torch.Tensor:
    """The kernel's entry (kernels.hstu validates): ``offsets`` int32 on the tokens' device, ``max_len`` the
    longest sample (host)."""
    device = q.device
    offsets = offsets.to(device=device, dtype=torch.int32)
    order = torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True).to(torch.int32)
    targets = num_targets.to(device=device, dtype=torch.int32) if num_targets is not None else None
    ts = timestamps.to(device=device, dtype=torch.int64).contiguous() if time_weights is not None else None
    pw = position_weights.float().contiguous() if position_weights is not None else None
    tw = time_weights.float().contiguous() if time_weights is not None else None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    launch = _Launch(q, v, offsets, order, targets, ts, pw, tw, max_len, alpha, seq_norm, window)
    return _HSTUAttention.apply(q, k, v, pw, tw, launch, deterministic)
