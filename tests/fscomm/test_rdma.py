"""The RDMA transport end to end (RdmaTransport's all_to_all and all_gather, the host relay and handles included) on the
in-memory fake queue pair, and the parts of the verbs link that run without a device."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fscomm.pinned_pool import PinnedPool
from fscomm.rdma import RdmaTransport, queue_depth, wait_completions
from tests.fscomm.fake_qp import FakeRing


def _rows(src: int, dst: int, n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * src + dst)
    return torch.randn(n, 3, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_rdma_transport_end_to_end_on_the_fake_link(world_size):
    ring = FakeRing(world_size)
    W = world_size
    splits = [[(3 * s + 2 * d + 1) % 5 for d in range(W)] for s in range(W)]  # uneven, with zeros

    def rank_fn(rank, link):
        t = RdmaTransport(
            SimpleNamespace(group_desc=f"fake-rdma-{rank}"),
            pool=PinnedPool(pin=False),
            link=link,
            rank=rank,
            world_size=W,
        )
        out = []
        for step in range(3):
            x = torch.cat([_rows(rank, d, splits[rank][d], step) for d in range(W)])
            h = t.all_to_all(x, splits[rank], [splits[s][rank] for s in range(W)], keep_host=step == 1)
            g1 = t.all_gather(x[:2])
            g2 = t.all_gather(x[: rank % 2 + 1], sizes=[r % 2 + 1 for r in range(W)])
            out.append((h.wait(), h.host(), g1.wait(), g2.wait()))
        return out, t.pool_stats()

    results = ring.run(rank_fn, timeout_s=60)
    for rank, (out, stats) in enumerate(results):
        for step, (a2a, host, g1, g2) in enumerate(out):
            xs = [torch.cat([_rows(s, d, splits[s][d], step) for d in range(W)]) for s in range(W)]
            assert torch.equal(a2a, torch.cat([_rows(s, rank, splits[s][rank], step) for s in range(W)]))
            assert torch.equal(host, a2a)
            assert torch.equal(g1, torch.stack([x[:2] for x in xs]))
            assert torch.equal(g2, torch.cat([x[: s % 2 + 1] for s, x in enumerate(xs)]))
        assert stats["bytes_in_use"] == 0  # every relay block went back to the pool


def test_world_sizes_beyond_the_devices_queues_are_refused_and_others_sized_to_fit():
    assert queue_depth(8, 16384, 4194303) == 64
    assert queue_depth(300, 16384, 4194303) == 299  # every receive of an exchange is posted up front
    with pytest.raises(ValueError, match="300 ranks need 299 receives"):
        queue_depth(300, 256, 4194303)


def test_completions_are_awaited_with_sleeps_and_never_over_consumed():
    arrived = []  # (ok, byte_len, status) per completion, appended by a "device" thread later
    polls = []

    def poll_recv(n):
        polls.append(n)
        got, arrived[:] = arrived[:n], arrived[n:]
        return got

    def device():
        time.sleep(0.3)
        arrived.extend([(True, 5, 0), (True, 7, 0)])  # two receives; the second belongs to a later wait

    threading.Thread(target=device).start()
    cpu0 = time.process_time()
    got = wait_completions(lambda n: [], poll_recv, 0, 1, timeout_s=5)
    assert got == [5] and arrived == [(True, 7, 0)]  # the later step's completion stays queued
    assert max(polls) == 1
    assert time.process_time() - cpu0 < 0.2  # asleep between empty polls, not spinning
    with pytest.raises(TimeoutError, match="1 receive"):
        wait_completions(lambda n: [], lambda n: [], 0, 1, timeout_s=0.2)


def test_connect_gives_pyverbs_a_gid_object():
    pytest.importorskip("pyverbs")
    from fscomm.rdma import global_route

    gid = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    route = global_route(gid, 3)
    assert str(route.dgid) == gid and route.sgid_index == 3  # GlobalRoute(dgid=<str>) raises TypeError
