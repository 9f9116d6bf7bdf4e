"""The RDMA transport: the paper's SM-free ring (Figure 6) over RC queue pairs, with pyverbs.

Each exchange: device-to-host copy into a pinned buffer (copy stream), the ring between host buffers over
RDMA send/receive (fscomm/ring.py: the send order), host-to-device copy back. Pinned pool blocks are registered
as memory regions once and reused. Queue-pair details (LID, GID, QP numbers, PSNs) are exchanged through the
torch.distributed store. The ring code runs against ``RingLink``; ``VerbsRingLink`` is the real one, and the
tests drive the whole transport through an in-memory fake queue pair (tests/fscomm/fake_qp.py). It has not run on
a real NIC: no machine it was built on has a verbs device.

Queue depth: every receive of an exchange is posted up front (W-1 ring steps), so the receive queue and its
completion queue are sized to the world size (at least ``QUEUE_DEPTH``), and a world size beyond what the
device allows is refused when the link is made. Completions are awaited by polling with short sleeps between
empty polls (the GIL is released while asleep), never by a busy loop.
"""

from __future__ import annotations

import json
import random
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.host_relay import HostRelay
from fscomm.pinned_pool import PinnedPool
from fscomm.ring import (
    AllToAllPlan,
    RingError,
    RingLink,
    all_to_all_plan,
    exchange_rows,
    ring_all_gather,
    ring_all_to_all,
)
from fscomm.transport import (
    Handle,
    Splits,
    TransportBase,
    TransportUnavailableError,
    as_bytes,
    check_all_gather,
    prepare_all_to_all,
    row_bytes,
)

QUEUE_DEPTH = 64  # the smallest queues made; larger worlds get W-1
_SLEEP_MIN_S, _SLEEP_MAX_S = 2e-5, 2e-4


def queue_depth(world_size: int, max_qp_wr: int, max_cqe: int) -> int:
    """Work requests each queue must hold for one exchange on ``world_size`` ranks (all receives are posted
    up front), or a ValueError when the device's limits are below it."""
    need = max(QUEUE_DEPTH, world_size - 1)
    if need > max_qp_wr or need > max_cqe:
        raise ValueError(
            f"transport 'rdma': {world_size} ranks need {need} receives posted at once, but the device "
            f"allows {max_qp_wr} work requests per queue and {max_cqe} completions per queue"
        )
    return need


def global_route(peer_gid: str, gid_index: int):
    """The route to a peer: pyverbs takes the destination GID as a ``GID`` object, not as its string."""
    from pyverbs.addr import GID, GlobalRoute

    return GlobalRoute(dgid=GID(peer_gid), sgid_index=gid_index)


def wait_completions(poll_send, poll_recv, sends: int, recvs: int, timeout_s: float) -> list[int]:
    """Waits for ``sends`` send and ``recvs`` receive completions; returns the received byte counts.

    ``poll_*(n)`` returns a list of (ok, byte_len, status) of at most ``n`` completions ready now (never more:
    a later step's receive must stay in the queue for its own wait). Between empty polls it
    sleeps (20 to 200 microseconds, doubling), so a waiting thread neither holds the GIL nor a core."""
    deadline = time.monotonic() + timeout_s
    delay = _SLEEP_MIN_S
    got: list[int] = []
    while sends or recvs:
        progressed = False
        for is_recv, poll in ((False, poll_send), (True, poll_recv)):
            want = recvs if is_recv else sends
            if want == 0:
                continue
            for ok, byte_len, status in poll(want):
                progressed = True
                if not ok:
                    side = "from the left neighbour" if is_recv else "to the right neighbour"
                    raise RingError(f"rdma: work completion {side} failed with status {status}")
                if is_recv:
                    recvs -= 1
                    got.append(byte_len)
                else:
                    sends -= 1
        if not (sends or recvs):
            break
        if progressed:
            delay = _SLEEP_MIN_S
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rdma ring: timed out after {timeout_s:.1f} s waiting for "
                f"{recvs} receive(s) from the left neighbour and {sends} send(s) to the right"
            )
        time.sleep(delay)
        delay = min(2 * delay, _SLEEP_MAX_S)
    return got


def verbs_unavailable_reason() -> Optional[str]:
    try:
        from pyverbs.device import get_device_list
    except Exception as exc:  # ImportError, or a missing libibverbs
        return f"pyverbs cannot be imported ({exc}); install the 'rdma' extra (pyverbs==56.0rc1)"
    try:
        devices = get_device_list()
    except Exception as exc:
        return f"no verbs device (ibv_get_device_list failed: {exc})"
    if not devices:
        return "no verbs device (ibv_get_device_list returned none)"
    return None


# --- the buffer handling of one exchange, on any RingLink ------------------------------------------------


