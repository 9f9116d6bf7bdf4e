"""Prioritized (collision-aware) embedding updates: Algorithm 2 of the paper, bit-exact with the synchronous path.

A persistent context per embedding group carries values across steps. Step i's forward receives the ids of
step i+1 (already in shard-major form, from the loader's ID-prefetch stage) and, on every shard:

    line 10    marks step i's rows that step i+1 uses again (collision) and step i+1's rows that step i does
               not use (exclusive of i+1, "fresh");
    line 13-14 sends back, per id, the flags that tell the batch-major side which of its positions are
               collision rows of step i (line 14's superscript is i) and fresh rows of step i+1;
    line 15    returns step i's embeddings: the fresh rows prefetched one step earlier, merged with the
               collision rows sent after step i-1's update.

Step i's backward then

    line 6-7   applies the exclusive gradients deferred by step i-1 (rows of i-1 that step i does not use);
    line 12    looks up the fresh rows of i+1 (nothing of step i writes them, and line 7 came first, so they
               hold their step-(i+1) values) and sends them (the sizes are known now: see Sizes);
    line 18-20 splits the gradient by the flags and sends the collision gradients first;
               and sends the exclusive gradients, which the next backward applies (lines 6-7).

The collision chain then finishes lines 18-21 in a thread of its own: as soon as the collision gradients arrive
it updates those rows and sends their new values (line 21), which step i+1's line 15 merges. Nothing reads
those rows in between, so both exchanges overlap the end of step i (dense all-reduce, optimizer) instead of
stalling its backward or the next forward; step i+1's forward waits only for what is still in flight.

Lines 6-7 and 12 sit in the backward rather than the forward (the paper puts them on a side stream during the
forward): step i's output needs neither, so on CPU the model thread only meets them once the deferred
gradients had the whole forward to arrive. Every row still receives exactly the updates of the synchronous
path, in the same order, with the same summation (optim.py), and is read only after all of them: tables and
losses are equal bit for bit.

Sizes. Algorithm 2 leaves out the tensor-size exchanges. Here the ID exchange's sizes travel in the ID-prefetch
stage (early). Every later exchange's sizes follow from two counts per (source, shard) pair, collision rows of i
and fresh rows of i+1: the shard counts them per source rank in the forward (copied to pinned host memory
there), and the source counts the flags it receives (one byte per id, sent in the forward) on the host, from
the host transport's own copy of them (``keep_host``). With the sizes on the host, the flags on the device give
the positions (``nonzero_static``). So with the host transport no step of the backward synchronises the device
(its event waits are for copies queued in the forward), and on a GPU the host keeps queueing the backward's work
while the dense backward still runs; with an NCCL transport reading the flags on the host costs a stream sync.
The flags exchange is the only addition; its wait is counted as ID exchange time.

Boundaries. The first step has no previous one: its rows are looked up synchronously. A step with no next one
(``next_ids=None``: end of training) updates all its rows at once. ``flush()`` applies deferred gradients and
collects the exchanges in flight; it runs before every checkpoint (get_extra_state), evaluation forward and
``full_tables``; afterwards the tables equal the synchronous ones and the context still holds step i+1's
embeddings, so training continues where it was. Evaluation forwards look up synchronously and leave the
context alone. The state in flight (step i+1's ids and embeddings) is part of the checkpoint.

On GPU the side work (lines 6-7 and 12) runs on the context's own CUDA stream (see ``_side`` for how it is ordered
against the compute stream); the transfers themselves are the transport's (copy stream and CPU thread for the
host transport). On CPU the side work progresses in the transport's threads behind handles; the model thread
only blocks in ``wait()``. Those waits are the exposed time (Timer spans ids_a2a, emb_a2a, grad_a2a).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from fscomm.worker import SerialWorker
from fsdata.id_prefetch import ShardedIds
from fsembed.sharded import EMB_A2A, GRAD_A2A, IDS_A2A, GroupShard, Ids, ShardedEmbeddingCollection
from kernels import ops


class _LocalCounts:
    """This shard's counts per source rank of two masks (collision rows of step i, fresh rows of step i+1),
    computed in the forward and copied to pinned host memory there: ``get()`` in the backward waits only for
    that copy, queued long before, never for the work queued after it."""

    def __init__(self, pairs: list[tuple[torch.Tensor, list[int]]]) -> None:
        device = pairs[0][0].device
        sums = [ops.segment_sum(mask.to(torch.int64), _offsets(splits, device)) for mask, splits in pairs]
        counts = torch.stack(sums, 1)  # [W, len(pairs)]: row q counts rank q's ids
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = counts

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _part_sums(flags: torch.Tensor, first: list[int], second: list[int]) -> tuple[list[int], list[int]]:
    """Host flags laid out per rank r as ``first[r]`` entries then ``second[r]`` entries: the set flags of
    each part, per rank."""
    parts = [n for pair in zip(first, second) for n in pair]
    sums = ops.segment_sum(flags.to(torch.int64), _offsets(parts, flags.device)).tolist()
    return sums[0::2], sums[1::2]


_chains: dict[int, SerialWorker] = {}
_chains_lock = threading.Lock()


def _chain_for(transport) -> SerialWorker:
    """The collision chain's thread of ``transport`` (the only thread that issues on its group, whichever
    collection of this process runs a chain through it)."""
    with _chains_lock:
        worker = _chains.get(id(transport))
        if worker is None:
            worker = _chains[id(transport)] = SerialWorker("fsembed-collision-chain")
        return worker


def _offsets(splits: list[int], device) -> torch.Tensor:
    """Offsets of ``splits`` on ``device``; from pinned memory on CUDA, so the copy needs no sync."""
    host = torch.zeros(len(splits) + 1, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    torch.cumsum(torch.tensor(splits, dtype=torch.int64), 0, out=host[1:])
    return host.to(device, non_blocking=True)


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the set entries of a 1-D mask whose count is already known (no host sync on GPU)."""
    return torch.nonzero_static(mask, size=count).squeeze(1)


