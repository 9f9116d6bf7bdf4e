"""Triton jagged HSTU attention, forward and backward, with the relative attention bias computed inside.

Layout. Tokens packed [N, H, D] (each row's heads dense, rows any stride apart: q, k and v may be views of one
projection's output), int32 device offsets, the batch's longest length from the host
(the grid; never read back from the device). One program per (query or key block, head, sample): the grid's
first axis walks a sample's blocks from the last (the most keys under the causal mask) to the first, its second
axis the samples longest first (a device argsort, no sync), so the heaviest programs start first and the short
ones fill the tail. A block beyond its sample's length returns at once.

Scores. s = alpha * q k^T + rab, A = SiLU(s) / n: no softmax, so no running max or row sums, and a query block
accumulates ``A V`` in one pass. At head dim 64 the kernel is bound by its per-element work, not its matmuls, so
that work is kept small: a tile needs the mask only where it crosses the diagonal, the targets, the window or the
sample's end (one scalar test per tile), and for 16-bit inputs the sigmoid is one ``tanh.approx`` instruction
(sigmoid(x) = (1 + tanh(x / 2)) / 2; fp32 keeps the exact one). rab is one gather per element from a joint [H,
position buckets x time buckets] table (the two weight tables summed, built per call), at the buckets of
kernels.pytorch.pt_hstu_attention, read from the same float32 exponent and mantissa bits, so the twin and the
kernel agree on every bucket (a test sweeps the int32 range). Timestamps are the int64 ones: a tile whose times
span less than 2**31 (in seconds, 68 years: every tile of real data) takes its gaps in int32 from the tile's
earliest time, any other in int64, so every gap's bucket is exact. A batch's buckets are the same for every layer
and head: given the batch's :func:`pair_buckets` (one int16 a causal pair, :func:`pair_layout`), each pass reads
them instead of computing them: a key-major copy for the dK/dV pass, whose tiles hold a key a row, and a
query-major one for the forward and the dQ pass, so that each reads its tile's neighbours from neighbouring bytes.
Where dS is kept (below), one pass a layer gathers the joint table at every pair of a copy into a per-pair bias in
the inputs' dtype, which the forward (query-major) and, above head dim 64 (:data:`KEY_BIAS_DIM`), the dK/dV pass
(key-major) load as tiles instead of gathering per score. Those tiles and the kept dS load with the layout's room
as their mask (multiples of 8 entries), not the causal mask, so that Triton pipelines them beside q, k and v; the
pair buckets a pass gathers by load as before (:func:`_paired`), as the gather waits on them either way.

Backward, deterministic as it is: one pass over key blocks accumulates dK and dV in registers (FlashAttention 2's
order), and no atomics or locks anywhere. dQ needs each tile's dS once more, which a fixed-order pass can have two
ways. Kept (the default where it fits kernels.hstu's budget): the dK/dV pass writes dS (the inputs' dtype, the
dtype the dQ matmul reads it in) for the causal lower triangle of each sample and head, heads x sum L (L + 1) / 2
values, and the dQ pass is one matmul per tile over it: no scores, bias or sigmoid again. Recomputed (a batch
whose dS would not fit): the dQ pass repeats two of the five matmuls (q k^T and dO v^T) and the per-element work:
7 matmuls instead of 5. The bucket weights' gradient is the sum of dS over each bucket, one row per program,
reduced by torch in a fixed order. Where dS is kept, passes of their own over it: the position table's sums dS
along its diagonals (a pair's position bucket is its distance's), a load and an add a pair whatever the buckets; the
time table's loads a tile's key-major buckets once for every head. Else each program of the dK/dV pass sums its
tiles' buckets in registers (a loop over the buckets a tile holds, few away from the diagonal), which leaves that
pass's loads synchronous (Triton pipelines no loop that holds another).

The forward and the backward are torch operators (``freescale::hstu_attention`` and its backward) with an autograd
formula, so torch.compile traces a layer through the attention as one opaque node.
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
    # x >= 0. A positive float32's bits shifted right by 23 - SUB are its exponent (biased by 127) followed by its
    # top SUB mantissa bits, so one shift and one add give the twin's LINEAR + ((exponent - LOG2_LINEAR) << SUB) +
    # mantissa, and no bucket is negative.
    bits = tl.maximum(x, 1).to(tl.float32).to(tl.int32, bitcast=True)
    log_part = (bits >> (23 - SUB)) + (LINEAR - ((127 + LOG2_LINEAR) << SUB))
    return tl.minimum(tl.where(x < LINEAR, x.to(tl.int32), log_part), num_buckets - 1)


@triton.jit
def _position_bucket(dist, num_buckets, P_LINEAR: tl.constexpr, P_LOG2: tl.constexpr, P_SUB: tl.constexpr):
    return _log_bucket(tl.maximum(dist, 0), P_LINEAR, P_LOG2, P_SUB, num_buckets)


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
def _queries_end(n0, BLOCK_N: tl.constexpr, length, history, window, HAS_WINDOW: tl.constexpr):
    """The end of the queries that see the key block at ``n0``: rows of the history see keys at most ``window``
    back; the targets (all at ``history``) see keys from ``history - window`` on: past both, no query sees it."""
    hi = length
    if HAS_WINDOW:
        if n0 + BLOCK_N - 1 < history - window:
            hi = tl.minimum(length, n0 + BLOCK_N + window)
    return hi


@triton.jit
def _keys_start(m0, BLOCK_N: tl.constexpr, history, window, HAS_WINDOW: tl.constexpr):
    """The first key block any query of the block at ``m0`` sees: ``window`` back from its first position."""
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.minimum(m0, history) - window, 0) // BLOCK_N * BLOCK_N
    return lo


@triton.jit
def _is_full(q0, q_rows, k0, k_rows, length, history, window, HAS_WINDOW: tl.constexpr):
    """Whether every pair of a query block [q0, q0 + q_rows) and key block [k0, k0 + k_rows) attends (no mask)."""
    full = (k0 + k_rows - 1 <= q0) & (k0 + k_rows <= history) & (q0 + q_rows <= length)
    if HAS_WINDOW:
        full = full & (tl.minimum(q0 + q_rows - 1, history) - k0 <= window)
    return full


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    if FAST:
        half = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x * 0.5], dtype=tl.float32, is_pure=True, pack=1
        )
        sig = 0.5 * half + 0.5
    else:
        sig = tl.sigmoid(x)
    return sig


@triton.jit
def _buckets(
    dist,
    ts_rows,
    ts_cols,
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
    """The position and time buckets of a tile (zeros for a part that is off): ``dist`` the pairs' position
    distances, ``ts_rows`` and ``ts_cols`` the tile's rows' and columns' timestamps."""
    pb = tl.zeros(dist.shape, dtype=tl.int32)
    tb = tl.zeros(dist.shape, dtype=tl.int32)
    if HAS_POS:
        pb = _position_bucket(dist, num_pb, P_LINEAR, P_LOG2, P_SUB)
    if HAS_TIME:
        tb = _time_buckets(ts_rows, ts_cols, num_tb, T_LINEAR, T_LOG2, T_SUB)
    return pb, tb


@triton.jit
def _bias(RAB, h, index, num_tb, width):
    """The joint table's entry at ``index`` (time bucket x ``width`` + position bucket): [H, num_tb, width]."""
    return tl.load(RAB + h * (num_tb * width) + index)