def ring_all_gather_bytes(
    link: RingLink,
    pool: PinnedPool,
    register,
    own: torch.Tensor,
    out: torch.Tensor,
    sizes_b: Sequence[int],
    rank: int,
    world_size: int,
    timeout_s: float,
) -> None:
    """Gathers byte chunks (sizes_b[r] from rank r, ``own`` here) into ``out`` in rank order."""
    offsets = [0]
    for n in sizes_b:
        offsets.append(offsets[-1] + n)
    scratch = pool.acquire(offsets[-1])
    register(scratch.block)
    try:
        scratch.view[offsets[rank] : offsets[rank + 1]].copy_(own)
        ring_all_gather(link, scratch.view, offsets, rank, world_size, timeout_s)
        out.copy_(scratch.view)
    finally:
        pool.release(scratch)


def ring_all_to_all_bytes(
    link: RingLink,
    pool: PinnedPool,
    register,
    send: torch.Tensor,
    out: torch.Tensor,
    send_b: Sequence[int],
    recv_b: Sequence[int],
    rank: int,
    world_size: int,
    timeout_s: float,
) -> None:
    """``send`` holds this rank's blocks in destination order (send_b bytes each); ``out`` receives the blocks
    for this rank in origin order (recv_b bytes each). The split matrix goes round the ring first."""
    W = world_size
    meta = pool.acquire(8 * W * W)
    register(meta.block)
    try:
        matrix = exchange_rows(link, meta.block, send_b, rank, W, timeout_s)
    finally:
        pool.release(meta)
    column = [matrix[o][rank] for o in range(W)]
    if column != list(recv_b):
        bad = [o for o in range(W) if column[o] != recv_b[o]]
        raise ValueError(
            f"fscomm rdma all_to_all on rank {rank}: recv_splits disagree with what rank(s) {bad} send "
            f"(bytes expected {list(recv_b)}, sent {column})"
        )
    plan: AllToAllPlan = all_to_all_plan(rank, W, matrix)
    scratch = pool.acquire(plan.scratch_bytes)
    register(scratch.block)
    try:
        s_off = [0]
        for n in send_b:
            s_off.append(s_off[-1] + n)
        for d, area in plan.send_area.items():
            scratch.view[area].copy_(send[s_off[d] : s_off[d + 1]])
        ring_all_to_all(link, scratch.view, plan, rank, W, timeout_s)
        o_off = [0]
        for n in recv_b:
            o_off.append(o_off[-1] + n)
        out[o_off[rank] : o_off[rank + 1]].copy_(send[s_off[rank] : s_off[rank + 1]])
        for o, piece in plan.mine.items():
            out[o_off[o] : o_off[o + 1]].copy_(scratch.view[piece])
    finally:
        pool.release(scratch)


# --- the real queue pairs ------------------------------------------------------------------------------


class VerbsRingLink:
    """Two RC queue pairs: one to the right neighbour (sends), one from the left (receives)."""

    def __init__(
        self,
        store,
        prefix: str,
        rank: int,
        world_size: int,
        device: Optional[str] = None,
        port: int = 1,
        gid_index: int = 0,
    ):
        from pyverbs import enums as e
        from pyverbs.addr import AHAttr
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self._e = e
        name = device or get_device_list()[0].name.decode()
        self.ctx = Context(name=name)
        attr = self.ctx.query_device()
        try:
            depth = queue_depth(world_size, attr.max_qp_wr, attr.max_cqe)
        except ValueError as exc:
            raise TransportUnavailableError(str(exc)) from exc
        self.pd = PD(self.ctx)
        self.send_cq = CQ(self.ctx, depth)
        self.recv_cq = CQ(self.ctx, depth)
        cap_r = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        cap_l = QPCap(max_send_wr=1, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        init = lambda cq, cap: QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        self.qp_right = QP(self.pd, init(self.send_cq, cap_r), QPAttr(port_num=port))
        self.qp_left = QP(self.pd, init(self.recv_cq, cap_l), QPAttr(port_num=port))
        port_attr = self.ctx.query_port(port)
        gid = self.ctx.query_gid(port, gid_index)
        me = {
            "lid": port_attr.lid,
            "gid": str(gid),
            "right_qpn": self.qp_right.qp_num,
            "left_qpn": self.qp_left.qp_num,
            "psn": random.randrange(1 << 24),
        }
        store.set(f"{prefix}/{rank}", json.dumps(me))
        right = json.loads(store.get(f"{prefix}/{(rank + 1) % world_size}"))
        left = json.loads(store.get(f"{prefix}/{(rank - 1) % world_size}"))
        mtu = port_attr.active_mtu

        def connect(qp, peer: dict, peer_qpn: int, peer_psn: int) -> None:
            attr = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT, port_num=port)
            attr.path_mtu = mtu
            attr.dest_qp_num = peer_qpn
            attr.rq_psn = peer_psn
            attr.sq_psn = me["psn"]
            attr.max_dest_rd_atomic = 1
            attr.max_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7  # a receive not yet posted is retried, not an error
            attr.ah_attr = AHAttr(dlid=peer["lid"], port_num=port, is_global=1, gr=global_route(peer["gid"], gid_index))
            qp.to_rts(attr)

        connect(self.qp_right, right, right["left_qpn"], right["psn"])
        connect(self.qp_left, left, left["right_qpn"], left["psn"])
        self._mrs: dict[int, object] = {}
        self._lkeys: list[tuple[int, int, int]] = []

    def register(self, block: torch.Tensor) -> None:
        """Registers a pinned pool block as a memory region (once per block: the pool reuses blocks)."""
        from pyverbs.mr import MR

        ptr = block.data_ptr()
        if ptr not in self._mrs:
            mr = MR(self.pd, block.numel(), self._e.IBV_ACCESS_LOCAL_WRITE, address=ptr)
            self._mrs[ptr] = mr
            self._lkeys.append((ptr, ptr + block.numel(), mr.lkey))

    def _sge(self, view: torch.Tensor):
        from pyverbs.wr import SGE

        ptr = view.data_ptr()
        for lo, hi, lkey in self._lkeys:
            if lo <= ptr and ptr + view.numel() <= hi:
                return [SGE(ptr, view.numel(), lkey)] if view.numel() else []
        raise RingError("rdma: buffer is not inside a registered memory region")

    def post_recv(self, view: torch.Tensor) -> None:
        from pyverbs.wr import RecvWR

        sg = self._sge(view)
        self.qp_left.post_recv(RecvWR(num_sge=len(sg), sg=sg))

    def post_send(self, view: torch.Tensor) -> None:
        from pyverbs.wr import SendWR

        sg = self._sge(view)
        wr = SendWR(opcode=self._e.IBV_WR_SEND, num_sge=len(sg), sg=sg, send_flags=self._e.IBV_SEND_SIGNALED)
        self.qp_right.post_send(wr)

    def wait(self, sends: int, recvs: int, timeout_s: float) -> list[int]:
        return wait_completions(
            lambda n: self._poll(self.send_cq, n), lambda n: self._poll(self.recv_cq, n), sends, recvs, timeout_s
        )

    def _poll(self, cq, most: int) -> list[tuple[bool, int, int]]:
        n, wcs = cq.poll(min(most, 16))
        return [(wc.status == self._e.IBV_WC_SUCCESS, wc.byte_len, wc.status) for wc in wcs[:n]]


