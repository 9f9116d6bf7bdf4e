"""The paper's ring (fscomm/ring.py) and the RDMA backend's buffer handling, on the in-memory fake queue pair;
the real verbs path only where a device exists."""

from __future__ import annotations

import pytest
import torch

from fscomm.pinned_pool import PinnedPool
from fscomm.rdma import ring_all_gather_bytes, ring_all_to_all_bytes, verbs_unavailable_reason
from fscomm.ring import all_gather_steps, all_to_all_plan
from tests.fscomm.fake_qp import FakeRing


def _block(src: int, dst: int, nbytes: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 997 + src * 31 + dst)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ring_all_gather_variable_and_zero_chunks(world_size):
    sizes = [(7 * r + 3) % 11 for r in range(world_size)]  # includes a zero-byte chunk for 5 ranks
    pools = [PinnedPool(pin=False) for _ in range(world_size)]

    def rank_fn(rank, link):
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        for _ in range(3):  # the pool's blocks come back: registered once, reused
            ring_all_gather_bytes(
                link, pools[rank], link.register, _block(rank, 0, sizes[rank]), out, sizes, rank, world_size, 5.0
            )
        return out

    outs = FakeRing(world_size).run(rank_fn)
    want = torch.cat([_block(r, 0, sizes[r]) for r in range(world_size)])
    assert all(torch.equal(o, want) for o in outs)
    assert all(p.stats()["allocations"] <= 1 and p.stats()["acquires"] == 3 for p in pools)


def test_all_gather_schedule_passes_each_chunk_round_the_ring():
    W = 4
    offsets = [0, 1, 2, 3, 4]
    for r in range(W):
        steps = all_gather_steps(r, W, offsets)
        assert steps[0][0] == slice(r, r + 1)  # first its own chunk
        assert sorted(recv.start for _, recv in steps) == sorted(set(range(W)) - {r})  # every other chunk once
        for (send, _), (_, prev_recv) in zip(steps[1:], steps):
            assert send == prev_recv  # forwards what it just received


def _matrix(world_size: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    m = torch.randint(0, 40, (world_size, world_size), generator=g)
    m[torch.rand(world_size, world_size, generator=g) < 0.3] = 0  # zero splits
    return m.tolist()


@pytest.mark.parametrize("world_size,salt", [(2, 1), (3, 2), (4, 3), (5, 4), (5, 5)])
def test_ring_all_to_all_uneven_and_zero_splits(world_size, salt):
    M = _matrix(world_size, salt)
    pools = [PinnedPool(pin=False) for _ in range(world_size)]

    def rank_fn(rank, link):
        outs = []
        for rep in range(2):
            send = torch.cat([_block(rank, d, M[rank][d], salt + rep) for d in range(world_size)])
            out = torch.empty(sum(M[o][rank] for o in range(world_size)), dtype=torch.uint8)
            ring_all_to_all_bytes(
                link,
                pools[rank],
                link.register,
                send,
                out,
                M[rank],
                [M[o][rank] for o in range(world_size)],
                rank,
                world_size,
                5.0,
            )
            outs.append(out)
        return outs

    results = FakeRing(world_size).run(rank_fn)
    for rank, outs in enumerate(results):
        for rep, out in enumerate(outs):
            want = torch.cat([_block(o, rank, M[o][rank], salt + rep) for o in range(world_size)])
            assert torch.equal(out, want), (rank, rep)
    assert all(p.stats()["bytes_in_use"] == 0 for p in pools)


def test_all_to_all_plan_forwards_each_block_its_hop_count():
    W = 4
    M = _matrix(W, 9)
    for r in range(W):
        plan = all_to_all_plan(r, W, M)
        own = sum(M[r][d] for d in range(W) if d != r)
        # a block o->d is received once per hop after the first: hops (d-o) mod W, here counted per receiver
        received = sum(sum(M[o][(o + k) % W] for k in range(s, W)) for s in range(1, W) for o in [(r - s) % W])
        assert plan.scratch_bytes == own + received
        for s, (send, recv, mine) in enumerate(plan.steps, start=1):
            o = (r - s) % W
            assert mine.start == recv.start and mine.stop - mine.start == M[o][r]
            if s > 1:  # zero-copy forwarding: the send is the tail of the previous receive
                prev_recv, prev_mine = plan.steps[s - 2][1], plan.steps[s - 2][2]
                assert send == slice(prev_mine.stop, prev_recv.stop)


def test_silent_peer_times_out_naming_the_neighbour():
    def rank_fn(rank, link):
        out = torch.empty(6, dtype=torch.uint8)
        try:
            ring_all_gather_bytes(
                link,
                PinnedPool(pin=False),
                link.register,
                torch.zeros(2, dtype=torch.uint8),
                out,
                [2, 2, 2],
                rank,
                3,
                0.5,
            )
        except TimeoutError as exc:
            return str(exc)
        return "no error"

    msgs = FakeRing(3, silent=(1,)).run(rank_fn)
    # rank 1's right neighbour sees it first; further round, rank 0 waits on what rank 2 could not forward
    assert "rank 2 got no message from rank 1" in msgs[2]
    assert "rank 0 got no message from rank 2" in msgs[0]


def test_disagreeing_splits_are_a_clear_error():
    def rank_fn(rank, link):
        send = torch.zeros(4, dtype=torch.uint8)
        recv_b = [2, 2] if rank == 0 else [2, 3]  # rank 1 expects 3 bytes from itself, but sends itself 2
        out = torch.empty(sum(recv_b), dtype=torch.uint8)
        try:
            ring_all_to_all_bytes(link, PinnedPool(pin=False), link.register, send, out, [2, 2], recv_b, rank, 2, 0.5)
        except (ValueError, TimeoutError) as exc:
            return str(exc)

    msgs = FakeRing(2).run(rank_fn)
    assert "fscomm rdma all_to_all on rank 1: recv_splits disagree with what rank(s) [1] send" in msgs[1]
    assert "rank 0 got no message from rank 1" in msgs[0]  # rank 0 is left waiting, and says on whom


@pytest.mark.multiprocess
def test_real_verbs_ring():
    reason = verbs_unavailable_reason()
    if reason is not None:
        pytest.skip(f"real RDMA path needs a verbs device: {reason}")
    from tests.harness import run_ranks

    assert run_ranks(_verbs_body, 2, timeout=60) == [True, True]


def _verbs_body(rank, world_size):
    from fscomm import get_transport

    t = get_transport("rdma")
    x = torch.arange(10, dtype=torch.float32) + 100 * rank
    ag = t.all_gather(x, sizes=[10, 10]).wait()
    recv = [3, 3] if rank == 0 else [7, 7]
    a2a = t.all_to_all(x, [3, 7], recv).wait()
    want = torch.cat(
        [torch.arange(10.0)[:3], torch.arange(10.0)[:3] + 100]
        if rank == 0
        else [torch.arange(10.0)[3:], torch.arange(10.0)[3:] + 100]
    )
    return torch.equal(ag, torch.cat([torch.arange(10.0), torch.arange(10.0) + 100])) and torch.equal(a2a, want)