def _interleave(a: torch.Tensor, a_splits: list[int], b: torch.Tensor, b_splits: list[int]) -> torch.Tensor:
    """Per rank r: a's segment r then b's segment r (two exchanges in one AllToAll)."""
    pa, pb = a.split(a_splits), b.split(b_splits)
    return torch.cat([x for pair in zip(pa, pb) for x in pair])


@dataclass
class _Step:
    """One step's ids of one group, on both sides, and its embeddings on their way to the batch-major side."""

    sid: ShardedIds
    local: torch.Tensor  # shard-major local rows [M]
    fresh_idx: Optional[torch.Tensor] = None  # send-order positions of rows the previous step did not use
    carried_idx: Optional[torch.Tensor] = None  # send-order positions of the other rows
    fresh_handle: object = None  # -> fresh rows, send order
    carried_handle: object = None  # -> the other rows, updated by the previous step's backward
    ready: Optional[torch.Tensor] = None  # all rows, send order, when already at hand


class _GroupContext:
    """Algorithm 2's persistent context C for one group."""

    def __init__(self) -> None:
        self.cur: Optional[_Step] = None  # step i (between forward i and backward i), or i+1 after backward i
        self.nxt: Optional[_Step] = None  # step i+1, set by forward i
        self.flags_handle = None
        self.co_shard: Optional[torch.Tensor] = None  # shard-major bool [M_i]: rows of i used by i+1
        self.fresh_shard: Optional[torch.Tensor] = None  # shard-major bool [M_i+1]: rows of i+1 not in i
        self.fresh_rows: Optional[torch.Tensor] = None  # line 12's lookup, sent once the sizes are known
        self.collided: Optional[torch.Tensor] = None  # number of rows of i used by i+1 (a 0-dim device tensor)
        self.counts: Optional[_LocalCounts] = None  # per source rank: collision rows of i, fresh rows of i+1
        self.pending_ex = None  # (handle -> gradients, local rows): step i-1's deferred exclusive part
        # step i's collision update and line 21 (_collision_chain): a Future running in the chain's thread, or
        # the chain itself, which the next forward (or flush) runs
        self.pending_co: Union[Future, Callable, None] = None
        self.awaiting_backward = False


class _PrioritizedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, coll: "PrioritizedEmbeddingCollection", name: str, out: torch.Tensor):
        ctx.coll, ctx.name = coll, name
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ctx.coll._backward_group(ctx.name, grad_out)
        return None, None, None, None