@triton.jit
def _biased(
    s,
    RAB,
    PAIRS,
    pair_first,
    TS,
    start,
    h,
    rows_q,
    rows_k,
    pos_q,
    pos_k,
    ts_held,
    length,
    full,
    num_pb,
    num_tb,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    PAIRED: tl.constexpr,
    KEY_ROWS: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
):
    """A tile's scores ``s`` plus each pair's rab, and the pairs' position and time buckets: read from the batch's
    pair buckets (PAIRED) or computed. Queries along the tile's rows, or keys with KEY_ROWS (the dK/dV pass);
    ``ts_held`` the timestamps of the block the program holds (its queries, or its keys with KEY_ROWS)."""
    if PAIRED:
        # PAIRS is the copy that runs along the tile's columns (key-major where keys are the rows, query-major
        # where queries are), so that a thread's neighbouring scores' buckets are neighbouring bytes.
        if KEY_ROWS:
            causal = (rows_k[:, None] <= rows_q[None, :]) & (rows_q < length)[None, :]
            ptrs = _pair_cols(PAIRS, pair_first, rows_k, length)[:, None] + rows_q[None, :]
        else:
            causal = _causal(rows_q, rows_k, length)
            ptrs = PAIRS + _pair_row_offsets(pair_first, rows_q)[:, None] + rows_k[None, :]
        packed = _paired(ptrs, full, causal).to(tl.int32) & 0xFFFF
        pb, tb = packed & 0xFF, packed >> 8
        # The packed pair is the joint table's index as it is (its rows PAIRED_BUCKETS wide), time bucket and all.
        bias = _bias(RAB, h, packed if HAS_TIME else pb, num_tb, PAIRED_WIDTH)
    else:
        pb, tb = _tile_buckets(
            *(TS, start, rows_q, rows_k, pos_q, pos_k, ts_held, length, num_pb, num_tb, HAS_POS, HAS_TIME, KEY_ROWS),
            *(P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB),
        )
        bias = _bias(RAB, h, tb * num_pb + pb, num_tb, num_pb)
    return s + bias, pb, tb


@triton.jit
def _tile_buckets(
    TS,
    start,
    rows_q,
    rows_k,
    pos_q,
    pos_k,
    ts_held,
    length,
    num_pb,
    num_tb,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    KEY_ROWS: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
):
    """A tile's position and time buckets computed from positions and timestamps (queries along its rows, or keys
    with KEY_ROWS; ``ts_held`` the timestamps of the rows' block)."""
    if KEY_ROWS:
        dist = pos_q[None, :] - pos_k[:, None]
        ts_cols = _times(TS, start, rows_q, length, HAS_TIME)
    else:
        dist = pos_q[:, None] - pos_k[None, :]
        ts_cols = _times(TS, start, rows_k, length, HAS_TIME)
    return _buckets(
        dist, ts_held, ts_cols, num_pb, num_tb, HAS_POS, HAS_TIME, P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB
    )


