"""Prioritized (collision-aware) embedding updates: Algorithm 2 of the paper, bit-exact with the synchronous path.

A persistent context per embedding group carries values across steps. Step i's forward receives the ids of
step i+1 (already in shard-major form, from the loader's ID-prefetch stage) and, on every shard:

    line 10    marks step i's rows that step i+1 uses again (collision) and step i+1's rows that step i does
               not use (exclusive of i+1, "fresh");
    line 13-14 sends back, per id, the flags that tell the batch-major side which of its positions are
               collision rows of step i (line 14's superscript is i) and fresh rows of step i+1;
    line 6-7   applies the exclusive gradients deferred by step i-1 (rows of i-1 that step i does not use);
    line 12    looks up the fresh rows of i+1 (nothing of step i writes them, and line 7 came first, so they
               hold their step-(i+1) values) and sends them, once the flags give the sizes (see Sizes);
    line 15    returns step i's embeddings: the fresh rows sent during step i-1, merged with the collision
               rows sent after step i-1's update.

Step i's backward splits the gradient by the flags (line 18), sends the collision gradients first and the
exclusive ones after (the next step's line 7 applies those). Lines 20-21 follow as soon as the collision
gradients arrive: update those rows, send their new values, which step i+1's line 15 merges.

Three kinds of thread do this. The model's threads (forward; autograd's backward thread on GPU) issue the
flags and the gradient exchanges. The bulk chain runs lines 6-7 and 12 and issues the large exchanges (fresh
rows, exclusive gradients): it waits there for the flags and the deferred gradients, so line 12's rows travel
during step i's compute. The collision chain runs lines 20-21: its two exchanges overlap the end of step i
(dense all-reduce, optimizer), so step i+1's forward waits only for what is still in flight. Each chain is the
only thread issuing on its group (fsembed/transports.py); with a single transport there are no chains and the model's
threads run the same functions themselves (lines 6-7 and 12 in backward i, lines 20-21 in forward i+1). Rows
touched concurrently are disjoint (line 7: of i-1 not of i; line 12: of i+1 not of i; lines 20-21: of i and
i+1); every row still receives exactly the updates of the synchronous path, in the same order, with the same
summation (optim.py), and is read only after all of them: tables and losses are equal bit for bit.

Sizes. Algorithm 2 leaves out the tensor-size exchanges. Here the ID exchange's sizes travel in the ID-prefetch
stage (early). Every later exchange's sizes follow from two counts per (source, shard) pair, collision rows of i
and fresh rows of i+1: the shard counts them per source rank in the forward (copied to pinned host memory
there), and the source counts the flags it receives (one byte per id, sent in the forward) on the host, from
the host transport's own copy of them (``keep_host``). With the sizes on the host, the flags on the device give
the positions (``nonzero_static``). So with the host transport no step of the backward synchronises the device
(its event waits are for copies queued in the forward), and on a GPU the host keeps queueing the backward's work
while the dense backward still runs (line 12 shares them: ``_Sizes``, computed once); with an NCCL transport
reading the flags on the host costs a stream sync. The flags exchange is the only addition; its wait is counted
as ID exchange time.

Boundaries. The first step has no previous one: its rows are looked up synchronously. A step with no next one
(``next_ids=None``: end of training) updates all its rows at once. ``flush()`` applies deferred gradients and
collects the exchanges in flight; every rank calls it before a checkpoint (``state_dict()`` itself issues no
collective and changes nothing: after a training step and before ``flush()`` it refuses, in one line, instead
of reading tables that deferred gradients have not reached), and it runs before every evaluation forward and
``full_tables``; afterwards the tables equal the synchronous ones and the context still holds step i+1's
embeddings, so training continues where it was. Evaluation forwards look up synchronously and leave the
context alone. The state in flight (step i+1's ids and embeddings) is part of the checkpoint.

On GPU the chains' work runs on the context's own CUDA stream, after an event recorded on the compute stream
when it was issued (``_on_side``); the transfers themselves are the transport's (copy stream and CPU thread for
the host transport). The model's threads block only in waits for results; those waits are the exposed time
(Timer spans ids_a2a, emb_a2a, grad_a2a). The chains' own waits stall no compute and are not counted.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fscomm.groups import comm_timeout_s
from fscomm.registry import bound_thread, close_bound_threads
from fscomm.worker import SerialWorker, helper_event
from fsdata.batch import lengths_to_offsets
from fsembed.id_prefetch import ShardedIds
from fsembed.schedules import RUNTIME_SCHEDULES
from fsembed.sharded import EMB_A2A, GRAD_A2A, IDS_A2A, GroupShard, Ids, ShardedEmbeddingCollection
from kernels import ops

COLLISION_STEPS = 1024  # the steps whose collision rates a lookup keeps (collision_rates)


@dataclass(frozen=True)
class _Counts:
    """Per rank: collision rows of step i and fresh rows of step i+1, received (``*_recv``: from each source
    rank, on this shard) and sent (``*_send``: to each shard, of this rank's ids)."""

    co_recv: list[int]
    fresh_send: list[int]
    co_send: list[int]
    fresh_recv: list[int]


class _Sizes:
    """Every later exchange's sizes, on the host (see Sizes above). The shard's counts of its two masks are
    computed in the forward and copied to pinned host memory there, so ``get()`` waits only for that copy,
    queued long before, never for the work queued after it; this rank's counts are the flags it received back,
    summed on the host. Computed once, by whichever of the backward and line 12 (the bulk chain) asks first."""

    def __init__(
        self, co_shard: torch.Tensor, fresh_shard: torch.Tensor, step: ShardedIds, nxt: ShardedIds, flags_handle
    ):
        counts = torch.stack(
            [
                _set_per_part(co_shard, step.recv_offsets_on(co_shard.device)),
                _set_per_part(fresh_shard, nxt.recv_offsets_on(fresh_shard.device)),
            ],
            1,
        )  # [W, 2]: row q counts rank q's ids
        self._event = None
        if co_shard.device.type == "cuda":
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = helper_event()  # a chain usually waits on it
            self._event.record()
        else:
            self._host = counts
        self._flags_handle, self._send = flags_handle, (step.send_splits, nxt.send_splits)
        self._lock = threading.Lock()
        self._counts: Optional[_Counts] = None

    def get(self) -> _Counts:
        with self._lock:
            if self._counts is None:
                if self._event is not None:
                    self._event.synchronize()
                # the flags laid out per rank r as step i's entries then step i+1's: the set ones of each part
                sums = _set_per_part(self._flags_handle.host(), lengths_to_offsets(_paired(*self._send))).tolist()
                self._counts = _Counts(self._host[:, 0].tolist(), self._host[:, 1].tolist(), sums[0::2], sums[1::2])
            return self._counts


EARLY_STARTS = ("forward", "backward")
EXCLUSIVE_STARTS = ("backward", "forward")
_WAIT_MARGIN_S = 5.0


def _chain_for(transport, name: str) -> SerialWorker:
    """The chain thread ``name`` of ``transport``: the only thread that issues that chain's work on its group,
    whichever collection of this process runs it (fscomm.registry owns it; ``close_chains`` ends it)."""
    return bound_thread(transport, name)


def close_chains(*transports) -> None:
    """Ends the chain threads of ``transports`` (their queued work runs first)."""
    close_bound_threads(*transports)


class _Later:
    """Side work for a chain thread: submitted to it at once, or, when ``held``, by the first ``start()`` (or
    ``result()``); without a chain, run by the first ``start()`` or ``result()`` in the caller's thread."""

    def __init__(self, fn: Callable, worker: Optional[SerialWorker], held: bool = False):
        self._fn, self._worker = fn, worker
        self._future: Optional[Future] = None
        self.in_thread = worker is not None
        if worker is not None and not held:
            self.start()

    def start(self) -> None:
        if self._future is not None:
            return
        if self._worker is not None:
            self._future = self._worker.submit(self._fn)
            return
        self._future = Future()
        try:
            self._future.set_result(self._fn())
        except BaseException as exc:
            self._future.set_exception(exc)

    def result(self, timeout: Optional[float] = None):
        """The work's result. The wait is bounded (default: the job's communication timeout plus a margin: the
        work's own exchanges fail first), so a stuck chain is an error naming it, not a hang."""
        self.start()
        limit = timeout if timeout is not None else comm_timeout_s() + _WAIT_MARGIN_S
        try:
            return self._future.result(limit)
        except FutureTimeout:
            chain = self._worker.name if self._worker is not None else "the caller's thread"
            raise TimeoutError(
                f"embedding chain {chain!r} did not finish its work within {limit:g} s (--comm-timeout-s plus a margin)"
            ) from None


def _set_per_part(mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Set entries of each consecutive part of ``mask`` (parts between ``offsets``, on the mask's device)."""
    return ops.segment_sum(mask.to(torch.int64), offsets)


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the set entries of a 1-D mask whose count is already known (no host sync on GPU)."""
    return torch.nonzero_static(mask, size=count).squeeze(1)


def _paired(a_splits: list[int], b_splits: list[int]) -> list[int]:
    """Per rank r: ``a_splits[r]`` then ``b_splits[r]``: the segment sizes of :func:`_interleave`'s layout."""
    return [n for pair in zip(a_splits, b_splits) for n in pair]


def _interleave(a: torch.Tensor, a_splits: list[int], b: torch.Tensor, b_splits: list[int]) -> torch.Tensor:
    """Per rank r: a's segment r then b's segment r (two exchanges in one AllToAll)."""
    pa, pb = a.split(a_splits), b.split(b_splits)
    return torch.cat([x for pair in zip(pa, pb) for x in pair])


def _deinterleave(x: torch.Tensor, a_splits: list[int], b_splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_interleave`: a's segments and b's segments, each back to back. Three torch ops
    whatever the world size (a slice per rank would cost two ops per rank, every step)."""
    parts = x.split(_paired(a_splits, b_splits))
    return torch.cat(parts[0::2]), torch.cat(parts[1::2])


@dataclass
class _Step:
    """One step's ids of one group, on both sides, and its embeddings on their way to the batch-major side."""

    sid: ShardedIds
    local: torch.Tensor  # shard-major local rows [M]
    fresh_idx: Optional[torch.Tensor] = None  # send-order positions of rows the previous step did not use
    carried_idx: Optional[torch.Tensor] = None  # send-order positions of the other rows
    fresh: Optional[_Later] = None  # lines 6-7 and 12 -> (handle -> fresh rows in send order, tensors to keep)
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
        self.collided: Optional[torch.Tensor] = None  # number of rows of i used by i+1 (a 0-dim device tensor)
        self.sizes: Optional[_Sizes] = None  # the counts that size every exchange after the flags
        self.pending_ex = None  # (_Later -> handle -> gradients, local rows): a step's deferred exclusive part
        self.pending_co: Optional[_Later] = None  # step i's collision update and line 21 (_collision_chain)
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

    def __init__(
        self, *args, stale: bool = False, early_start: str = "forward", exclusive_start: str = "forward", **kwargs
    ):
        """``stale=True``: the semi-synchronous baseline (TorchRec's TrainPipelineSemiSync pattern): every row
        of step i+1 is fetched early, the rows step i also updates included, so those arrive one update stale.
        Not FreeScale's numerics: it exists to measure what staleness costs.

        ``early_start``: when the bulk chain starts lines 6-7 and 12 of step i+1 (the exchanges are the same
        either way): ``"forward"``, as forward i issues them; ``"backward"``, held until ``start_early_rows()``
        (the embedding wrap calls it as the model's forward returns, so the chain's Python runs beside the
        backward, not the forward: on a GPU the training thread waits there without the GIL) and at the latest
        when the backward reaches the embeddings. The default here is ``"forward"`` (the embedding wrap's,
        ``pipelines.api.wrap.EARLY_START``, is ``"backward"``): a collection used on its own has no caller of
        ``start_early_rows()``, so held rows would start only when the backward reaches the embeddings and
        overlap little of the step's compute.

        ``exclusive_start``: when backward i's exclusive gradients (line 18's deferred part) leave on the bulk
        chain: ``"backward"``, as soon as the backward has produced them; ``"forward"`` (the default), held
        until forward i+1 has waited for its collision rows (``_finish_collisions``), just before it issues the
        early rows that apply them. They are not needed before then, and held they do not share the copy engines
        and the host transport with the collision gradients' round trip and the dense all-reduce at the step's
        end. The exchanges and their order on the bulk chain are the same either way. Without a bulk chain they
        leave at once."""
        if early_start not in EARLY_STARTS:
            raise ValueError(f"prioritized embeddings: early_start must be one of {EARLY_STARTS}, got {early_start!r}")
        if exclusive_start not in EXCLUSIVE_STARTS:
            raise ValueError(
                f"prioritized embeddings: exclusive_start must be one of {EXCLUSIVE_STARTS}, got {exclusive_start!r}"
            )
        super().__init__(*args, **kwargs)
        self.stale = bool(stale)
        self.early_start, self.exclusive_start = early_start, exclusive_start
        self._held: list[
            _Later
        ] = []  # lines 6-7 and 12 issued by the forward, not started yet (early_start="backward")
        self.ctx = {name: _GroupContext() for name in self.shards}
        # per step, the latest COLLISION_STEPS: (collided ids, all ids) on this rank's shards; bounded, as a job
        # runs for millions of steps
        self._collisions: deque[tuple[torch.Tensor, int]] = deque(maxlen=COLLISION_STEPS)
        # shard-major id counts, cumulative: looked up early (line 12), sent after the collision update
        # (line 21), gradients deferred (line 18's exclusive part)
        self.row_counts = {"early": 0, "collision": 0, "deferred": 0}
        self._unflushed = False  # a training step ran since the last flush(): the tables lag its deferred work
        # Algorithm 2's C.stream: the side work of lines 6-7, 12 and 20-21 on GPU (None on CPU, where the
        # exchanges progress behind handles in the transport's threads).
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The chains' threads: with the embedding exchanges' own groups, the bulk chain issues every bulk exchange
        # (lines 12 and 18's exclusive part) and the collision chain line 21 on a group of its own. Without them (a
        # single transport, or no collision group) the model's threads run that work where it was issued from.
        self.collision_transport = self.transports.collision
        chained = self.collision_transport is not None
        self._bulk_chain = _chain_for(self.bulk_transport, "fsembed-bulk-chain") if chained else None
        self._collision_chain_worker = (
            _chain_for(self.collision_transport, "fsembed-collision-chain") if chained else None
        )
        self.schedule = "prioritized"

    def set_schedule(self, schedule: str) -> None:
        """``"prioritized"`` (Algorithm 2, the default) or ``"sdd"``: every training step looks its rows up and
        exchanges them inside the step, as the synchronous collection does (its ids still come prefetched).
        Both give the synchronous path's numbers bit for bit, so a job may switch between them at any step
        boundary (pipelines.job.run.schedule_probe chooses from measured step times). Leaving the prioritized schedule
        flushes (deferred gradients applied, exchanges in flight collected) and drops the context: the next step's rows
        prefetched in it are looked up again, from the same table values. Coming back, the first step looks its
        rows up synchronously, as a job's first step does."""
        if schedule not in RUNTIME_SCHEDULES:
            raise ValueError(f"prioritized embeddings: schedule must be one of {RUNTIME_SCHEDULES}, got {schedule!r}")
        if schedule == self.schedule:
            return
        if schedule == "sdd":
            self.flush()  # also starts (and so empties) the held early rows
            for c in self.ctx.values():
                c.__init__()
        self.schedule = schedule

    def _on_side(self, after: Optional["torch.cuda.Event"] = None):
        """Context for a chain's work: on GPU the side stream, after ``after`` (recorded on the compute stream
        when the work was issued; or later, by ``_follow``). The tensors it reads stay referenced by the caller
        until the compute stream is ordered after that work, so the allocator cannot hand their memory out
        early."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._follow(after)
        return torch.cuda.stream(self._stream)

    def _follow(self, after: Optional["torch.cuda.Event"]) -> None:
        """The side stream waits for ``after``. A chain calls it once its host waits are over: a wait queued on
        the side stream while the chain still blocks on the host would hold back the other chain's work queued
        behind it (line 12's lookup stuck behind a whole backward's compute)."""
        if self._stream is not None and after is not None:
            self._stream.wait_event(after)

    def _mark(self) -> Optional["torch.cuda.Event"]:
        """An event after everything the compute stream has queued so far (None on CPU)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ------------------------------------------------------------------ forward
    def forward(self, ids: Optional[Ids], next_ids: Optional[Ids] = None) -> dict[str, torch.Tensor]:
        if not (self.training and torch.is_grad_enabled()):
            return self._eval_forward(ids)
        if self.schedule == "sdd":
            if ids is None:
                raise ValueError(f"rank {self.rank}: prioritized embeddings: the sdd schedule needs every step's ids")
            return super().forward(ids)
        busy = [n for n, c in self.ctx.items() if c.awaiting_backward]
        if busy:
            raise ValueError(
                f"rank {self.rank}: prioritized embeddings: forward of a new step before the backward of the last one "
                f"(groups {busy})"
            )
        first = any(c.cur is None for c in self.ctx.values())
        if first and ids is None:
            raise ValueError(
                f"rank {self.rank}: prioritized embeddings: the first step (and the step after a last one) needs its "
                "ids"
            )
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
        self._unflushed = True
        return out

    @property
    def collision_rates(self) -> list[float]:
        """Per training step, the latest ``COLLISION_STEPS``: the share of this rank's shard-major ids whose row the
        next step uses again (Figure 3's collision %; 0 for a last step, which has no next one)."""
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
        """Lines 8-15 for one group. The next step's ids, masks and flags come first: they touch neither the
        side stream nor the rows the previous backward's collision chain writes, so the chain has that long
        more to arrive before this forward waits for it (``_finish_collisions``), and that wait comes before
        lines 6-7 and 12 are issued, whose side-stream work it must not wait for."""
        step = c.cur
        c.nxt = c.co_shard = c.fresh_shard = c.flags_handle = c.sizes = None
        if sid_next is not None:
            nlocal = self._wait_ids(sid_next, shard)  # line 8 (sent early by the ID-prefetch stage)
            c.co_shard = ops.collision_mask(step.local, nlocal)  # line 10
            c.fresh_shard = ~ops.collision_mask(nlocal, step.local)
            c.collided = c.co_shard.sum()  # the measured collisions (Figure 3), whatever the routing below
            if self.stale:  # semi-sync: no row waits for this step's update
                c.co_shard = torch.zeros_like(c.co_shard)
                c.fresh_shard = torch.ones_like(c.fresh_shard)
            flags = _interleave(c.co_shard, step.sid.recv_splits, c.fresh_shard, sid_next.recv_splits).to(torch.uint8)
            c.flags_handle = self.transport.all_to_all(  # lines 13-14, as one flag per id
                flags,
                [a + b for a, b in zip(step.sid.recv_splits, sid_next.recv_splits)],
                [a + b for a, b in zip(step.sid.send_splits, sid_next.send_splits)],
                keep_host=True,  # lines 12 and 18 count them on the host
            )
            c.sizes = _Sizes(c.co_shard, c.fresh_shard, step.sid, sid_next, c.flags_handle)
        self._finish_collisions(c, shard)
        if sid_next is not None:
            c.nxt = _Step(sid_next, nlocal)
            c.nxt.fresh = self._early_rows(c, shard, step, c.nxt)
        return ops.ranged_combine(self._merged(step, shard), step.sid.perm)  # line 15

    def _early_rows(self, c: _GroupContext, shard: GroupShard, step: _Step, nxt: _Step) -> _Later:
        """Lines 6-7 and 12: apply the exclusive gradients that step i-1 deferred, then look up step i+1's fresh
        rows (step i writes none of them, and line 7 came first, so they hold their step-(i+1) values) and
        send them. Line 7's rows (of i-1, not of i) and line 12's (of i+1, not of i) are disjoint from every
        row step i reads or its collision chain writes.

        In the bulk chain's thread, issued here in forward i (held until ``start_early_rows()`` with
        ``early_start="backward"``): it waits there for the flags' round trip (the sizes) and for the deferred
        gradients, and the rows travel during step i's compute. Without a chain, backward i runs it
        (_Later.start), when both have had the forward to arrive."""
        pending, c.pending_ex = c.pending_ex, None
        if pending is not None:  # held exclusive gradients (exclusive_start="forward") leave now, ahead of these rows
            pending[0].start()
        sizes, fresh_shard = c.sizes, c.fresh_shard
        after, timed = self._mark(), self._bulk_chain is None and self._stream is None

        def early():
            with self._on_side():
                grads = self._exclusive_grads(pending, timed)  # host waits first (see _follow)
                counts = sizes.get()
                self._follow(after)
                self._apply_rows(
                    shard, pending, grads
                )  # line 7 before line 12's lookup (tests move it to break parity)
                rows_local = nxt.local.index_select(0, _positions(fresh_shard, sum(counts.fresh_send)))
                rows = shard.lookup(rows_local)  # line 12's lookup
                # line 12's AllToAll
                handle = self.bulk_transport.all_to_all(rows, counts.fresh_send, counts.fresh_recv)
            return handle, (pending, rows_local, fresh_shard, nxt.local)

        held = self._bulk_chain is not None and self.early_start == "backward"
        later = _Later(early, self._bulk_chain, held=held)
        if held:
            self._held.append(later)
        return later

    def start_early_rows(self) -> None:
        """Starts the held lines 6-7 and 12 of every group, in the order the forward issued them (the same on
        every rank: the bulk chain's exchanges pair up in order). A no-op unless ``early_start="backward"``."""
        held, self._held = self._held, []
        for later in held:
            later.start()

    def _merged(self, step: _Step, shard: GroupShard) -> torch.Tensor:
        """Line 15's rows in send order. The fresh and the collision rows' buffers were allocated on the side
        stream and are read here on the compute stream: safe because every later side-stream section starts
        after the compute stream's work at the time it was issued (``after``), so the allocator cannot hand
        that memory back to the side stream early. Once the fresh rows' copy is waited for, the compute stream
        is ordered after line 7 and 12's side work, and the tensors they read may go."""
        if step.ready is None:
            with self.timer.span(EMB_A2A):
                handle, _ = step.fresh.result()
                fresh = handle.wait()
                carried = step.carried_handle.wait()
            out = torch.empty(step.sid.num_ids, shard.layout.dim, dtype=shard.weight.dtype, device=shard.weight.device)
            out.index_copy_(0, step.fresh_idx, fresh)
            out.index_copy_(0, step.carried_idx, carried)
            step.ready = out
            step.fresh = step.carried_handle = None
        return step.ready

    def _update_collisions(self, shard: GroupShard, handle, rows: torch.Tensor) -> None:
        """A last step's update (every row is a collision row), at once on the compute stream."""
        with self.timer.span(GRAD_A2A):
            grads = handle.wait()
            if self._stream is not None:
                # The side stream's rows are disjoint from the collision rows, but they live in the same weight
                # and state tensors, and TORCH_CUDA_SANITIZER (tensor-granular) reports such access as a race, so
                # the compute stream waits here for the side work (a stall, if any, counts as exposed).
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self.optimizer.apply(shard.weight, shard.state, rows, grads)

    def _collision_chain(
        self,
        shard: GroupShard,
        grads_handle,
        rows: torch.Tensor,
        carried_local: torch.Tensor,
        carried_send: list[int],
        carried_recv: list[int],
    ) -> _Later:
        """Lines 20-21 once the collision gradients have left: update those rows when their gradients arrive,
        then look up and send the rows' new values for step i+1.

        In the collision chain's thread, so that both exchanges overlap the end of the step (the dense
        all-reduce, the optimizer) and the next forward finds the rows on their way; without one, the next
        forward runs it (on the forward group). Only step i+1's line 15 reads those rows, after waiting for
        them (_finish_collisions). Returns (line 21's handle, the tensors the side stream reads)."""
        after = self._mark()

        def chain():
            transport = self.collision_transport if self.collision_transport is not None else self.transport
            with self._on_side():
                grads = grads_handle.wait()  # host wait first (see _follow)
                self._follow(after)
                self.optimizer.apply(shard.weight, shard.state, rows, grads)
                handle = transport.all_to_all(shard.lookup(carried_local), carried_send, carried_recv)
            return handle, (grads, rows, carried_local)

        return _Later(chain, self._collision_chain_worker)

    def _finish_collisions(self, c: _GroupContext, shard: GroupShard) -> None:
        """The previous backward's collision chain, waited for (or run now); the compute stream then follows
        the side stream, so the tensors the chain read may go."""
        if c.pending_co is None:
            return
        pending, c.pending_co = c.pending_co, None
        with self.timer.span(GRAD_A2A):
            c.cur.carried_handle, _ = pending.result()
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _exclusive_grads(self, pending, timed: bool) -> Optional[torch.Tensor]:
        """A step's deferred exclusive gradients, waited for (``timed``: the wait stalls the model's thread and
        counts as exposed)."""
        if pending is None:
            return None
        with self.timer.span(GRAD_A2A) if timed else contextlib.nullcontext():
            return pending[0].result().wait()

    def _apply_rows(self, shard: GroupShard, pending, grads: Optional[torch.Tensor]) -> None:
        if pending is not None:
            self.optimizer.apply(shard.weight, shard.state, pending[1], grads)

    def _apply_exclusive(self, shard: GroupShard, pending, timed: bool = True) -> None:
        """Line 7 at once, on the current stream."""
        self._apply_rows(shard, pending, self._exclusive_grads(pending, timed))

    # ------------------------------------------------------------------ backward
    def _backward_group(self, name: str, grad_out: torch.Tensor) -> None:
        c, shard = self.ctx[name], self.shards[name]
        step, nxt = c.cur, c.nxt
        sid = step.sid
        g = self._to_send_order(grad_out, sid)
        self.start_early_rows()  # held ones: before this backward's own exchanges on the bulk chain
        if nxt is not None:
            nxt.fresh.start()  # without a bulk chain, lines 6-7 and 12 run here

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
                n = c.sizes.get()
                co_recv, fresh_send, co_send, fresh_recv = n.co_recv, n.fresh_send, n.co_send, n.fresh_recv
                flags = c.flags_handle.wait().to(torch.bool)
                co_pos, fresh_pos = _deinterleave(flags, sid.send_splits, nxt.sid.send_splits)
                co_shard = c.co_shard
                carried_send = [a - b for a, b in zip(nxt.sid.recv_splits, fresh_send)]
                carried_recv = [a - b for a, b in zip(nxt.sid.send_splits, fresh_recv)]
                # Positions with their counts known: no further syncs (nonzero_static).
                nxt.fresh_idx = _positions(fresh_pos, sum(fresh_recv))
                nxt.carried_idx = _positions(~fresh_pos, sum(carried_recv))
                carried_rows_local = nxt.local.index_select(0, _positions(~c.fresh_shard, sum(carried_send)))
            ex_send = [a - b for a, b in zip(sid.send_splits, co_send)]
            ex_recv = [a - b for a, b in zip(sid.recv_splits, co_recv)]
            co_idx, ex_idx = _positions(co_pos, sum(co_send)), _positions(~co_pos, sum(ex_send))
            co_rows = step.local.index_select(0, _positions(co_shard, sum(co_recv)))
            ex_rows = step.local.index_select(0, _positions(~co_shard, sum(ex_recv)))

        # lines 18-20: the collision gradients leave first; their update and line 21 follow in the collision
        # chain, off the model thread. A last step applies step i-1's deferred part (rows it does not use) and
        # updates every row at once: no next forward may come.
        h = self.backward_transport.all_to_all(g.index_select(0, co_idx), co_send, co_recv)
        if nxt is None:
            pending, c.pending_ex = c.pending_ex, None
            with self._on_side(self._mark()):
                self._apply_exclusive(shard, pending, timed=self._stream is None)
            self._update_collisions(shard, h, co_rows)  # the compute stream follows the side stream: pending may go
        else:
            c.pending_co = self._collision_chain(shard, h, co_rows, carried_rows_local, carried_send, carried_recv)
            # line 18's exclusive part: the bulk chain sends it, the next step's line 7 applies it
            g_ex, after = g.index_select(0, ex_idx), self._mark()

            def send_exclusive():
                with self._on_side(after):
                    return self.bulk_transport.all_to_all(g_ex, ex_send, ex_recv)

            hold = self._bulk_chain is not None and self.exclusive_start == "forward"
            c.pending_ex = (_Later(send_exclusive, self._bulk_chain, held=hold), ex_rows)
            if not hold:
                c.pending_ex[0].start()  # without a bulk chain it leaves now
            self.row_counts["early"] += sum(fresh_send)
            self.row_counts["collision"] += sum(carried_send)
            self.row_counts["deferred"] += sum(ex_recv)
        c.cur, c.nxt = nxt, None
        c.co_shard = c.fresh_shard = c.flags_handle = c.sizes = None
        c.awaiting_backward = False

    # ------------------------------------------------------------------ flush, eval, state
    def flush(self) -> None:
        """Applies deferred gradients and collects the exchanges in flight (end of training, checkpoint, eval,
        reshard). Afterwards the tables equal the synchronous path's; training continues unchanged."""
        busy = [n for n, c in self.ctx.items() if c.awaiting_backward]
        if busy:
            raise ValueError(
                f"rank {self.rank}: prioritized embeddings: flush between a forward and its backward (groups {busy})"
            )
        self.start_early_rows()
        for name, c in self.ctx.items():
            shard = self.shards[name]
            if c.cur is not None and c.cur.fresh is not None:
                c.cur.fresh.result()  # lines 6-7 and 12 for the step to come: done before the rest
            self._finish_collisions(c, shard)  # the compute stream then follows the side stream
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            pending, c.pending_ex = c.pending_ex, None
            self._apply_exclusive(shard, pending)
            if c.cur is not None:
                self._merged(c.cur, shard)
        self._unflushed = False

    def _eval_forward(self, ids: Ids) -> dict[str, torch.Tensor]:
        """Synchronous lookup of up-to-date rows; the training context does not advance."""
        if ids is None:
            raise ValueError(f"rank {self.rank}: prioritized embeddings: an evaluation forward needs its ids")
        self.flush()
        return super().forward(ids)

    def get_extra_state(self) -> dict:
        if self._unflushed:  # flushing here could start an exchange on one rank alone (rank 0 saving): a hang
            raise ValueError(
                f"rank {self.rank}: prioritized embeddings: state_dict() after a training step needs flush() first, "
                "called on every rank (it completes the exchanges in flight); a complete checkpoint needs every "
                "rank's shard"
            )
        state = super().get_extra_state()
        in_flight = {}
        for name, c in self.ctx.items():
            if c.cur is not None:
                s = c.cur
                in_flight[name] = {
                    "num_ids": s.sid.num_ids,
                    "segments": list(s.sid.segments),
                    "perm": s.sid.perm.clone(),
                    "send_splits": list(s.sid.send_splits),
                    "recv_splits": list(s.sid.recv_splits),
                    "local": s.local.clone(),
                    "embeddings": s.ready.clone(),
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
            sid = ShardedIds.completed(
                name,
                saved["num_ids"],
                saved["segments"],
                saved["perm"].to(dev),
                saved["send_splits"],
                saved["recv_splits"],
                saved["local"].to(dev) + shard.base,
            )
            c.cur = _Step(sid, saved["local"].to(dev), ready=saved["embeddings"].to(dev))