class PrioritizedEmbeddingCollection(ShardedEmbeddingCollection):
    """``forward(ids, next_ids)``: ``ids`` are needed only at the first step (later they are in the context);
    ``next_ids`` are the next step's ids (``PrefetchedIds`` from the loader, or ``{feature: ids}``), None at
    the last step. Every training forward must be followed by its backward before the next forward."""

    def __init__(self, *args, stale: bool = False, **kwargs):
        """``stale=True``: the semi-synchronous baseline (TorchRec's TrainPipelineSemiSync pattern): every row
        of step i+1 is fetched early, the rows step i also updates included, so those arrive one update stale.
        Not FreeScale's numerics: it exists to measure what staleness costs."""
        super().__init__(*args, **kwargs)
        self.stale = bool(stale)
        self.ctx = {name: _GroupContext() for name in self.shards}
        self._collisions: list[tuple[torch.Tensor, int]] = []  # per step: (collided ids, all ids) on this rank's shards
        # shard-major id counts, cumulative: looked up early (line 12), sent after the collision update
        # (line 21), gradients deferred (line 18's exclusive part)
        self.row_counts = {"early": 0, "collision": 0, "deferred": 0}
        self._misorder_for_test = False  # test-only: apply deferred gradients after line 12 (must break parity)
        # Algorithm 2's C.stream: the side work of lines 6-7 and 12 on GPU (None on CPU, where the exchanges
        # progress behind handles in the transport's threads).
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The collision rows' new values (line 21) go out from the collision chain's thread on a group of their
        # own; without one (a single transport), the next forward sends them.
        self.collision_transport = self.transports.collision

    def _side(self, *from_compute: Optional[torch.Tensor]):
        """Context for side work: on GPU the side stream, after everything the compute stream has queued so far
        (rows written by earlier steps, the ids and masks computed there), with the compute stream's tensors
        marked as used by the side stream so the allocator does not hand their memory out early. The compute
        stream waits for the side stream before the collision update (same tensors), in flush() and at a first
        step; the next step's early rows come through a handle whose copy starts after the side lookup."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in from_compute:
            if t is not None:
                t.record_stream(self._stream)
        return torch.cuda.stream(self._stream)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: Optional[Ids], next_ids: Optional[Ids] = None) -> dict[str, torch.Tensor]:
        if not (self.training and torch.is_grad_enabled()):
            return self._eval_forward(ids)
        busy = [n for n, c in self.ctx.items() if c.awaiting_backward]
        if busy:
            raise ValueError(f"rank {self.rank}: prioritized embeddings: forward of a new step before the backward of the last one (groups {busy})")
        first = any(c.cur is None for c in self.ctx.values())
        if first and ids is None:
            raise ValueError(f"rank {self.rank}: prioritized embeddings: the first step (and the step after a last one) needs its ids")
        pre_now = self._as_prefetched(ids) if first else None
        pre_next = None if next_ids is None else self._as_prefetched(next_ids)
        out: dict[str, torch.Tensor] = {}
        collided, total = torch.zeros((), dtype=torch.int64, device=self.device), 0
        for name, shard in self.shards.items():
            c = self.ctx[name]
            if c.cur is None:
                c.cur = self._first_step(shard, pre_now[name])
            emb = self._forward_group(c, shard, None if pre_next is None else pre_next[name])
            if c.co_shard is not None:
                collided = collided + c.collided  # stays on the device: no host sync per step
                total += int(c.cur.local.numel())
            out.update(self._split(c.cur.sid, _PrioritizedLookup.apply(self._anchor, self, name, emb), shard.layout))
            c.awaiting_backward = True
        self._collisions.append((collided, total))
        return out

    @property
    def collision_rates(self) -> list[float]:
        """Per training step: the share of this rank's shard-major ids whose row the next step uses again
        (Figure 3's collision %; 0 for a last step, which has no next one)."""
        return [float(c) / t if t else 0.0 for c, t in self._collisions]

    def _first_step(self, shard: GroupShard, sid: ShardedIds) -> _Step:
        """No previous step: every row is looked up and returned synchronously."""
        if self._stream is not None:  # after a last step, the side stream may still be applying its updates
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        local = self._wait_ids(sid, shard)
        h = self.transport.all_to_all(shard.lookup(local), sid.recv_splits, sid.send_splits)
        with self.timer.span(EMB_A2A):
            ready = h.wait()
        return _Step(sid, local, ready=ready)

    def _forward_group(self, c: _GroupContext, shard: GroupShard, sid_next: Optional[ShardedIds]) -> torch.Tensor:
        self._finish_collisions(c, shard)
        step = c.cur
        c.nxt = c.co_shard = c.fresh_shard = c.fresh_rows = c.flags_handle = c.counts = None
        if sid_next is not None:
            nlocal = self._wait_ids(sid_next, shard)  # line 8 (sent early by the ID-prefetch stage)
            c.co_shard = ops.collision_mask(step.local, nlocal)  # line 10
            c.fresh_shard = ~ops.collision_mask(nlocal, step.local)
            c.collided = c.co_shard.sum()  # the measured collisions (Figure 3), whatever the routing below
            if self.stale:  # semi-sync: no row waits for this step's update
                c.co_shard = torch.zeros_like(c.co_shard)
                c.fresh_shard = torch.ones_like(c.fresh_shard)
            # This shard's per-source counts, on their way to the host (read in the backward).
            c.counts = _LocalCounts([(c.co_shard, step.sid.recv_splits), (c.fresh_shard, sid_next.recv_splits)])
            flags = _interleave(c.co_shard, step.sid.recv_splits, c.fresh_shard, sid_next.recv_splits).to(torch.uint8)
            c.flags_handle = self.transport.all_to_all(  # lines 13-14, as one flag per id
                flags,
                [a + b for a, b in zip(step.sid.recv_splits, sid_next.recv_splits)],
                [a + b for a, b in zip(step.sid.send_splits, sid_next.send_splits)],
                keep_host=True,  # the backward counts them on the host
            )
            c.nxt = _Step(sid_next, nlocal)
        return ops.ranged_combine(self._merged(step, shard), step.sid.perm)  # line 15

    def _merged(self, step: _Step, shard: GroupShard) -> torch.Tensor:
        # The fresh rows' buffer was allocated on the side stream (line 12's exchange is issued there) and is
        # read here on the compute stream: safe because every side-stream section begins by waiting for the
        # compute stream (_side, or a collision chain's ``after``), so the allocator cannot hand that memory
        # back to the side stream early. The same holds for the collision rows' buffer (the chain's).
        if step.ready is None:
            with self.timer.span(EMB_A2A):
                fresh = step.fresh_handle.wait()
                carried = step.carried_handle.wait()
            out = torch.empty(step.sid.num_ids, shard.layout.dim, dtype=shard.weight.dtype, device=shard.weight.device)
            out.index_copy_(0, step.fresh_idx, fresh)
            out.index_copy_(0, step.carried_idx, carried)
            step.ready = out
            step.fresh_handle = step.carried_handle = None
        return step.ready

    def _update_collisions(self, shard: GroupShard, handle, rows: torch.Tensor) -> None:
        """A last step's update (every row is a collision row), at once on the compute stream."""
        with self.timer.span(GRAD_A2A):
            grads = handle.wait()
            if self._stream is not None:
                # The side stream's rows are disjoint from the collision rows, but they live in the same weight
                # and state tensors; TORCH_CUDA_SANITIZER (tensor-granular) flagged the concurrent access on the
                # H200, so the compute stream waits here for the side work (a stall, if any, counts as exposed).
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self.optimizer.apply(shard.weight, shard.state, rows, grads)

    def _collision_chain(self, shard: GroupShard, grads_handle, rows: torch.Tensor, carried_local: torch.Tensor,
                         carried_send: list[int], carried_recv: list[int]) -> Union[Future, Callable]:
        """Lines 18-21 once the collision gradients have left: update those rows when their gradients arrive
        (line 20), then look up and send the rows' new values for step i+1 (line 21).

        With a collision group this runs at once in the chain's thread, so both exchanges overlap the end of the
        step (the dense all-reduce, the optimizer) and the next forward finds the rows on their way; without
        one, the next forward runs it. Either way only step i+1's line 15 reads those rows, after it has waited
        for them (_finish_collisions). On GPU the work goes on the side stream, after everything the compute
        stream queued up to here (``after``): the rows written by this backward's side work come first (same
        stream) and touch rows disjoint from these. The received rows' buffer is allocated on the side stream
        and read on the compute stream: every later side-stream section starts after the compute stream's work
        (``_side``, or ``after`` of the next chain), so the allocator cannot hand that memory back early.
        Returns (line 21's handle, the tensors the side stream reads, kept until the compute stream waited)."""
        after = None
        if self._stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))

        def chain(transport):
            context = contextlib.nullcontext()
            if self._stream is not None:
                self._stream.wait_event(after)
                context = torch.cuda.stream(self._stream)
            with context:
                grads = grads_handle.wait()
                self.optimizer.apply(shard.weight, shard.state, rows, grads)
                handle = transport.all_to_all(shard.lookup(carried_local), carried_send, carried_recv)
            return handle, (grads, rows, carried_local)

        if self.collision_transport is None:
            return functools.partial(chain, self.transport)
        return _chain_for(self.collision_transport).submit(functools.partial(chain, self.collision_transport))

    def _finish_collisions(self, c: _GroupContext, shard: GroupShard) -> None:
        """The previous backward's collision chain: waited for (its thread's) or run now (in the forward's
        thread, on the forward group); the compute stream then follows the side stream, so the tensors the
        chain read may be freed."""
        if c.pending_co is None:
            return
        pending, c.pending_co = c.pending_co, None
        with self.timer.span(GRAD_A2A):
            c.cur.carried_handle, _ = pending.result() if isinstance(pending, Future) else pending()
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _apply_pending(self, c: _GroupContext, shard: GroupShard, timed: bool = True) -> None:
        """Lines 6-7. ``timed=False`` on the side stream: its wait stalls no compute, so it is not exposed."""
        if c.pending_ex is None:
            return
        handle, rows = c.pending_ex
        with self.timer.span(GRAD_A2A) if timed else contextlib.nullcontext():
            grads = handle.wait()
        if self._stream is not None:
            grads.record_stream(torch.cuda.current_stream(grads.device))
        self.optimizer.apply(shard.weight, shard.state, rows, grads)
        c.pending_ex = None

    # ------------------------------------------------------------------ backward
    def _backward_group(self, name: str, grad_out: torch.Tensor) -> None:
        c, shard = self.ctx[name], self.shards[name]
        step, nxt = c.cur, c.nxt
        sid = step.sid
        g = self._to_send_order(grad_out, sid)

        # Sizes and positions of every exchange below. The sizes are read on the host: this shard's counts were
        # copied there in the forward, and the flags' bytes reach it on their way through the host transport;
        # positions from the flags on the device, by nonzero_static with those counts. Counted as ID exchange
        # time.
        with self.timer.span(IDS_A2A):
            if nxt is None:  # last step: everything is a collision row, nothing is deferred
                co_pos = torch.ones(sid.num_ids, dtype=torch.bool, device=g.device)
                co_shard = torch.ones(step.local.numel(), dtype=torch.bool, device=g.device)
                co_send, co_recv = list(sid.send_splits), list(sid.recv_splits)
            else:
                local = c.counts.get()  # [W, 2]: per source rank, collision rows of i and fresh rows of i+1
                co_recv, fresh_send = local[:, 0].tolist(), local[:, 1].tolist()
                # The same counts for this rank's ids, per shard: the flags that came back, summed on the host.
                co_send, fresh_recv = _part_sums(c.flags_handle.host(), sid.send_splits, nxt.sid.send_splits)
                flags = c.flags_handle.wait().to(torch.bool)
                parts = flags.split([a + b for a, b in zip(sid.send_splits, nxt.sid.send_splits)])
                co_pos = torch.cat([p[:a] for p, a in zip(parts, sid.send_splits)])
                fresh_pos = torch.cat([p[a:] for p, a in zip(parts, sid.send_splits)])
                co_shard = c.co_shard
                carried_send = [a - b for a, b in zip(nxt.sid.recv_splits, fresh_send)]
                carried_recv = [a - b for a, b in zip(nxt.sid.send_splits, fresh_recv)]
                # Positions with their counts known: no further syncs (nonzero_static).
                nxt.fresh_idx = _positions(fresh_pos, sum(fresh_recv))
                nxt.carried_idx = _positions(~fresh_pos, sum(carried_recv))
                fresh_rows_local = nxt.local.index_select(0, _positions(c.fresh_shard, sum(fresh_send)))
                carried_rows_local = nxt.local.index_select(0, _positions(~c.fresh_shard, sum(carried_send)))
            ex_send = [a - b for a, b in zip(sid.send_splits, co_send)]
            ex_recv = [a - b for a, b in zip(sid.recv_splits, co_recv)]
            co_idx, ex_idx = _positions(co_pos, sum(co_send)), _positions(~co_pos, sum(ex_send))
            co_rows = step.local.index_select(0, _positions(co_shard, sum(co_recv)))
            ex_rows = step.local.index_select(0, _positions(~co_shard, sum(ex_recv)))

        # Side work (lines 6-7 and 12), on the side stream on GPU. It runs here, in the backward rather than
        # the forward: step i's output needs neither, and by now the deferred gradients had the whole forward
        # to arrive (on CPU the model thread would otherwise block on them). Line 7 precedes line 12; both
        # touch only rows that step i does not use, and overlap the collision exchange below (see _side).
        pending_rows = None if c.pending_ex is None else c.pending_ex[1]
        with self._side(pending_rows, fresh_rows_local if nxt is not None else None):
            if not self._misorder_for_test:
                self._apply_pending(c, shard, timed=self._stream is None)
            if nxt is not None:
                c.fresh_rows = shard.lookup(fresh_rows_local)  # line 12's lookup
            if self._misorder_for_test:
                self._apply_pending(c, shard, timed=self._stream is None)
            if nxt is not None:  # line 12's AllToAll: the fresh rows of i+1, early
                nxt.fresh_handle = self.bulk_transport.all_to_all(c.fresh_rows, fresh_send, fresh_recv)

        # lines 18-20: the collision gradients leave first; their update and line 21 follow in the collision
        # chain, off the model thread. A last step updates at once: no next forward may come.
        h = self.backward_transport.all_to_all(g.index_select(0, co_idx), co_send, co_recv)
        if nxt is None:
            self._update_collisions(shard, h, co_rows)
        else:
            c.pending_co = self._collision_chain(shard, h, co_rows, carried_rows_local, carried_send, carried_recv)
            c.pending_ex = (self.bulk_transport.all_to_all(g.index_select(0, ex_idx), ex_send, ex_recv), ex_rows)
            self.row_counts["early"] += sum(fresh_send)
            self.row_counts["collision"] += sum(carried_send)
            self.row_counts["deferred"] += sum(ex_recv)
        c.cur, c.nxt = nxt, None
        c.co_shard = c.fresh_shard = c.fresh_rows = c.flags_handle = c.counts = None
        c.awaiting_backward = False

    # ------------------------------------------------------------------ flush, eval, state
    def flush(self) -> None:
        """Applies deferred gradients and collects the exchanges in flight (end of training, checkpoint, eval,
        reshard). Afterwards the tables equal the synchronous path's; training continues unchanged."""
        busy = [n for n, c in self.ctx.items() if c.awaiting_backward]
        if busy:
            raise ValueError(f"rank {self.rank}: prioritized embeddings: flush between a forward and its backward (groups {busy})")
        if self._stream is not None:  # the side stream's updates and lookups come first
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for name, c in self.ctx.items():
            self._finish_collisions(c, self.shards[name])
            self._apply_pending(c, self.shards[name])
            if c.cur is not None:
                self._merged(c.cur, self.shards[name])

    def _eval_forward(self, ids: Ids) -> dict[str, torch.Tensor]:
        """Synchronous lookup of up-to-date rows; the training context does not advance."""
        if ids is None:
            raise ValueError(f"rank {self.rank}: prioritized embeddings: an evaluation forward needs its ids")
        self.flush()
        return super().forward(ids)

    def get_extra_state(self) -> dict:
        state = super().get_extra_state()  # flushes
        in_flight = {}
        for name, c in self.ctx.items():
            if c.cur is not None:
                s = c.cur
                in_flight[name] = {
                    "num_ids": s.sid.num_ids, "segments": list(s.sid.segments), "perm": s.sid.perm.clone(),
                    "send_splits": list(s.sid.send_splits), "recv_splits": list(s.sid.recv_splits),
                    "local": s.local.clone(), "embeddings": s.ready.clone(),
                }
        state["in_flight"] = in_flight
        return state

    def set_extra_state(self, state: dict) -> None:
        super().set_extra_state(state)
        for name, c in self.ctx.items():
            c.__init__()
            saved = state.get("in_flight", {}).get(name)
            if saved is None:
                continue
            shard = self.shards[name]
            dev = shard.weight.device
            sid = ShardedIds(name, saved["num_ids"], saved["segments"], saved["perm"].to(dev), saved["send_splits"], saved["recv_splits"], None)
            sid._shard_ids = saved["local"].to(dev) + shard.base
            c.cur = _Step(sid, saved["local"].to(dev), ready=saved["embeddings"].to(dev))