# --- the transport -------------------------------------------------------------------------------------


class RdmaTransport(TransportBase):
    name = "rdma"
    group_backend = "gloo"  # the group serves the store, the rank numbering and the thread guard

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return verbs_unavailable_reason()

    def __init__(
        self,
        group: dist.ProcessGroup,
        pool: Optional[PinnedPool] = None,
        link: Optional[RingLink] = None,
        device: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        """``link``: a RingLink to use instead of verbs queue pairs (the tests' fake), with ``rank`` and
        ``world_size`` given when ``group`` is a stand-in rather than a process group."""
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.relay = HostRelay(pool)
        if link is None:
            reason = verbs_unavailable_reason()
            if reason is not None:
                raise TransportUnavailableError(f"transport 'rdma' cannot run on this machine: {reason}")
            store = dist.distributed_c10d._get_default_store()
            link = VerbsRingLink(store, f"fscomm/rdma/{group.group_name}", self.rank, self.world_size, device=device)
        self.link = link
        self._register = getattr(link, "register", lambda block: None)

    def pool_stats(self) -> dict[str, int]:
        return self.relay.pool.stats()

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        x = tensor.contiguous()
        W = self.world_size
        if sizes_l is None:
            out = torch.empty((W, *x.shape), dtype=x.dtype, device=x.device)
            sizes_b = [x.numel() * x.element_size()] * W
        else:
            out = torch.empty((sum(sizes_l), *x.shape[1:]), dtype=x.dtype, device=x.device)
            sizes_b = [s * row_bytes(x) for s in sizes_l]
        n_in, n_out = sizes_b[self.rank], sum(sizes_b)
        pool, timeout = self.relay.pool, self.state.timeout_s
        exchange = lambda w: ring_all_gather_bytes(
            self.link, pool, self._register, w[:n_in], w[n_in:], sizes_b, self.rank, W, timeout
        )
        return self.relay.run(
            state,
            "all_gather",
            state.take_seq(),
            x,
            out,
            n_in + n_out,
            copy_out=lambda w: [(as_bytes(x), w[:n_in])],
            exchange=exchange,
            copy_back=lambda w, res: [(w[n_in:], as_bytes(res))],
        )

    def all_to_all(
        self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, *, keep_host: bool = False
    ) -> Handle:
        state = groups.claim(self.group, "all_to_all")
        x, out, send_b, recv_b = prepare_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        n_in, n_out = sum(send_b), sum(recv_b)
        pool, timeout = self.relay.pool, self.state.timeout_s
        exchange = lambda w: ring_all_to_all_bytes(
            self.link, pool, self._register, w[:n_in], w[n_in:], send_b, recv_b, self.rank, self.world_size, timeout
        )
        return self.relay.run(
            state,
            "all_to_all",
            state.take_seq(),
            x,
            out,
            n_in + n_out,
            copy_out=lambda w: [(as_bytes(x), w[:n_in])],
            exchange=exchange,
            copy_back=lambda w, res: [(w[n_in:], as_bytes(res))],
            keep_host=keep_host,
        )
