"""The host-relayed, SM-free transport (the default), with two paths: shared memory and gloo TCP.

Between ranks of one host the exchange goes through shared memory (fscomm/shm.py): no socket, and on a GPU rank
no host copy either. Across hosts it goes over gloo (TCP), as described below. ``get_transport("host")`` picks per
pair of ranks, by the hosts gathered once when the transport is made: every rank on this host, shared memory
throughout; ranks on several hosts with two or more on some host, each exchange split (shared memory between the
ranks of a host, gloo point-to-point between hosts); no two ranks on one host, gloo's collectives throughout.
``active_path`` ("shm", "shm+tcp", "tcp") and ``pairs`` say which, and ``host_paths()`` for every live transport
(the run summary's ``transport``). "host-shm" and "host-tcp" force one path (a benchmark compares both).

On CUDA tensors an exchange is: a device-to-host copy into a pinned relay buffer on a dedicated copy stream
(the copy engines do it, no SM), the exchange between hosts on the CPU over gloo in fscomm's worker thread,
and a host-to-device copy back on the copy stream. No GPU kernel is launched, so compute that the exchange
overlaps keeps every SM (paper section 3.3: NCCL's channels each occupy an SM and slowed the overlapped
kernels by about 10%). The call returns a handle at once; ``wait()`` only makes the caller's stream wait on the
copy-back event, so the host does not block on the GPU.

On CPU tensors it is plain gloo (async). Every dtype travels as its bytes, so bf16, bool and int64 all work
without conversion kernels. all_gather with unequal sizes pads each rank's rows to the largest (gloo gathers
equal blocks) and drops the padding on the way back.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.host_relay import HostRelay
from fscomm.pinned_pool import PinnedPool
from fscomm.shm import ShmExchange
from fscomm.transport import (
    Handle,
    Splits,
    TransportBase,
    WorkHandle,
    as_bytes,
    check_all_gather,
    prepare_all_to_all,
    row_bytes,
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def unpad_blocks(recv: torch.Tensor, sizes: Sequence[int], row_bytes: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` filled with the first ``sizes[r]`` rows (``row_bytes`` each) of each of the W equal blocks of the
    byte buffer ``recv``, back to back: one row gather, not a copy per rank (CPU tensors;
    ``python -m benchmarks host``)."""
    counts = np.asarray(sizes, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return out
    block_rows = recv.numel() // (counts.size * row_bytes)
    # out row j of rank r's part is row (r * block_rows + j - first out row of rank r) of recv
    rows = np.arange(total) + np.repeat(np.arange(counts.size) * block_rows - (np.cumsum(counts) - counts), counts)
    torch.index_select(recv.view(-1, row_bytes), 0, torch.from_numpy(rows), out=as_bytes(out).view(total, row_bytes))
    return out


class HostTransport(TransportBase):
    name = "host"
    group_backend = "gloo"
    path = "auto"  # shm between ranks of one host, else tcp

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return None if dist.is_gloo_available() else "this torch was built without gloo"

    def __init__(self, group: dist.ProcessGroup, pool: Optional[PinnedPool] = None, relay_cpu: bool = False):
        """relay_cpu: send CPU tensors through the host relay's gloo path (work buffer, worker thread) instead of
        plain async gloo: the CUDA path's buffer layouts then run in CPU tests (it implies the tcp path).

        Collective: every rank of ``group`` makes its transport at the same point (the locality check)."""
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"host transport: needs a gloo group (the exchange runs on the CPU), got a {backend!r} group"
            )
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.relay = HostRelay(pool)
        self.relay_cpu = relay_cpu
        self.shm: Optional[ShmExchange] = None
        if self.path == "shm" and relay_cpu:
            raise ValueError(
                "host transport: relay_cpu runs the host relay's gloo path; it cannot be combined with 'host-shm'"
            )
        if self.path != "tcp" and not relay_cpu:
            self.shm = ShmExchange.connect(group, required=self.path == "shm", split=self.path == "auto")
        pairs = self.world_size * (self.world_size - 1) // 2
        self.pairs = self.shm.pairs() if self.shm is not None else {"shm_pairs": 0, "tcp_pairs": pairs}
        self.active_path = "tcp" if self.shm is None else "shm+tcp" if self.shm.remote else "shm"
        _made.add(self)

    closed = False

    def close(self) -> None:
        """Releases the shared-memory segments now (peers still waiting on this rank fail at once)."""
        self.closed = True
        if self.shm is not None:
            self.shm.close()

    def pool_stats(self) -> dict[str, int]:
        """The pinned relay pool's counters (``allocations`` stays flat after warm-up). On the shared-memory
        path, ``allocations`` counts this rank's data segments instead (each growth maps, and on a GPU rank
        pins, a new one: a stall like a pinned allocation's) and ``shm_bytes`` is the current one's size."""
        stats = self.relay.pool.stats()
        if self.shm is not None:
            stats["allocations"] += self.shm.allocations
            stats["shm_bytes"] = self.shm.capacity()
        return stats

    # --- public collectives ---------------------------------------------------------------------------

    def all_to_all(
        self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, *, keep_host: bool = False
    ) -> Handle:
        """``keep_host``: the received bytes stay readable on the host too (``handle.host()``, no device sync)."""
        state = groups.claim(self.group, "all_to_all")
        x, out, send_b, recv_b = prepare_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        seq = state.take_seq()
        if self.shm is not None:
            return self.shm.all_to_all("all_to_all", seq, x, out, send_b, recv_b, keep_host)

        def exchange(send_view: torch.Tensor, recv_view: torch.Tensor, async_op: bool):
            return dist.all_to_all_single(recv_view, send_view, recv_b, send_b, group=self.group, async_op=async_op)

        if not x.is_cuda and not self.relay_cpu:
            work = exchange(as_bytes(x), as_bytes(out), True)
            return WorkHandle(work, lambda: out, state, "all_to_all", seq, keep=(x,))
        n_in, n_out = sum(send_b), sum(recv_b)  # work buffer: [what leaves | what arrives]
        return self.relay.run(
            state,
            "all_to_all",
            seq,
            x,
            out,
            n_in + n_out,
            copy_out=lambda w: [(as_bytes(x), w[:n_in])],
            exchange=lambda w: exchange(w[:n_in], w[n_in:], False),
            copy_back=lambda w, res: [(w[n_in:], as_bytes(res))],
            keep_host=keep_host,
        )

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        x = tensor.contiguous()
        W = self.world_size
        seq = state.take_seq()
        if sizes_l is None:
            out = torch.empty((W, *x.shape), dtype=x.dtype, device=x.device)
            block, pieces = x.numel() * x.element_size(), None
        else:
            rb = row_bytes(x)
            block = max(sizes_l) * rb  # gloo gathers equal blocks: pad every rank's rows to the largest
            out = torch.empty((sum(sizes_l), *x.shape[1:]), dtype=x.dtype, device=x.device)
            starts = [0]
            for s in sizes_l:
                starts.append(starts[-1] + s * rb)
            pieces = [
                (slice(r * block, r * block + sizes_l[r] * rb), slice(starts[r], starts[r + 1])) for r in range(W)
            ]
        if self.shm is not None:
            xb = x.numel() * x.element_size()
            where = [slice(r * xb, (r + 1) * xb) for r in range(W)] if pieces is None else [dst for _, dst in pieces]
            return self.shm.all_gather("all_gather", seq, x, out, where)

        def exchange(send_view: torch.Tensor, recv_view: torch.Tensor, async_op: bool):
            return _all_gather_single(recv_view, send_view, group=self.group, async_op=async_op)

        if not x.is_cuda and not self.relay_cpu:
            if pieces is None:
                work = exchange(as_bytes(x), as_bytes(out), True)
                return WorkHandle(work, lambda: out, state, "all_gather", seq, keep=(x,))
            send = torch.zeros(block, dtype=torch.uint8)
            send[: x.numel() * x.element_size()] = as_bytes(x)
            recv = torch.empty(W * block, dtype=torch.uint8)
            work = exchange(send, recv, True)
            return WorkHandle(
                work, lambda: unpad_blocks(recv, sizes_l, rb, out), state, "all_gather", seq, keep=(send, recv)
            )

        xb = x.numel() * x.element_size()  # work buffer: [own block | W blocks]
        if pieces is None:
            back = lambda w, res: [(w[block:], as_bytes(res))]
        else:
            back = lambda w, res: [(w[block:][src], as_bytes(res)[dst]) for src, dst in pieces if dst.stop > dst.start]
        return self.relay.run(
            state,
            "all_gather",
            seq,
            x,
            out,
            block + W * block,
            copy_out=lambda w: [(as_bytes(x), w[:xb])],
            exchange=lambda w: exchange(w[:block], w[block:], False),
            copy_back=back,
        )


_made: "weakref.WeakSet[HostTransport]" = weakref.WeakSet()


def host_paths() -> dict[str, dict]:
    """The path of every live host transport of this process, by its group's name: ``path`` ("shm", "shm+tcp",
    "tcp"), ``shm_pairs`` and ``tcp_pairs`` (the group's pairs of ranks, on one host and across hosts)."""
    return {
        t.state.name: {"path": t.active_path, **t.pairs}
        for t in sorted(list(_made), key=lambda t: t.state.name)
        if not t.closed
    }


class ShmHostTransport(HostTransport):
    """The host transport forced onto shared memory: refused unless every rank of the group is on this host."""

    name = "host-shm"
    path = "shm"


class TcpHostTransport(HostTransport):
    """The host transport forced onto gloo (TCP), even between ranks of one host."""

    name = "host-tcp"
    path = "tcp"