@triton.jit
def _rows(X, stride, start, rows, h, length, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [len(rows), BLOCK_D] tile of head ``h`` of packed [N, H, DIM] rows ``stride`` elements apart (zeros past the
    sample's end): q, k and v may be views of one projection's output."""
    cols = tl.arange(0, BLOCK_D)
    ptrs = X + (start + rows.to(tl.int64))[:, None] * stride + h * DIM + cols[None, :]
    return tl.load(ptrs, mask=(rows < length)[:, None] & (cols < DIM)[None, :], other=0.0)


@triton.jit
def _store_rows(X, tile, start, rows, h, length, H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    ptrs = X + (start + rows.to(tl.int64))[:, None] * (H * DIM) + h * DIM + cols[None, :]
    tl.store(ptrs, tile.to(X.dtype.element_ty), mask=(rows < length)[:, None] & (cols < DIM)[None, :])


@triton.jit
def _pair_first(PAIR_BASE, ORDER, share):
    """This program's sample's first entry in a per-pair tensor (:func:`pair_layout`), plus ``share`` (a head's in
    the kept dS): loaded once, outside the loops, so that the loops' loads stay ones Triton can pipeline."""
    return tl.load(PAIR_BASE + tl.load(ORDER + tl.program_id(1))) + share


@triton.jit
def _pair_cols(X, first, rows_k, length):
    """Where each key's column starts in a per-pair tensor, so that the pair (query r, key c) is at
    ``_pair_cols(...)[c] + r``: a sample's causal pairs key by key from ``first`` (:func:`_pair_first`), key c's
    column holding queries 8 (c // 8) .. L - 1 padded to a multiple of 8, so that every column is 16-byte aligned
    and a tile loads and stores as vectors along queries."""
    return X + _pair_col_offsets(first, rows_k, length)


@triton.jit
def _pair_col_offsets(first, rows_k, length):
    """:func:`_pair_cols` as int64 offsets: a quadratic in c // 8 for each residue of c mod 8. Written as 8 times
    an integer (``first``, every sample's and head's start, is a multiple of 8), which tells Triton the alignment
    through any arithmetic that follows, where a ``tl.multiple_of`` hint on the sum did not survive compiling."""
    groups = ((length + 7) // 8).to(tl.int64)  # the padded column's groups of 8 queries
    c = rows_k.to(tl.int64)
    g = c // 8  # columns 8g .. 8g + 7 each hold queries 8g .. 8 groups - 1
    return 8 * (first // 8 + 8 * g * groups - 4 * g * (g - 1) + (c - 8 * g) * (groups - g) - g)


@triton.jit
def _pair_row_offsets(first, rows_q):
    """Where each query's row starts in the query-major copy of a per-pair tensor, so that the pair (query r, key c)
    is at ``_pair_row_offsets(...)[r] + c``: a sample's pairs query by query from ``first``, query r's row holding
    keys 0 .. r padded to a multiple of 8. Rows 8g .. 8g + 7 each hold 8 (g + 1) keys, so row r starts at
    8 (g + 1) (r - 4 g) with g = r // 8: as 8 times an integer, so that Triton keeps the 16-byte alignment. The rows
    take no more room than :func:`pair_layout`'s columns (as many for a length that is a multiple of 8, fewer
    otherwise), so both copies share its sample starts."""
    r = rows_q.to(tl.int64)
    g = r // 8
    return 8 * (first // 8 + (g + 1) * (r - 4 * g))


@triton.jit
def _paired(ptrs, full, causal):
    """A tile of the pair buckets for a per-score gather: all of a full tile, only the causal pairs of one that is
    not. Not the room-masked load of the per-pair bias and dS (:func:`_in_row`): the gather waits on this load
    either way, and pipelined (cp.async through shared memory) the load and its gather timed 1.6x slower in the
    dK/dV pass at head dim 64 (BENCHMARKS.md)."""
    if full:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=causal, other=0)
    return tile


@triton.jit
def _in_row(rows_q, rows_k, length):
    """Which entries of a tile the query-major copy of a per-pair tensor holds room for (``rows_q`` [M, 1], ``rows_k``
    [1, N]): query r's row, keys 0 .. r padded to a multiple of 8 (:func:`_pair_row_offsets`). A mask bounded in
    multiples of 8 along the keys keeps the load one Triton vectorizes and pipelines (cp.async), where the causal
    mask, 2 bytes wide, and a branch between it and an unmasked load each leave it synchronous; the entries it
    reads beyond the causal pairs are padding, which the tiles that are not full zero after the scores."""
    return (rows_k < (rows_q // 8 + 1) * 8) & (rows_q < length)


@triton.jit
def _in_column(rows_q, rows_k, length):
    """:func:`_in_row` for the key-major layout (:func:`_pair_cols`, any shapes that broadcast): key c's column,
    queries 8 (c // 8) .. the sample's length padded to a multiple of 8."""
    return (rows_q >= rows_k // 8 * 8) & (rows_q < (length + 7) // 8 * 8) & (rows_k < length)


@triton.jit
def _causal(rows_q, rows_k, length):
    """A tile's causal pairs, queries along its rows: the entries a per-pair tensor holds."""
    return (rows_k[None, :] <= rows_q[:, None]) & (rows_q < length)[:, None]


@triton.jit
def _times(TS, start, rows, length, HAS_TIME: tl.constexpr):
    """Each row's int64 timestamp (0 without time); a row past the sample's end repeats its last event's, so that
    it widens no tile's span of times."""
    times = tl.zeros(rows.shape, dtype=tl.int64)
    if HAS_TIME:
        times = tl.load(TS + start + tl.minimum(rows, length - 1))
    return times


@triton.jit
def _time_buckets(ts_rows, ts_cols, num_buckets, T_LINEAR: tl.constexpr, T_LOG2: tl.constexpr, T_SUB: tl.constexpr):
    """The time bucket of every (row, column) pair's gap, exact for any int64 timestamps: in int32 arithmetic where
    the tile's times span less than 2**31 (68 years of seconds: every tile of real data), else in int64."""
    lo = tl.minimum(tl.min(ts_rows, axis=0), tl.min(ts_cols, axis=0))
    hi = tl.maximum(tl.max(ts_rows, axis=0), tl.max(ts_cols, axis=0))
    if hi - lo < 2147483648:
        gap = (ts_rows - lo).to(tl.int32)[:, None] - (ts_cols - lo).to(tl.int32)[None, :]
        tb = _log_bucket(tl.abs(gap), T_LINEAR, T_LOG2, T_SUB, num_buckets)
    else:
        gap64 = ts_rows[:, None] - ts_cols[None, :]
        tb = _log_bucket(tl.abs(gap64), T_LINEAR, T_LOG2, T_SUB, num_buckets)
    return tb


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
    RAB,
    PAIRS,
    PAIR_BASE,
    BIAS,
    total_pairs,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    stride_q,
    stride_k,
    stride_v,
    stride_do,
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
    FAST: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    PAIRED: tl.constexpr,
    PAIR_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's ``A V`` over its sample's key blocks.

    One function on purpose: a Triton kernel's body is its program; the per-element helpers it calls are split out.
    """
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
    q = _rows(Q, stride_q, start, rows_q, h, length, D, BLOCK_D)
    ts_q = _times(TS, start, rows_q, length, HAS_TIME)
    pair_first = 0
    if PAIRED:
        pair_first = _pair_first(PAIR_BASE, ORDER, 0)
    if PAIR_BIAS:  # this head's share of the layer's per-pair bias: its rows' starts, once
        bias_rows = BIAS + _pair_row_offsets(pair_first + h.to(tl.int64) * total_pairs, rows_q)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo = _keys_start(m0, BLOCK_N, history, window, HAS_WINDOW)
    hi = tl.minimum(m0 + BLOCK_M, length)
    for n0 in range(lo, hi, BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pos_k = tl.minimum(rows_k, history)
        k = _rows(K, stride_k, start, rows_k, h, length, D, BLOCK_D)
        v = _rows(V, stride_v, start, rows_k, h, length, DV, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        full = _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW)
        if PAIR_BIAS:
            room = _in_row(rows_q[:, None], rows_k[None, :], length)
            s += tl.load(bias_rows[:, None] + rows_k[None, :], mask=room, other=0.0).to(tl.float32)
        elif HAS_POS or HAS_TIME:
            s, pb, tb = _biased(
                *(s, RAB, PAIRS, pair_first, TS, start, h, rows_q, rows_k, pos_q, pos_k, ts_q, length, full),
                *(num_pb, num_tb, HAS_POS, HAS_TIME, PAIRED, False),
                *(P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB),
            )
        a = s * _sigmoid(s, FAST) * inv_norm
        if not full:
            valid = _valid(rows_q[:, None], rows_k[None, :], pos_q[:, None], pos_k[None, :], length, window, HAS_WINDOW)
            a = tl.where(valid, a, 0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
    _store_rows(OUT, acc, start, rows_q, h, length, H, DV, BLOCK_DV)


@triton.jit
def _bucket_sums(acc, buckets, ds, full, BUCKETS: tl.constexpr):
    """``acc`` [BUCKETS] plus the sum of ``ds`` over each bucket of the tile, by a loop over the buckets the tile
    holds (deterministic: no atomics): all of a full tile's, a masked tile's nonzero entries' (its masked pairs'
    buckets are not theirs)."""
    ids = tl.arange(0, BUCKETS)
    if full:
        lo = tl.min(buckets)
        hi = tl.max(buckets)
    else:
        live = ds != 0.0
        lo = tl.min(tl.where(live, buckets, BUCKETS))
        hi = tl.max(tl.where(live, buckets, -1))
    for b in range(lo, hi + 1):
        total = tl.sum(tl.where(buckets == b, ds, 0.0))  # all axes at once: each thread's share, then across
        acc = tl.where(ids == b, acc + total, acc)
    return acc


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
    RAB,
    DPW,
    DTW,
    DS,
    PAIRS,
    PAIR_BASE,
    BIAS,
    total_pairs,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    stride_q,
    stride_k,
    stride_v,
    stride_do,
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
    FAST: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    PB: tl.constexpr,
    TB: tl.constexpr,
    KEEP_DS: tl.constexpr,
    TIME_SUMS: tl.constexpr,
    PAIRED: tl.constexpr,
    PAIR_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block's dK and dV (and its share of the bucket weights' gradients, one row per program) over the
    query blocks that see it; tiles transposed: keys along rows, queries along columns.

    One function on purpose: a Triton kernel's body is its program; the per-element helpers it calls are split out.
    """
    pid = tl.program_id(0)
    h = pid % H
    n0 = (tl.num_programs(0) // H - 1 - pid // H) * BLOCK_N
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    # Every program writes its gradient rows, zeros when idle: rows left by the autotuner's trial launches of
    # other block sizes are overwritten, and only this launch's rows are summed.
    program = (tl.program_id(1) * tl.num_programs(0) + pid).to(tl.int64)
    if n0 >= length:
        if HAS_POS and not KEEP_DS:
            tl.store(DPW + program * PB + tl.arange(0, PB), tl.zeros([PB], dtype=tl.float32))
        if TIME_SUMS:
            tl.store(DTW + program * TB + tl.arange(0, TB), tl.zeros([TB], dtype=tl.float32))
        return
    if PER_SAMPLE_NORM:
        inv_norm = 1.0 / length.to(tl.float32)
    rows_k = n0 + tl.arange(0, BLOCK_N)
    pos_k = tl.minimum(rows_k, history)
    k = _rows(K, stride_k, start, rows_k, h, length, D, BLOCK_D)
    v = _rows(V, stride_v, start, rows_k, h, length, DV, BLOCK_DV)
    ts_k = _times(TS, start, rows_k, length, HAS_TIME)
    pair_first = 0
    if PAIRED or KEEP_DS:
        pair_first = _pair_first(PAIR_BASE, ORDER, 0)
    if KEEP_DS:  # this head's share of the kept dS (and of the layer's key-major per-pair bias): its keys' columns
        cols = _pair_col_offsets(pair_first + h.to(tl.int64) * total_pairs, rows_k, length)
        ds_cols = DS + cols
        if PAIR_BIAS:
            bias_cols = BIAS + cols
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dpw = tl.zeros([PB], dtype=tl.float32)
    dtw = tl.zeros([TB], dtype=tl.float32)
    hi = _queries_end(n0, BLOCK_N, length, history, window, HAS_WINDOW)
    for m0 in range(n0 // BLOCK_M * BLOCK_M, hi, BLOCK_M):
        rows_q = m0 + tl.arange(0, BLOCK_M)
        pos_q = tl.minimum(rows_q, history)
        q = _rows(Q, stride_q, start, rows_q, h, length, D, BLOCK_D)
        do = _rows(DO, stride_do, start, rows_q, h, length, DV, BLOCK_DV)
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * alpha
        full = _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW)
        if PAIR_BIAS:  # no bucket sums here then: the passes over the kept dS take both weights' gradients
            room = _in_column(rows_q[None, :], rows_k[:, None], length)
            s += tl.load(bias_cols[:, None] + rows_q[None, :], mask=room, other=0.0).to(tl.float32)
        elif HAS_POS or HAS_TIME:
            s, pb, tb = _biased(
                *(s, RAB, PAIRS, pair_first, TS, start, h, rows_q, rows_k, pos_q, pos_k, ts_k, length, full),
                *(num_pb, num_tb, HAS_POS, HAS_TIME, PAIRED, True),
                *(P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB),
            )
        sig = _sigmoid(s, FAST)
        a = s * sig * inv_norm
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = dp * (sig * (1.0 + s * (1.0 - sig)) * inv_norm)
        if not full:
            valid = _valid(rows_q[None, :], rows_k[:, None], pos_q[None, :], pos_k[:, None], length, window, HAS_WINDOW)
            a = tl.where(valid, a, 0.0)
            ds = tl.where(valid, ds, 0.0)
        if KEEP_DS:  # a full tile stores as vectors; elsewhere only the pairs that attend, which the dQ pass reads
            ptrs = ds_cols[:, None] + rows_q[None, :]
            if full:
                tl.store(ptrs, ds.to(DS.dtype.element_ty))
            else:
                attends = _valid(
                    rows_q[None, :], rows_k[:, None], pos_q[None, :], pos_k[:, None], length, window, HAS_WINDOW
                )
                tl.store(ptrs, ds.to(DS.dtype.element_ty), mask=attends)
        dv += tl.dot(a.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
        if HAS_POS and not KEEP_DS:  # else summed along the kept dS's diagonals (_position_grads_kernel)
            dpw = _bucket_sums(dpw, pb, ds, full, PB)
        if TIME_SUMS:  # else summed over the kept dS by _time_grads_kernel
            dtw = _bucket_sums(dtw, tb, ds, full, TB)
    _store_rows(DK, dk * alpha, start, rows_k, h, length, H, D, BLOCK_D)
    _store_rows(DV_OUT, dv, start, rows_k, h, length, H, DV, BLOCK_DV)
    if HAS_POS and not KEEP_DS:
        tl.store(DPW + program * PB + tl.arange(0, PB), dpw)
    if TIME_SUMS:
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
    RAB,
    PAIRS,
    PAIR_BASE,
    alpha,
    inv_norm,
    window,
    num_pb,
    num_tb,
    stride_q,
    stride_k,
    stride_v,
    stride_do,
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
    FAST: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's dQ over its sample's key blocks, the scores recomputed.

    One function on purpose: a Triton kernel's body is its program; the per-element helpers it calls are split out.
    """
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
    q = _rows(Q, stride_q, start, rows_q, h, length, D, BLOCK_D)
    do = _rows(DO, stride_do, start, rows_q, h, length, DV, BLOCK_DV)
    ts_q = _times(TS, start, rows_q, length, HAS_TIME)
    pair_first = 0
    if PAIRED:
        pair_first = _pair_first(PAIR_BASE, ORDER, 0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = _keys_start(m0, BLOCK_N, history, window, HAS_WINDOW)
    hi = tl.minimum(m0 + BLOCK_M, length)
    for n0 in range(lo, hi, BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pos_k = tl.minimum(rows_k, history)
        k = _rows(K, stride_k, start, rows_k, h, length, D, BLOCK_D)
        v = _rows(V, stride_v, start, rows_k, h, length, DV, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        full = _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW)
        if HAS_POS or HAS_TIME:
            s, pb, tb = _biased(
                *(s, RAB, PAIRS, pair_first, TS, start, h, rows_q, rows_k, pos_q, pos_k, ts_q, length, full),
                *(num_pb, num_tb, HAS_POS, HAS_TIME, PAIRED, False),
                *(P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB),
            )
        sig = _sigmoid(s, FAST)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = dp * (sig * (1.0 + s * (1.0 - sig)) * inv_norm)
        if not full:
            valid = _valid(rows_q[:, None], rows_k[None, :], pos_q[:, None], pos_k[None, :], length, window, HAS_WINDOW)
            ds = tl.where(valid, ds, 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_rows(DQ, dq * alpha, start, rows_q, h, length, H, D, BLOCK_D)


@triton.jit
def _dq_kept_kernel(
    K,
    DQ,
    OFFSETS,
    ORDER,
    TARGETS,
    DS,
    PAIR_BASE,
    total_pairs,
    alpha,
    window,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's dQ = alpha dS K from the dS the dK/dV pass kept: one matmul per tile, no scores, bias or
    sigmoid recomputed."""
    pid = tl.program_id(0)
    h = pid % H
    m0 = (tl.num_programs(0) // H - 1 - pid // H) * BLOCK_M
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    if m0 >= length:
        return
    rows_q = m0 + tl.arange(0, BLOCK_M)
    pos_q = tl.minimum(rows_q, history)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    ds_first = _pair_first(PAIR_BASE, ORDER, h.to(tl.int64) * total_pairs)
    lo = _keys_start(m0, BLOCK_N, history, window, HAS_WINDOW)
    hi = tl.minimum(m0 + BLOCK_M, length)
    for n0 in range(lo, hi, BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        ptrs = _pair_cols(DS, ds_first, rows_k, length)[None, :] + rows_q[:, None]
        ds = tl.load(ptrs, mask=_in_column(rows_q[:, None], rows_k[None, :], length), other=0.0)
        if not _is_full(m0, BLOCK_M, n0, BLOCK_N, length, history, window, HAS_WINDOW):
            # the pairs that attend (every one the dK/dV pass wrote); the others' entries are unwritten
            pos_k = tl.minimum(rows_k, history)
            valid = _valid(rows_q[:, None], rows_k[None, :], pos_q[:, None], pos_k[None, :], length, window, HAS_WINDOW)
            ds = tl.where(valid, ds, 0.0)
        k = _rows(K, stride_k, start, rows_k, h, length, D, BLOCK_D)
        dq += tl.dot(ds, k, input_precision=PRECISION)
    _store_rows(DQ, dq * alpha, start, rows_q, h, length, H, D, BLOCK_D)


@triton.jit
def _target_distance_sums(DS, first, d, top, history, length, BLOCK_C: tl.constexpr):
    """The kept dS of the targets' pairs summed by distance ``d`` (a block of them): a target sees key history - d
    at distance d >= 1, and itself at 0."""
    sums = tl.zeros(d.shape, dtype=tl.float32)
    seen = d <= top
    key = history - d
    own_too = tl.min(d, axis=0) == 0  # the block of distance 0 also sums each target's pair with itself
    for t0 in range(history, length, BLOCK_C):
        t = t0 + tl.arange(0, BLOCK_C)
        ptrs = _pair_cols(DS, first, tl.where(d > 0, key, t0), length)[None, :] + t[:, None]
        mask = (t < length)[:, None] & (seen & (d > 0) & (key >= 0))[None, :]
        sums += tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), axis=0)
        if own_too:
            own = _pair_cols(DS, first, t, length) + t
            sums += tl.where(d == 0, tl.sum(tl.load(own, mask=t < length, other=0.0).to(tl.float32), axis=0), 0.0)
    return sums


@triton.jit
def _position_grads_kernel(
    DS,
    DPW,
    OFFSETS,
    ORDER,
    TARGETS,
    PAIR_BASE,
    total_pairs,
    window,
    num_pb,
    H: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    PB: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of position distances' share of the position weights' gradient, from the dS the dK/dV pass kept:
    a pair's bucket is its distance's, so the sum over a bucket is a sum over distances of the sums along the
    diagonals of dS, a load and an add a pair, whatever the buckets. A history query r sees key c at distance r - c;
    a target (at position ``history``) sees key c < history at history - c and itself at 0.

    Key c's entries start 16-byte aligned at query 8 (c // 8) (:func:`_pair_cols`), so the program reads each key
    from query 8 (c // 8) + d0 on, as vectors: those are the distances d0 - c % 8 onward, and each of the eight
    residues of c mod 8 covers its own shifted block of distances, which the programs of the other blocks do not."""
    pid = tl.program_id(0)
    h = pid % H
    d0 = (pid // H) * BLOCK_D
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    program = (tl.program_id(1) * tl.num_programs(0) + pid).to(tl.int64)
    j = tl.arange(0, BLOCK_D)
    d = d0 + j  # the targets' distances (unshifted)
    shift = tl.arange(0, 8)
    shifted = d0 + j[None, :] - shift[:, None]  # [8, BLOCK_D]: the history's distances, by key residue
    sums = tl.zeros([BLOCK_D], dtype=tl.float32)
    per_residue = tl.zeros([8, BLOCK_D], dtype=tl.float32)
    top = history  # the largest distance: a target's to key 0
    if HAS_WINDOW:
        top = tl.minimum(top, window)
    if d0 <= top + 7 and length > 0:
        first = _pair_first(PAIR_BASE, ORDER, h.to(tl.int64) * total_pairs)
        # History queries: tiles of BLOCK_C keys (a multiple of 8, so a tile's row i holds residue i % 8 in every
        # tile) added up, then reduced across the keys of each residue once.
        diagonals = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
        k = tl.arange(0, BLOCK_C) % 8
        dist = d0 + j[None, :] - k[:, None]
        inside = (d0 >= 8) & (d0 + BLOCK_D - 1 <= top)
        # Each row's first entry (query 8 (c // 8) + d0), advanced tile by tile as the quadratic's differences: the
        # layout's closed form costs tens of 64-bit instructions a row.
        c = tl.arange(0, BLOCK_C)
        entry = _pair_col_offsets(first, c, length) + (c // 8 * 8 + d0)
        step = _pair_col_offsets(first, c + BLOCK_C, length) + ((c + BLOCK_C) // 8 * 8 + d0) - entry
        for c0 in range(0, history - d0 + 8, BLOCK_C):
            ptrs = DS + entry[:, None] + j[None, :]
            if inside and c0 + BLOCK_C - 8 + d0 + BLOCK_D <= history:
                diagonals += tl.load(ptrs).to(tl.float32)
            else:
                rows = ((c0 + c) // 8 * 8 + d0)[:, None] + j[None, :]
                mask = (rows < history) & (dist >= 0) & (dist <= top)
                diagonals += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            entry += step
            step -= 64 * (BLOCK_C // 8) * (BLOCK_C // 8)
        per_residue = tl.sum(tl.reshape(diagonals, [BLOCK_C // 8, 8, BLOCK_D]), axis=0)
        sums = _target_distance_sums(DS, first, d, top, history, length, BLOCK_C)
    # The distances' sums gathered into their buckets: a loop over the few buckets a block of distances spans.
    buckets = _position_bucket(d, num_pb, P_LINEAR, P_LOG2, P_SUB)
    shifted_buckets = _position_bucket(shifted, num_pb, P_LINEAR, P_LOG2, P_SUB)
    lo = tl.minimum(tl.min(buckets, axis=0), tl.min(tl.min(shifted_buckets, axis=1), axis=0))
    hi = tl.maximum(tl.max(buckets, axis=0), tl.max(tl.max(shifted_buckets, axis=1), axis=0))
    ids = tl.arange(0, PB)
    row = tl.zeros([PB], dtype=tl.float32)
    for b in range(lo, hi + 1):
        total = tl.sum(tl.where(buckets == b, sums, 0.0), axis=0)
        total += tl.sum(tl.sum(tl.where(shifted_buckets == b, per_residue, 0.0), axis=1), axis=0)
        row = tl.where(ids == b, row + total, row)
    tl.store(DPW + program * PB + ids, row)


@triton.jit
def _time_grads_kernel(
    DS,
    PAIRS,
    DTW,
    OFFSETS,
    ORDER,
    TARGETS,
    PAIR_BASE,
    share8,
    window,
    H: tl.constexpr,
    HP: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block's share of the time weights' gradient, every head's, from the dS the dK/dV pass kept and the
    pairs' key-major buckets (one row a head and program; no atomics). The heads share a pair's bucket, so each
    tile's buckets are loaded and compared once for all of them, then a select and an add a score and bucket,
    where the dK/dV pass's loop compared them once a head beside its matmuls. ``share8``: a head's share of dS in
    units of 8 entries, so that Triton knows every head's tile 16-byte aligned."""
    n0 = tl.program_id(0) * BLOCK_N
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    program = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    heads = tl.arange(0, HP)
    ids = tl.arange(0, TB)
    sums = tl.zeros([HP, TB], dtype=tl.float32)
    if n0 < length:
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pos_k = tl.minimum(rows_k, history)
        cols = _pair_col_offsets(_pair_first(PAIR_BASE, ORDER, 0), rows_k, length)
        shares = heads.to(tl.int64) * (8 * share8.to(tl.int64))
        hi = _queries_end(n0, BLOCK_N, length, history, window, HAS_WINDOW)
        for m0 in range(n0 // BLOCK_M * BLOCK_M, hi, BLOCK_M):
            rows_q = m0 + tl.arange(0, BLOCK_M)
            pos_q = tl.minimum(rows_q, history)
            at = cols[:, None] + rows_q[None, :]
            # The pairs the dK/dV pass wrote dS for; the others' entries are unwritten.
            valid = _valid(rows_q[None, :], rows_k[:, None], pos_q[None, :], pos_k[:, None], length, window, HAS_WINDOW)
            tb = (tl.load(PAIRS + at, mask=valid, other=0).to(tl.int32) & 0xFFFF) >> 8
            live = valid[None, :, :] & (heads < H)[:, None, None]
            ds = tl.load(DS + shares[:, None, None] + at[None, :, :], mask=live, other=0.0).to(tl.float32)
            for b in range(tl.min(tl.where(valid, tb, TB)), tl.max(tl.where(valid, tb, -1)) + 1):
                inside = (tb == b)[None, :, :]  # a pair without dS has 0 there
                total = tl.sum(tl.sum(tl.where(inside, ds, 0.0), axis=2), axis=1)  # [HP]: each head's
                sums = tl.where(ids[None, :] == b, sums + total[:, None], sums)
    rows = program * H + heads
    tl.store(DTW + rows[:, None] * TB + ids[None, :], sums, mask=(heads < H)[:, None])


@triton.jit
def _pair_buckets_kernel(
    OFFSETS,
    ORDER,
    TARGETS,
    TS,
    PAIR_BASE,
    PAIRS,
    PAIRS_Q,
    num_pb,
    num_tb,
    HAS_TARGETS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
    T_LINEAR: tl.constexpr,
    T_LOG2: tl.constexpr,
    T_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's position and time buckets against every earlier key, packed one int16 a pair (position
    low byte, time high byte) into the batch's per-pair layout and its query-major copy: the same for every head
    and layer."""
    m0 = tl.program_id(0) * BLOCK_M
    start, length, history = _sample(OFFSETS, ORDER, TARGETS, HAS_TARGETS)
    if m0 >= length:
        return
    rows_q = m0 + tl.arange(0, BLOCK_M)
    pos_q = tl.minimum(rows_q, history)
    ts_q = _times(TS, start, rows_q, length, HAS_TIME)
    first = _pair_first(PAIR_BASE, ORDER, 0)
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
        rows_k = n0 + tl.arange(0, BLOCK_N)
        pb, tb = _tile_buckets(
            *(TS, start, rows_q, rows_k, pos_q, tl.minimum(rows_k, history), ts_q, length, num_pb, num_tb, True),
            *(HAS_TIME, False, P_LINEAR, P_LOG2, P_SUB, T_LINEAR, T_LOG2, T_SUB),
        )
        causal = _causal(rows_q, rows_k, length)
        packed = (pb | (tb << 8)).to(tl.int16)
        tl.store(_pair_cols(PAIRS, first, rows_k, length)[None, :] + rows_q[:, None], packed, mask=causal)
        tl.store(PAIRS_Q + _pair_row_offsets(first, rows_q)[:, None] + rows_k[None, :], packed, mask=causal)


@triton.jit
def _pair_bias_kernel(PAIRS, BIAS, RAB, total_pairs, table, H: tl.constexpr, BLOCK: tl.constexpr):
    """One block of a copy of the pair buckets turned into every head's bias (:meth:`_Launch.pair_bias`): the joint
    table's entry at each packed pair, gathered here at full occupancy instead of once a score in the attention's
    passes, where each gather waits on its pair's load."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < total_pairs
    # The padding between a sample's rows or columns holds no pair, and its bias meets only scores that are masked:
    # any entry of the table will do (a finite one).
    index = tl.minimum(tl.load(PAIRS + i, mask=inside, other=0).to(tl.int32) & 0xFFFF, table - 1)
    for h in tl.static_range(H):
        bias = tl.load(RAB + h * table + index, mask=inside, other=0.0)
        tl.store(BIAS + h * total_pairs + i, bias.to(BIAS.dtype.element_ty), mask=inside)


# Launch configurations, tried by Triton's autotuner once per (head dims, rab, mode), per head-width class: {class:
# [(BLOCK_M, BLOCK_N, warps, stages)]}. The forward and the dQ pass hold a query block and stream keys, the dK/dV
# pass the reverse. Wider heads need smaller blocks to stay within shared memory and registers; FALLBACK fits every
# supported head, fp32 at 256 included.
_FWD_CONFIGS = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
    # 128 x 64 with 8 warps first: two warpgroups on a query block, and key tiles wide enough for the tensor cores
    # (bench-notes, *The forward's tiles at head dim 256*).
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}
_DKDV_CONFIGS = {
    64: [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    256: [(64, 64, 8, 2), (32, 64, 4, 2), (32, 16, 8, 1)],
}
_DQ_CONFIGS = {
    64: [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2)],
    256: [(128, 32, 8, 2), (64, 32, 4, 2), (32, 16, 8, 1)],
}
#: The dQ pass from the kept dS: a streaming matmul, its tiles those of a matmul with a [BLOCK_N, dim] right side.
_DQ_KEPT_CONFIGS = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    # Not 128 x 64 with 8 warps and 3 stages at this width: that build gave a wrong dQ (Triton 3.6, H100), where
    # one stage, or 64 x 64 with 4 warps, gave the twin's.
    128: [(64, 64, 4, 3), (128, 64, 8, 1)],
    256: [(128, 64, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)],
}
_FALLBACK = (32, 32, 4, 1)
#: Under the interpreter one small block, so that a short sample still spans several blocks.
_INTERPRETED = {1 << 30: [(16, 16, 1, 1)]}
#: Position distances and keys per program of :func:`_position_grads_kernel` (a memory-bound pass: one size).
_DISTANCE_BLOCK = 16 if _INTERPRET else 64
#: The widest head (BLOCK_D) whose dK/dV pass gathers its bias per score instead of reading a key-major per-pair
#: bias (:meth:`_Launch.pair_bias`): at 64 the second bias pass a layer cost more than the loads it saved; at 256
#: the bias read as a tile took rab on 1.36x faster (BENCHMARKS.md).
KEY_BIAS_DIM = 64


def reads_pair_bias(copy: int, block_d: int) -> bool:
    """Whether the passes reading the pair buckets' ``copy`` (0 key-major: dK/dV; 1 query-major: the forward) read
    a per-pair bias, where one is made, at head width ``block_d``; else they gather the joint table per score."""
    return copy == 1 or block_d > KEY_BIAS_DIM


#: Keys and queries per tile of :func:`_time_grads_kernel` (every head's dS of a tile in registers at once).
_TIME_KEYS, _TIME_QUERIES = (16, 16) if _INTERPRET else (32, 64)
#: The smallest query or key block of any launch configuration: the per-program buffers are sized by it.
_SMALLEST_BLOCK = min(
    min(m, n)
    for table in (
        _FWD_CONFIGS,
        _DKDV_CONFIGS,
        _DQ_CONFIGS,
        _DQ_KEPT_CONFIGS,
        _INTERPRETED if _INTERPRET else {0: [_FALLBACK]},
    )
    for rows in table.values()
    for m, n, _, _ in rows
)


def _tuned(kernel, table: dict[int, list[tuple[int, int, int, int]]], fixed: bool = False, **options):
    """``kernel`` autotuned over the configs of the call's head-width class (the smallest class that holds
    max(BLOCK_D, BLOCK_DV)) and the fallback; with FREESCALE_HSTU_AUTOTUNE=0 (tests: fewer compiles) the class's
    first and the fallback. ``fixed``: one configuration, chosen by no timing (the class's first for 16-bit inputs,
    the fallback, which fits every head, for fp32), so that two processes tile alike and sum in one order."""
    table = _INTERPRETED if _INTERPRET else {**table, 1 << 30: [_FALLBACK]}
    configs, width_class = [], {}
    for width, rows in sorted(table.items()):
        for m, n, w, st in rows:
            config = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            configs.append(config)
            width_class[id(config)] = width

    def prune(candidates, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head = max(args["BLOCK_D"], args.get("BLOCK_DV", 0))
        fits = min((width for width in table if width >= head), default=max(table))
        kept = [c for c in candidates if width_class[id(c)] == fits]
        fallback = [c for c in candidates if width_class[id(c)] == 1 << 30 and c not in kept]
        if fixed:
            return kept[:1] if args["PRECISION"] != "ieee" or _INTERPRET else fallback[:1]
        if os.environ.get("FREESCALE_HSTU_AUTOTUNE") == "0":
            kept = kept[:1]
        return kept + fallback

    return triton.autotune(configs, prune_configs_by={"early_config_prune": prune}, **options)(kernel)


_KEY = ["D", "DV", "H", "HAS_POS", "HAS_TIME", "HAS_TARGETS", "HAS_WINDOW", "FAST"]
#: The three kernels, autotuned ([False]) and at one fixed configuration each ([True], the deterministic mode's).
_FWD = [_tuned(_fwd_kernel, _FWD_CONFIGS, fixed, key=_KEY) for fixed in (False, True)]
_DKDV = [_tuned(_dkdv_kernel, _DKDV_CONFIGS, fixed, key=_KEY) for fixed in (False, True)]
_DQ = [_tuned(_dq_kernel, _DQ_CONFIGS, fixed, key=_KEY) for fixed in (False, True)]
_DQ_KEPT = [
    _tuned(_dq_kept_kernel, _DQ_KEPT_CONFIGS, fixed, key=["D", "H", "HAS_TARGETS", "HAS_WINDOW", "PRECISION"])
    for fixed in (False, True)
]

_BUCKET_CONSTANTS = dict(
    P_LINEAR=POSITION_LINEAR,
    P_LOG2=POSITION_LINEAR.bit_length() - 1,
    P_SUB=POSITION_SUB_BITS,
    T_LINEAR=TIME_LINEAR,
    T_LOG2=TIME_LINEAR.bit_length() - 1,
    T_SUB=TIME_SUB_BITS,
)


def dense_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` [N, H, D] as the kernels read it: each row's heads and dims dense, the rows any stride apart (a view of
    one projection's output is read in place); otherwise a contiguous copy."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def pair_layout(lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layout of a tensor with one entry per causal (query, key) pair of a batch, such as the dS the dK/dV pass
    keeps for the dQ pass (one share per head) and the pairs' rab buckets: each sample's pairs key by key, key c's
    column holding queries 8 (c // 8) onward, padded to a multiple of 8 (:func:`_pair_cols`). Returns where each
    sample starts (int64 [B]) and the entries of one share: about sum L (L + 1) / 2, at most 8 L more a sample."""
    lengths = lengths.to(torch.int64)
    padded = (lengths + 7) // 8 * 8  # key c's column: queries 8 (c // 8) .. padded - 1 (_pair_cols)
    g, j = lengths // 8, lengths % 8
    pairs = 8 * g * padded - 32 * g * (g - 1) + j * (padded - 8 * g)
    return torch.cumsum(pairs, 0) - pairs, int(pairs.sum())


#: The most buckets a table may have for the batch's pairs to hold them (one byte each).
PAIRED_BUCKETS = 256
#: A row of the joint bias table where the kernels read the packed pair buckets: their position byte's range.
PAIRED_WIDTH = tl.constexpr(PAIRED_BUCKETS)


def pair_buckets(
    offsets: torch.Tensor,
    order: torch.Tensor,
    max_len: int,
    layout: tuple[torch.Tensor, int],
    num_targets: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
    buckets: tuple[int, int],
) -> torch.Tensor:
    """Every causal pair's position and time buckets (``buckets``: the tables' sizes, each at most
    :data:`PAIRED_BUCKETS`; time 0 without ``timestamps``), int16 [2, pairs]: in :func:`pair_layout` (key-major)
    and query-major (:func:`_pair_row_offsets`), computed once for a batch so that the attention of every layer and head
    reads them instead of computing them."""
    # The padding between a sample's rows or columns stays unwritten: only _pair_bias_kernel reads it, clamping
    # the index into its table, and the bias there meets only scores that are masked.
    pairs = torch.empty(2, layout[1], dtype=torch.int16, device=offsets.device)
    batch = offsets.numel() - 1
    if batch and max_len:
        block = 16 if _INTERPRET else 64
        _pair_buckets_kernel[(cdiv(max_len, block), batch)](
            offsets, order, num_targets if num_targets is not None else offsets,
            timestamps if timestamps is not None else offsets, layout[0], pairs[0], pairs[1], *buckets,
            HAS_TARGETS=num_targets is not None, HAS_TIME=timestamps is not None, **_BUCKET_CONSTANTS,
            BLOCK_M=block, BLOCK_N=block, num_warps=4,
        )  # fmt: skip
    return pairs


def sample_order(offsets: torch.Tensor) -> torch.Tensor:
    """The samples longest first (int32, on the offsets' device, no sync): the grid's second axis, so that the
    heaviest programs start first and the short ones fill the tail."""
    return torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True).to(torch.int32)


class _Launch:
    """What the three kernels share for one call: tensors, flags and the grid (blocks of the longest sample)."""

    def __init__(
        self, q, k, v, offsets, order, targets, timestamps, pw, tw, pair_base, pairs, max_len, alpha, seq_norm, window,
        pair_count, keep_ds,
    ):  # fmt: skip
        self.batch, self.heads, self.max_len = offsets.numel() - 1, q.shape[1], max_len
        self.pw, self.tw, self.pairs, self.pair_count, self.dtype = pw, tw, pairs, pair_count, q.dtype
        # dS kept where the batch's budget holds it (heads x q's dtype a pair); the forward's per-pair bias is as
        # large, so it is read where dS is kept.
        self.keep = keep_ds and pair_base is not None and pair_count > 0
        # A valid pointer for the absent optional tensors (never read or written: their flags are off).
        self.unused = torch.zeros(1, dtype=torch.float32, device=q.device)
        if pw is not None or tw is not None:  # the joint table: position weight + time weight per bucket pair
            # [H, time buckets, width]: a row as wide as the packed pair buckets' position byte where the kernels
            # read those (the packed pair is then the index), else the position table's.
            width = PAIRED_BUCKETS if pairs is not None else (pw.shape[1] if pw is not None else 1)
            joint = torch.zeros(q.shape[1], tw.shape[1] if tw is not None else 1, width, device=q.device)
            if tw is not None:
                joint += tw.detach()[:, :, None]
            if pw is not None:
                joint[:, :, : pw.shape[1]] += pw.detach()[:, None, :]
            rab = joint.reshape(q.shape[1], -1)
        self.tensors = dict(
            OFFSETS=offsets,
            ORDER=order,
            TARGETS=targets if targets is not None else offsets,
            TS=timestamps if timestamps is not None else offsets,
            RAB=rab if pw is not None or tw is not None else self.unused,
            PAIRS=pairs[0] if pairs is not None else self.unused,  # key-major: the dK/dV pass's
            PAIR_BASE=pair_base if pair_base is not None else self.unused,
        )
        # The forward's and the dQ pass's: the pairs' query-major copy.
        self.query_tensors = {**self.tensors, "PAIRS": pairs[1] if pairs is not None else self.unused}
        self.scalars = dict(
            alpha=float(alpha),
            inv_norm=1.0 / seq_norm if seq_norm else 1.0,
            window=int(window),
            num_pb=pw.shape[1] if pw is not None else 1,
            num_tb=tw.shape[1] if tw is not None else 1,
            stride_q=q.stride(0),
            stride_k=k.stride(0),
            stride_v=v.stride(0),
        )
        self.flags = dict(
            H=q.shape[1],
            D=q.shape[2],
            DV=v.shape[2],
            BLOCK_D=max(16, next_power_of_2(q.shape[2])),
            BLOCK_DV=max(16, next_power_of_2(v.shape[2])),
            PER_SAMPLE_NORM=not seq_norm,
            HAS_TARGETS=targets is not None,
            HAS_WINDOW=window > 0,
            HAS_POS=pw is not None,
            HAS_TIME=tw is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FAST=q.dtype != torch.float32 and not _INTERPRET,
            PAIRED=pairs is not None,
            **_BUCKET_CONSTANTS,
        )
        # The pair buckets and dS both kept: the passes over them run.
        self.per_pair = self.keep and pairs is not None
        # With both kept, the weights' gradients come from passes over the kept dS, the time table's from one over
        # it and the buckets (_time_grads_kernel), so that the dK/dV pass has no per-bucket loop: a loop inside its
        # loop leaves every load of that pass synchronous (Triton pipelines no loop that holds another).
        self.time_pass = self.per_pair and tw is not None

    def pair_bias(self, copy: int) -> dict:
        """A pass's BIAS, ``total_pairs`` and PAIR_BIAS: with the pair buckets, rab and dS kept, every pair's bias of
        this layer's tables in the pair buckets' ``copy`` (0 key-major: the dK/dV pass's, at head dims above
        :data:`KEY_BIAS_DIM`; 1 query-major: the forward's), heads shares of the layout's entries in q's dtype,
        gathered by one pass over the pairs; else the joint table is gathered per score, or the buckets computed."""
        has_rab = self.pw is not None or self.tw is not None
        if not (self.per_pair and has_rab and reads_pair_bias(copy, self.flags["BLOCK_D"])):
            return dict(BIAS=self.unused, total_pairs=0, PAIR_BIAS=False)
        rab = self.tensors["RAB"]
        bias = torch.empty(self.heads * self.pair_count, dtype=self.dtype, device=rab.device)
        block = 1024
        _pair_bias_kernel[(cdiv(self.pair_count, block),)](
            self.pairs[copy], bias, rab, self.pair_count, rab.shape[1], H=self.heads, BLOCK=block, num_warps=4
        )
        return dict(BIAS=bias, total_pairs=self.pair_count, PAIR_BIAS=True)

    def sample_tensors(self) -> dict:
        """The tensors that say where each sample is: what the passes over the kept dS take."""
        return {key: self.tensors[key] for key in ("OFFSETS", "ORDER", "TARGETS", "PAIR_BASE")}

    def grid(self, block: str):
        return lambda meta: (cdiv(max(self.max_len, 1), meta[block]) * self.heads, self.batch)

    def distance_blocks(self) -> int:
        """Blocks of position distance per sample and head (0 .. the longest length, and the blocks' shift by up
        to 7 in :func:`_position_grads_kernel`)."""
        return (self.max_len + 7) // _DISTANCE_BLOCK + 1

    def key_block_room(self) -> int:
        """Key blocks per sample and head at the smallest key block any launch configuration has."""
        return cdiv(max(self.max_len, 1), _SMALLEST_BLOCK)

    def bucket_rows(self, weights: Optional[torch.Tensor], blocks: int) -> torch.Tensor:
        """Per-program rows of a weight table's gradient, room for ``blocks`` programs per sample and head (the
        dK/dV pass's key blocks, :meth:`key_block_room`, or the position pass's :meth:`distance_blocks`); every
        program of a launch writes its own."""
        if weights is None:
            return self.unused
        rows = self.batch * blocks * self.heads
        return torch.empty(rows, next_power_of_2(weights.shape[1]), dtype=torch.float32, device=weights.device)


def _rows_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # dense, whatever the strides of ``x``


# The kernels as two torch operators, the forward and the backward, with the forward's autograd formula calling the
# backward: torch.compile traces a layer through them (each one opaque node), so the memory-bound work around the
# attention fuses across it without a graph break. ``seq_norm`` 0: each sample's own length.
@torch.library.custom_op("freescale::hstu_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    pair_base: Optional[torch.Tensor],
    pair_buckets: Optional[torch.Tensor],
    max_len: int,
    alpha: float,
    seq_norm: int,
    window: int,
    fixed: bool,
    pair_count: int,
    keep_ds: bool,
) -> torch.Tensor:
    pw, tw = position_weights, time_weights
    q, k, v = dense_heads(q), dense_heads(k), dense_heads(v)
    launch = _Launch(
        q, k, v, offsets, order, num_targets, timestamps, pw, tw, pair_base, pair_buckets, max_len, alpha, seq_norm,
        window, pair_count, keep_ds,
    )  # fmt: skip
    out = _rows_like(v)
    if q.shape[0] and launch.batch:
        _FWD[fixed][launch.grid("BLOCK_M")](
            q, k, v, out, **launch.query_tensors, **launch.pair_bias(1), **launch.scalars, stride_do=0, **launch.flags
        )
    return out


@_attention_op.register_fake
def _(q, k, v, *rest):
    return _rows_like(v)


@torch.library.custom_op("freescale::hstu_attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    timestamps: Optional[torch.Tensor],
    position_weights: Optional[torch.Tensor],
    time_weights: Optional[torch.Tensor],
    pair_base: Optional[torch.Tensor],
    pair_buckets: Optional[torch.Tensor],
    max_len: int,
    alpha: float,
    seq_norm: int,
    window: int,
    fixed: bool,
    pair_count: int,
    keep_ds: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the two weight tables' gradients (empty for a table that is absent). With ``keep_ds`` the
    dK/dV pass keeps dS in :func:`pair_layout` (``pair_base``, ``pair_count`` per head) and dQ is one matmul over
    it; without, the dQ pass recomputes the scores."""
    pw, tw = position_weights, time_weights
    q, k, v, dout = dense_heads(q), dense_heads(k), dense_heads(v), dense_heads(dout)
    launch = _Launch(
        q, k, v, offsets, order, num_targets, timestamps, pw, tw, pair_base, pair_buckets, max_len, alpha, seq_norm,
        window, pair_count, keep_ds,
    )  # fmt: skip
    dq, dk, dv = _rows_like(q), _rows_like(k), _rows_like(v)
    if not (q.shape[0] and launch.batch):
        empty = lambda w: q.new_empty(0, dtype=torch.float32) if w is None else torch.zeros_like(w)  # noqa: E731
        return dq.zero_(), dk.zero_(), dv.zero_(), empty(pw), empty(tw)
    keep, time_pass = launch.keep, launch.time_pass
    time_blocks = cdiv(max(launch.max_len, 1), _TIME_KEYS) if time_pass else launch.key_block_room()
    dpw = launch.bucket_rows(pw, launch.distance_blocks() if keep else launch.key_block_room())
    dtw = launch.bucket_rows(tw, time_blocks)
    strides = dict(launch.scalars, stride_do=dout.stride(0))
    ds = q.new_empty(pair_count * launch.heads) if keep else launch.unused
    kept = dict(DS=ds, total_pairs=pair_count if keep else 0)
    bias = launch.pair_bias(0)
    _DKDV[fixed][launch.grid("BLOCK_N")](
        q, k, v, dout, dk, dv, **launch.tensors, DPW=dpw, DTW=dtw, **kept, BIAS=bias["BIAS"],
        PAIR_BIAS=bias["PAIR_BIAS"], **strides, **launch.flags,
        PB=dpw.shape[1] if pw is not None else 1, TB=dtw.shape[1] if tw is not None else 1, KEEP_DS=keep,
        TIME_SUMS=tw is not None and not time_pass,
    )  # fmt: skip
    if keep:
        _weight_grads_from_kept(launch, ds, dpw, dtw, time_blocks)
        flags = {key: launch.flags[key] for key in ("H", "D", "BLOCK_D", "HAS_TARGETS", "HAS_WINDOW", "PRECISION")}
        scalars = {key: launch.scalars[key] for key in ("alpha", "window", "stride_k")}
        _DQ_KEPT[fixed][launch.grid("BLOCK_M")](k, dq, **launch.sample_tensors(), **kept, **scalars, **flags)
    else:
        _DQ[fixed][launch.grid("BLOCK_M")](q, k, v, dout, dq, **launch.query_tensors, **strides, **launch.flags)

    key_blocks = cdiv(max(launch.max_len, 1), _DKDV[fixed].best_config.kwargs["BLOCK_N"])

    def total(rows, weights, blocks):  # the launch's per-program rows summed in a fixed order: the same bits every run
        if weights is None:
            return q.new_empty(0, dtype=torch.float32)
        programs = launch.batch * blocks * launch.heads
        return rows[:programs].view(-1, launch.heads, rows.shape[1]).sum(0)[:, : weights.shape[1]].to(weights.dtype)

    position_blocks = launch.distance_blocks() if keep else key_blocks
    return dq, dk, dv, total(dpw, pw, position_blocks), total(dtw, tw, time_blocks if time_pass else key_blocks)


def _weight_grads_from_kept(launch: _Launch, ds, dpw, dtw, time_blocks: int) -> None:
    """Per-program rows of the weight tables' gradients from the dS the dK/dV pass kept: the position table's along
    its diagonals, and the time table's (where ``launch.time_pass``) over it and the pair buckets."""
    tensors, window = launch.sample_tensors(), launch.scalars["window"]
    flags = {key: launch.flags[key] for key in ("H", "HAS_TARGETS", "HAS_WINDOW")}
    if launch.pw is not None:
        _position_grads_kernel[(launch.distance_blocks() * launch.heads, launch.batch)](
            ds, dpw, **tensors, total_pairs=launch.pair_count, window=window, num_pb=launch.pw.shape[1], **flags,
            **{key: launch.flags[key] for key in ("P_LINEAR", "P_LOG2", "P_SUB")}, PB=dpw.shape[1],
            BLOCK_C=_DISTANCE_BLOCK, BLOCK_D=_DISTANCE_BLOCK, num_warps=4,
        )  # fmt: skip
    if launch.time_pass:
        _time_grads_kernel[(time_blocks, launch.batch)](
            ds, launch.pairs[0], dtw, **tensors, share8=launch.pair_count // 8, window=window, **flags,
            HP=next_power_of_2(launch.heads), TB=dtw.shape[1], BLOCK_M=_TIME_QUERIES, BLOCK_N=_TIME_KEYS, num_warps=4,
        )  # fmt: skip


@_attention_backward_op.register_fake
def _(dout, q, k, v, offsets, order, num_targets, timestamps, position_weights, time_weights, *scalars):
    absent = q.new_empty(0, dtype=torch.float32)
    weight_grads = [absent if w is None else _rows_like(w) for w in (position_weights, time_weights)]
    return _rows_like(q), _rows_like(k), _rows_like(v), *weight_grads


# q, k, v, offsets, order, num_targets, timestamps, position_weights, time_weights, pair_base, pair_buckets
_TENSOR_INPUTS = 11


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS])
    ctx.scalars = inputs[_TENSOR_INPUTS:]


def _backward(ctx, dout):
    saved = ctx.saved_tensors
    dq, dk, dv, dpw, dtw = _attention_backward_op(dout, *saved, *ctx.scalars)
    pw, tw = saved[7], saved[8]
    weight_grads = (dpw if pw is not None else None, dtw if tw is not None else None)
    return dq, dk, dv, None, None, None, None, *weight_grads, None, None, *(None for _ in ctx.scalars)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


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
    order: Optional[torch.Tensor] = None,
    fixed: bool = False,
    layout: Optional[tuple[torch.Tensor, int]] = None,
    keep_ds: bool = False,
    pair_buckets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The kernel's entry (kernels.hstu validates): ``offsets`` int32 on the tokens' device, ``max_len`` the
    longest sample (host), ``num_targets`` int32 and ``timestamps`` int64 on the device, ``order``
    (:func:`sample_order`) made here when not given. A backward gives the same bits on every run (it has no
    atomics); ``fixed`` also in every process (one launch configuration, not the autotuner's pick).
    ``layout``: :func:`pair_layout` of the samples' lengths, its first on the device, for what follows.
    ``keep_ds``: the backward keeps dS (heads x the layout's second, of q's dtype) and takes dQ from it, instead
    of recomputing the scores. ``pair_buckets``: the batch's :func:`pair_buckets` for these tables' sizes, read
    instead of computing each pair's buckets."""
    order = sample_order(offsets) if order is None else order
    pw = position_weights.float().contiguous() if position_weights is not None else None
    tw = time_weights.float().contiguous() if time_weights is not None else None
    ts = timestamps if time_weights is not None else None
    base, pairs = layout if layout is not None else (None, 0)
    return _attention_op(
        q, k, v, offsets, order, num_targets, ts, pw, tw, base, pair_buckets if base is not None else None, max_len,
        float(alpha), seq_norm or 0, int(window), fixed, pairs, keep_ds,
    )  # fmt: skip
