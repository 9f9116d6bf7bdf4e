"""The host transport (and the interface every backend shares) on 2 to 4 real gloo ranks on CPU."""

from __future__ import annotations

import datetime
import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess

DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.int32]


def _payload(src: int, dst: int, step: int, rows: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst`` in op ``step``: reproducible on both sides."""
    g = torch.Generator().manual_seed(1000 * step + 10 * src + dst)
    x = torch.randint(-50, 50, (rows, *shape), generator=g)
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _splits(step: int, world_size: int) -> torch.Tensor:
    """split[src, dst] rows for op ``step``: uneven, with zeros (every third pair sends nothing)."""
    g = torch.Generator().manual_seed(step)
    s = torch.randint(0, 7, (world_size, world_size), generator=g)
    s[(torch.arange(world_size)[:, None] + torch.arange(world_size) + step) % 3 == 0] = 0
    return s


def _many_all_to_all(rank, world_size, n_ops, relay_cpu=False):
    from fscomm import get_transport

    t = get_transport("host", relay_cpu=relay_cpu)
    cases = []
    handles = []
    doing("issue")
    for step in range(n_ops):  # everything in flight before the first wait
        dtype = DTYPES[step % len(DTYPES)]
        shape = [(), (3,), (2, 5)][step % 3]
        s = _splits(step, world_size)
        x = torch.cat([_payload(rank, d, step, int(s[rank, d]), shape, dtype) for d in range(world_size)])
        send = s[rank] if step % 2 else s[rank].tolist()  # tensor and list splits
        handles.append(t.all_to_all(x, send, s[:, rank].tolist(), keep_host=step % 3 == 0))
        cases.append((step, s, shape, dtype))
    doing("wait")
    for h, (step, s, shape, dtype) in zip(handles, cases):
        got = h.wait()
        want = torch.cat([_payload(src, rank, step, int(s[src, rank]), shape, dtype) for src in range(world_size)])
        assert got.dtype == dtype and got.shape == want.shape, (step, got.shape, want.shape)
        assert torch.equal(got, want), step
        if step % 3 == 0:  # keep_host: the same result read on the host (the host relay's own copy of the bytes)
            host = h.host()
            assert host.device.type == "cpu" and host.dtype == dtype and torch.equal(host, want), step
        assert h.is_completed() and h.wait_time_s >= 0
    if relay_cpu:  # the same traffic twice more: the pool grows with the ops in flight, not with the ops done
        for _ in range(2):
            again = []
            for step, s, shape, dtype in cases:
                x = torch.cat([_payload(rank, d, step, int(s[rank, d]), shape, dtype) for d in range(world_size)])
                again.append(t.all_to_all(x, s[rank], s[:, rank]))
            for h in again:
                h.wait()
        stats = t.pool_stats()
        assert stats["acquires"] == 3 * n_ops and stats["allocations"] <= n_ops and stats["bytes_in_use"] == 0, stats
    return len(handles)


@pytest.mark.parametrize("world_size,relay_cpu", [(2, False), (3, False), (3, True)])
def test_all_to_all_uneven_zero_splits_many_outstanding(world_size, relay_cpu):
    """relay_cpu runs the work-buffer layout of the CUDA path (copy out, exchange, copy back) on CPU."""
    assert run_ranks(_many_all_to_all, world_size, args=(15, relay_cpu), timeout=60) == [15] * world_size


def _all_gather_cases(rank, world_size, relay_cpu):
    from fscomm import get_transport

    t = get_transport("host", relay_cpu=relay_cpu)
    sizes = [0 if r == 1 else 2 * r + 1 for r in range(world_size)]  # rank 1 contributes nothing
    hs = []
    for dtype in DTYPES:
        x = _payload(rank, 0, 7, 4, (3,), dtype)
        hs.append(("equal", dtype, t.all_gather(x)))
        y = _payload(rank, 0, 8, sizes[rank], (2, 2), dtype)
        hs.append(("sizes", dtype, t.all_gather(y, sizes=sizes)))
    hs.append(("scalar", torch.float32, t.all_gather(torch.tensor(float(rank)))))
    for kind, dtype, h in hs:
        got = h.wait()
        if kind == "equal":
            want = torch.stack([_payload(r, 0, 7, 4, (3,), dtype) for r in range(world_size)])
        elif kind == "sizes":
            want = torch.cat([_payload(r, 0, 8, sizes[r], (2, 2), dtype) for r in range(world_size)])
        else:
            want = torch.arange(world_size, dtype=torch.float32)
        assert got.dtype == want.dtype and torch.equal(got, want), (kind, dtype)
    return True


@pytest.mark.parametrize("relay_cpu", [False, True])
def test_all_gather_equal_and_variable_sizes(relay_cpu):
    assert all(run_ranks(_all_gather_cases, 4, args=(relay_cpu,), timeout=60))


def _large(rank, world_size):
    from fscomm import get_transport

    t = get_transport("host")
    rows = [300_000, 0] if rank == 0 else [1, 250_000]  # about 5 MB of fp32 pairs per big split
    x = torch.full((sum(rows), 4), float(rank), dtype=torch.float32)
    recv = [300_000, 1] if rank == 0 else [0, 250_000]
    got = t.all_to_all(x, rows, recv).wait()
    want = torch.cat([torch.full((recv[s], 4), float(s)) for s in range(world_size)])
    return torch.equal(got, want)


def test_large_splits():
    assert run_ranks(_large, 2, timeout=60) == [True, True]


def _validation(rank, world_size):
    from fscomm import get_transport
    from fscomm.transport import TransportUnavailableError

    t = get_transport("host")
    msgs = []
    for bad in (
        lambda: t.all_to_all(torch.ones(3), [1, 1], [1, 1]),  # splits do not sum to the rows
        lambda: t.all_to_all(torch.ones(2), [1, 1, 0], [1, 1]),  # wrong length
        lambda: t.all_to_all(torch.ones(2), [3, -1], [1, 1]),  # negative
        lambda: t.all_gather(torch.ones(2), sizes=[5, 5]),  # own size wrong
        lambda: get_transport("smoke-signals"),
    ):
        with pytest.raises(ValueError) as info:
            bad()
        msgs.append(str(info.value))
    try:
        get_transport("nccl")
        nccl = "available"
    except TransportUnavailableError as exc:
        nccl = str(exc)
    try:
        get_transport("rdma")
        rdma = "available"
    except TransportUnavailableError as exc:
        rdma = str(exc)
    # the group still works after refused calls: nothing was half-issued
    ok = torch.equal(t.all_gather(torch.tensor([rank])).wait().reshape(-1), torch.arange(world_size))
    return msgs, nccl, rdma, ok


def test_input_errors_are_clear_value_errors():
    msgs, nccl, rdma, ok = run_ranks(_validation, 2, timeout=60)[0]
    assert ok
    assert "send_splits sum to 2 but the tensor has 3 rows" in msgs[0] and "rank 0" in msgs[0]
    assert "3 entries, world size is 2" in msgs[1]
    assert "negative" in msgs[2]
    assert "sizes[0]=5" in msgs[3]
    assert "unknown transport" in msgs[4]
    assert "'nccl' cannot run on this machine: no CUDA device" in nccl
    assert "'rdma' cannot run on this machine: no verbs device" in rdma


def _thread_guard(rank, world_size):
    from fscomm import get_transport, new_thread_group

    t = get_transport("host")
    t.all_gather(torch.ones(1)).wait()  # the main thread now owns fscomm's default group
    loader_group = new_thread_group("loader")  # collective, made at set-up by the main thread
    out = {}

    def loader():
        try:
            t.all_gather(torch.ones(1))
            out["same_group"] = "no error"
        except RuntimeError as exc:
            out["same_group"] = str(exc)
        tl = get_transport("host", loader_group)
        out["own_group"] = tl.all_gather(torch.tensor(rank)).wait().tolist()

    th = threading.Thread(target=loader, name="loader-thread")
    th.start()
    th.join()
    # the loader thread has ended: a new thread (a restarted loader) may take its group over
    th2 = threading.Thread(
        target=lambda: out.__setitem__(
            "takeover", get_transport("host", loader_group).all_gather(torch.tensor(rank)).wait().tolist()
        )
    )
    th2.start()
    th2.join()
    return out


def test_one_thread_per_group():
    out = run_ranks(_thread_guard, 2, timeout=60)[0]
    assert "used by thread 'MainThread'" in out["same_group"] and "loader-thread" in out["same_group"]
    assert "new_thread_group" in out["same_group"]
    assert out["own_group"] == [0, 1] and out["takeover"] == [0, 1]


def _never_joins(rank, world_size, timeout_s):
    from fscomm import CollectiveError, get_transport, new_thread_group

    g = new_thread_group("balancer", timeout=datetime.timedelta(seconds=timeout_s))
    t = get_transport("host", g)
    t.all_gather(torch.ones(2)).wait()
    if rank == world_size - 1:  # alive, but never issues the exchange
        time.sleep(timeout_s + 2)
        return None
    t0 = time.monotonic()
    try:
        t.all_to_all(torch.ones(world_size), [1] * world_size, [1] * world_size).wait()
    except CollectiveError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", 0.0


def test_peer_that_never_joins_times_out_naming_op_and_rank():
    out = run_ranks(_never_joins, 3, args=(3,), timeout=40)
    for msg, took in out[:2]:
        assert "all_to_all #1" in msg and "'balancer'" in msg and "timed out" in msg, msg
        assert "rank(s) [2]" in msg, msg
        assert took < 3 + 3, took


def _dies(rank, world_size, relay_cpu):
    from fscomm import CollectiveError, get_transport, groups, new_thread_group

    g = new_thread_group("ids", timeout=datetime.timedelta(seconds=5))
    t = get_transport("host", g, relay_cpu=relay_cpu)
    t.all_gather(torch.ones(2)).wait()
    if rank == 1:  # its connections close as a crashed process's would; the process stays to report
        groups.forget_all()
        del t
        dist.destroy_process_group(g)
        del g
        gc.collect()
        time.sleep(3)
        return None
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        t.all_gather(torch.ones(2), sizes=[2, 2]).wait()
    except CollectiveError as exc:
        msg, took = str(exc), time.monotonic() - t0
    else:
        return "no error", 0.0, ""
    # A result kept for the host fails the same way from host(), rather than leaving it waiting.
    try:
        t.all_to_all(torch.ones(4), [2, 2], [2, 2], keep_host=True).host()
    except CollectiveError as exc:
        return msg, took, str(exc)
    return msg, took, "no error"


@pytest.mark.parametrize("relay_cpu", [False, True])
def test_peer_that_dies_fails_fast_naming_op_and_rank(relay_cpu):
    msg, took, host_msg = run_ranks(_dies, 2, args=(relay_cpu,), timeout=40)[0]
    assert "all_gather #1" in msg and "rank(s) [1]" in msg, msg
    assert took < 5, took  # a closed connection is seen at once, well before the group timeout
    assert "all_to_all #2" in host_msg and "rank(s) [1]" in host_msg, host_msg


def _skips_group(rank, world_size):
    from fscomm import new_thread_group

    if rank == 1:  # never joins the thread group
        time.sleep(4)
        return None
    t0 = time.monotonic()
    try:
        new_thread_group("embedding", timeout=datetime.timedelta(seconds=2))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", 0.0


def test_peer_that_never_joins_a_thread_group_is_an_error():
    msg, took = run_ranks(_skips_group, 2, timeout=40)[0]
    assert "new_thread_group('embedding') on rank 0 of 2: not every rank joined within 2.0 s" in msg, msg
    assert "rank(s) [1] never called it" in msg, msg
    assert took < 4, took


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=20), st.integers(1, 9))
def test_unpad_blocks_takes_each_ranks_rows_in_rank_order(sizes, row_bytes):
    from fscomm.host import unpad_blocks

    block = max(sizes) * row_bytes
    recv = torch.randint(0, 256, (len(sizes) * block,), dtype=torch.uint8)
    out = torch.empty(sum(sizes) * row_bytes, dtype=torch.uint8)
    want = torch.cat([recv[r * block : r * block + s * row_bytes] for r, s in enumerate(sizes)])
    assert torch.equal(unpad_blocks(recv, sizes, row_bytes, out), want)
