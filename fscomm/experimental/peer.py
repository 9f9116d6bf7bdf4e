"""The copy-engine peer transport: exchanges between GPUs of one host as device-to-device copies, no kernels.

Every rank owns one receive buffer on its GPU and maps every peer's receive buffer into its own process through
CUDA IPC (torch.multiprocessing's shared CUDA tensors). An exchange is then:

1. a control step on the CPU over the group (gloo): every rank's bytes per destination and the bytes it expects
   per source, gathered by all, so every rank knows where its pieces land in each peer's buffer, and a
   mismatch between a sender's splits and a receiver's is the same error on every rank, never a hang;
2. pushes: ``cudaMemcpyAsync`` from the input into the peers' buffers (and this rank's own piece straight into
   the result) on copy streams of the transport's own, one per destination so that copies to several GPUs run
   on several copy engines at once, ordered after the caller's stream by an event. Between GPUs that is a
   copy-engine transfer over NVLink; no SM is taken from the compute the exchange overlaps;
3. once this rank's pushes are done (the worker thread sleeps on an event) a barrier on the group: from then on
   every piece addressed to this rank lies in its buffer;
4. copy out: the buffer into the result on this rank's copy stream; the caller's stream waits on its event.

Steps 1-4 run in the group's worker thread (fscomm.worker), so the call returns a handle at once and exchanges
complete in issue order. A buffer is written again only after its owner's copy out of the previous exchange has
finished: the owner waits for that copy before it joins the next control step, which every peer must pass
before it pushes. Buffers are sized by the largest exchange seen: when one is too small, its owner allocates a
larger one (power-of-two bytes) and the handles are exchanged again, a collective every rank reaches at the
same exchange because every rank sees the same byte table. ``close()`` (collective) releases the mappings and
the buffers.

Each exchange costs two host round trips over the group and two waits of the worker on the GPU, whatever its
size; ``phase_seconds()`` splits the worker's time by step, so a fixed cost per exchange can be traced to them.

CUDA IPC opens a peer's buffer on the peer's device, so every process keeps a context on every peer's GPU, and
every rank must see the same GPUs (same ``CUDA_VISIBLE_DEVICES``): that is checked when the transport is made,
with the ranks' host names (the transport moves data within one host only).
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.host_relay import RelayHandle
from fscomm.transport import (
    Handle,
    Splits,
    TransportBase,
    TransportUnavailableError,
    as_bytes,
    check_all_gather,
    check_all_to_all,
    diagnose,
    prepare_all_to_all,
    row_bytes,
)
from fscomm.worker import helper_event, worker_for

MIN_CAPACITY = 1 << 20
# the worker's steps of one exchange: waiting for the last copy out, the control exchange, buffer growth, the
# pushes (queued and waited for), the barrier, queueing the copy out
PHASES = ("last_copy", "control", "grow", "pushes", "barrier", "copy_out")


def grown_capacity(need: int, current: int, minimum: int = MIN_CAPACITY) -> int:
    """The receive buffer's bytes after an exchange that needs ``need``: unchanged while it fits, else the next
    power of two at or above ``need`` (and ``minimum``), so a slowly growing exchange re-maps O(log) times."""
    if need < 0 or current < 0:
        raise ValueError(f"grown_capacity: need ({need}) and current ({current}) must be non-negative")
    if need <= current:
        return current
    size = max(int(minimum), 1)
    while size < need:
        size <<= 1
    return size


@dataclass(frozen=True)
class Plan:
    """One rank's copies for one exchange, in bytes.

    pushes: (destination rank, offset in the input, length, offset in the destination's receive buffer);
    own: (offset in the input, length, offset in the result) of the piece this rank sends itself;
    copy_out: (offset in this rank's buffer, length, offset in the result);
    need: the bytes each rank's receive buffer must hold for this exchange."""

    pushes: tuple[tuple[int, int, int, int], ...]
    own: tuple[int, int, int]
    copy_out: tuple[tuple[int, int, int], ...]
    need: tuple[int, ...]


def plan_exchange(sent: Sequence[Sequence[int]], send_offsets: Sequence[int], rank: int) -> Plan:
    """The copies of ``rank`` from the byte table ``sent[s][d]`` (bytes rank s sends rank d) and this rank's
    input offset of each destination's piece (an all_to_all: the prefix sums of its row; an all_gather: zeros,
    the whole input goes to every rank).

    Rank d's buffer holds the pieces of the other ranks in rank order (its own piece goes straight to the
    result); its result holds every source's piece in rank order."""
    world = len(sent)
    if any(len(row) != world for row in sent) or len(send_offsets) != world or not 0 <= rank < world:
        raise ValueError(f"plan_exchange: need a {world}x{world} byte table, {world} offsets and a rank below {world}")

    def buffer_offset(src: int, dst: int) -> int:
        return sum(sent[s][dst] for s in range(src) if s != dst)

    need = tuple(sum(sent[s][d] for s in range(world) if s != d) for d in range(world))
    pushes = tuple(
        (d, int(send_offsets[d]), sent[rank][d], buffer_offset(rank, d))
        for d in range(world)
        if d != rank and sent[rank][d] > 0
    )
    before = sum(sent[s][rank] for s in range(rank))  # what the sources below this rank sent it
    own = (int(send_offsets[rank]), sent[rank][rank], before)
    copy_out = tuple(
        piece for piece in ((0, before, 0), (before, need[rank] - before, before + sent[rank][rank])) if piece[1] > 0
    )
    return Plan(pushes, own, copy_out, need)


def check_table(sent: Sequence[Sequence[int]], expected: Sequence[Sequence[int]], op: str, rank: int) -> None:
    """``expected[d][s]``: the bytes rank d expects from rank s. Every rank checks the whole table, so a
    mismatch is the same ValueError everywhere (the first one, in rank order)."""
    world = len(sent)
    for d in range(world):
        for s in range(world):
            if sent[s][d] != expected[d][s]:
                raise ValueError(
                    f"fscomm peer {op} on rank {rank}: rank {d} expects {expected[d][s]} bytes from rank {s}, which "
                    f"sends {sent[s][d]} (recv_splits / sizes of rank {d} disagree with what rank {s} sends)"
                )


def check_same_host(peers: Sequence[tuple[str, str, int]], rank: int) -> None:
    """``peers[r]``: (host name, CUDA_VISIBLE_DEVICES, device count) of rank r."""
    hosts = sorted({p[0] for p in peers})
    if len(hosts) > 1:
        raise TransportUnavailableError(
            f"transport 'peer' on rank {rank}: the ranks are on {len(hosts)} hosts ({', '.join(hosts[:4])}); it "
            "copies between GPUs of one host only: use 'host' or 'rdma' across hosts"
        )
    views = sorted({(p[1], p[2]) for p in peers})
    if len(views) > 1:
        raise TransportUnavailableError(
            f"transport 'peer' on rank {rank}: the ranks see different GPUs (CUDA_VISIBLE_DEVICES, count: {views}); "
            "CUDA IPC names a peer's buffer by its device index, so every rank must see the same devices"
        )


class _PhaseClock:
    def __init__(self, totals: dict[str, float]):
        self.totals, self.t = totals, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.t
        self.t = now


class PeerHandle(RelayHandle):
    """An exchange in the group's worker thread; ``wait()`` orders the caller's stream after the copy out (an
    event wait: the host blocks only until the worker has queued that copy). Complete once the copy out has run
    on the device too."""

    def __init__(self, future: Future, copied: "torch.cuda.Event", device: torch.device):
        super().__init__(future, copied, device)

    def is_completed(self) -> bool:
        return self._future.done() and (self._future.exception() is not None or self._copied_back.query())


class PeerTransport(TransportBase):
    name = "peer"
    group_backend = "gloo"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not torch.cuda.is_available():
            return "no CUDA device (the peer transport copies between GPUs of one host)"
        if not dist.is_gloo_available():
            return "this torch was built without gloo (the peer transport's control exchange runs on it)"
        return None

    @classmethod
    def default_group(cls) -> dist.ProcessGroup:
        """fscomm's gloo group for this backend (collective on first use): not the host transport's, so the two
        do not share a worker thread and queue behind each other's exchanges."""
        return groups.default_group("gloo", kind="peer")

    def __init__(self, group: dist.ProcessGroup):
        """Collective: every rank of ``group`` (a gloo group) makes it, in the same order."""
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"peer transport: needs a gloo group (its control exchange runs on the CPU), got a {backend!r} group"
            )
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        me = (socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES", ""), torch.cuda.device_count())
        peers: list = [None] * self.world_size
        dist.all_gather_object(peers, me, group=group)
        check_same_host(peers, self.rank)
        self.device: Optional[torch.device] = None
        self._streams: list["torch.cuda.Stream"] = []  # copy streams, one per destination
        self._buffer: Optional[torch.Tensor] = None  # this rank's receive buffer (uint8)
        self._peers: list[Optional[torch.Tensor]] = [None] * self.world_size  # the peers' buffers, mapped here
        self._capacity = [0] * self.world_size
        self._last_copy: Optional[tuple["torch.cuda.Event", torch.Tensor]] = None  # event, and the result it writes
        self._closed = False
        self._failed: Optional[BaseException] = None
        self.remaps = 0
        self.exchanges = 0
        self._phase_s = dict.fromkeys(PHASES, 0.0)

    def buffer_stats(self) -> dict[str, int]:
        """capacity_bytes: this rank's receive buffer; remaps: handle exchanges after growth (flat after warm-up)."""
        return {"capacity_bytes": self._capacity[self.rank], "remaps": self.remaps, "exchanges": self.exchanges}

    def phase_seconds(self) -> dict[str, float]:
        """The worker's time so far in each step of the exchanges (``PHASES``): where a fixed cost per exchange
        comes from (the host round trips, or the copies themselves)."""
        return dict(self._phase_s)

    # --- public collectives ---------------------------------------------------------------------------

    def all_to_all(
        self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, *, keep_host: bool = False
    ) -> Handle:
        """``keep_host`` changes nothing here: the data never touches the host, so ``handle.host()`` syncs."""
        state = groups.claim(self.group, "all_to_all")
        check_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        self._check_tensor(tensor, "all_to_all")
        x, out, send_b, recv_b = prepare_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        offsets = [sum(send_b[:d]) for d in range(self.world_size)]
        return self._submit(state, "all_to_all", x, out, send_b, offsets, recv_b)

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        self._check_tensor(tensor, "all_gather")
        x = tensor.contiguous()
        W, nbytes = self.world_size, x.numel() * x.element_size()
        if sizes_l is None:  # every rank's tensor has this shape: expect as many bytes from each
            out = torch.empty((W, *x.shape), dtype=x.dtype, device=x.device)
            expected = [nbytes] * W
        else:
            out = torch.empty((sum(sizes_l), *x.shape[1:]), dtype=x.dtype, device=x.device)
            expected = [s * row_bytes(x) for s in sizes_l]
        return self._submit(state, "all_gather", x, out, [nbytes] * W, [0] * W, expected)

    def close(self) -> None:
        """Collective: releases the peers' buffers mapped here, then (after every rank has) this rank's buffer.
        Later exchanges are refused."""
        if self._closed:
            return
        self._closed = True
        worker_for(self.state).submit(self._release).result()

    def __enter__(self) -> "PeerTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the exchange -----------------------------------------------------------------------------------

    def _check_tensor(self, tensor: torch.Tensor, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"fscomm peer {op} on rank {self.rank}: the transport is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"fscomm peer {op} on rank {self.rank}: an earlier exchange failed ({self._failed}); "
                "the peers' buffers may be mid-exchange, make a new transport"
            )
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            where = getattr(tensor, "device", type(tensor).__name__)
            raise ValueError(
                f"fscomm peer {op} on rank {self.rank}: needs a CUDA tensor, got one on {where} "
                "(the 'host' transport moves CPU tensors)"
            )
        if self.device is not None and tensor.device != self.device:
            raise ValueError(
                f"fscomm peer {op} on rank {self.rank}: the tensor is on {tensor.device}, but this "
                f"rank's buffers are on {self.device} (one device per rank)"
            )

    def _submit(
        self,
        state: groups.GroupState,
        op: str,
        x: torch.Tensor,
        out: torch.Tensor,
        sent_row: list[int],
        offsets: list[int],
        expected_row: list[int],
    ) -> Handle:
        if self.device is None:
            self.device = x.device
            self._streams = [torch.cuda.Stream(device=x.device) for _ in range(self.world_size)]
        seq = state.take_seq()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        copied = helper_event()
        source = [x]  # the input lives until the pushes have read it

        def job() -> torch.Tensor:
            try:
                return self._exchange(op, seq, source, out, sent_row, offsets, expected_row, ready, copied)
            except ValueError:
                raise  # the same mismatch on every rank: nothing was copied, the transport stays usable
            except BaseException as exc:
                self._failed = exc
                raise

        return PeerHandle(worker_for(state).submit(job), copied, x.device)

    def _collective(self, op: str, seq: int, fn):
        try:
            return fn()
        except Exception as exc:
            raise diagnose(self.state, op, seq, exc) from exc

    def _exchange(self, op, seq, source, out, sent_row, offsets, expected_row, ready, copied) -> torch.Tensor:
        torch.cuda.set_device(self.device)  # the worker thread starts on device 0; buffers go on this rank's GPU
        clock = _PhaseClock(self._phase_s)
        self._finish_last_copy()  # peers push into this buffer only after the control step below
        clock.lap("last_copy")
        W = self.world_size
        row = torch.tensor([sent_row, expected_row], dtype=torch.int64)
        table = torch.empty(W * 2 * W, dtype=torch.int64)
        self._collective(op, seq, lambda: dist.all_gather_into_tensor(table, row.reshape(-1), group=self.group))
        table = table.view(W, 2, W)
        sent, expected = table[:, 0].tolist(), table[:, 1].tolist()
        check_table(sent, expected, op, self.rank)
        plan = plan_exchange(sent, offsets, self.rank)
        clock.lap("control")
        self._grow(plan.need, op, seq)
        clock.lap("grow")
        x = source.pop()
        xb, ob = as_bytes(x), as_bytes(out)
        pushed = []
        for stream, copies in self._by_stream(plan, ob):
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                for dst_buf, dst, src, n in copies:
                    dst_buf[dst : dst + n].copy_(xb[src : src + n], non_blocking=True)
                done = helper_event()
                done.record(stream)
                pushed.append(done)
        for done in pushed:
            done.synchronize()
        del x, xb
        clock.lap("pushes")
        self._collective(op, seq, lambda: dist.barrier(group=self.group))  # every piece for this rank has landed
        clock.lap("barrier")
        stream = self._streams[self.rank]
        with torch.cuda.stream(stream):
            for b, n, o in plan.copy_out:
                ob[o : o + n].copy_(self._buffer[b : b + n], non_blocking=True)
            copied.record(stream)
        self._last_copy = (copied, out)  # the result stays allocated until its copy is seen done
        self.exchanges += 1
        clock.lap("copy_out")
        return out

    def _by_stream(self, plan: Plan, out_bytes: torch.Tensor) -> list:
        """The pushes grouped by copy stream, one stream per destination: copies to different GPUs then run
        on different copy engines at once instead of one after another. The own piece goes on this rank's
        stream, ahead of its copy out."""
        by_dest: dict[int, list] = {}
        for d, src, n, dst in plan.pushes:
            by_dest.setdefault(d, []).append((self._peers[d], dst, src, n))
        src, n, dst = plan.own
        if n:
            by_dest.setdefault(self.rank, []).append((out_bytes, dst, src, n))
        return [(self._streams[d], copies) for d, copies in sorted(by_dest.items())]

    def _finish_last_copy(self) -> None:
        if self._last_copy is not None:
            self._last_copy[0].synchronize()
            self._last_copy = None

    def _grow(self, need: Sequence[int], op: str, seq: int) -> None:
        """Collective when any rank's buffer is too small (every rank sees the same ``need``). No buffer is in
        use here: every peer's pushes of the last exchange ended before its barrier, every copy out before this
        exchange's control step."""
        growing = [d for d in range(self.world_size) if need[d] > self._capacity[d]]
        if not growing:
            return
        from torch.multiprocessing.reductions import reduce_tensor

        for d in growing:
            self._peers[d] = None
        shared = None
        if self.rank in growing:
            self._buffer = None
            self._buffer = torch.empty(
                grown_capacity(need[self.rank], self._capacity[self.rank]), dtype=torch.uint8, device=self.device
            )
            shared = reduce_tensor(self._buffer)
        handles: list = [None] * self.world_size
        self._collective(op, seq, lambda: dist.all_gather_object(handles, shared, group=self.group))
        for d in growing:
            rebuild, args = handles[d]
            if d != self.rank:
                self._peers[d] = rebuild(*args)
            self._capacity[d] = int(args[1][0])  # the shared tensor's size: its bytes
        self.remaps += 1

    def _release(self) -> None:
        self._finish_last_copy()
        self._peers = [None] * self.world_size
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank dropped its mappings before any owner frees its buffer
        self._buffer = None
        self._capacity = [0] * self.world_size
