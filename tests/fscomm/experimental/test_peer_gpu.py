"""The peer transport on a GPU: two ranks share GPU 0 (CUDA IPC maps a buffer into another process on the same
device as well as on another device), their results match gloo's all_to_all, the profiler sees copies and no
kernel, and a buffer grows, then stays."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def _splits(step: int, world_size: int) -> torch.Tensor:
    """split[src, dst] rows of op ``step``, with zeros, identical on every rank."""
    g = torch.Generator().manual_seed(step)
    s = torch.randint(0, 6, (world_size, world_size), generator=g)
    s[(torch.arange(world_size)[:, None] + torch.arange(world_size) + step) % 3 == 0] = 0
    return s


def _payload(rank: int, step: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(-50, 50, (rows, 3), generator=g)
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _against_gloo(rank, world_size):
    import torch.distributed as dist

    from fscomm.experimental.peer import PeerTransport

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    t = PeerTransport(dist.new_group(backend="gloo"))
    cases, handles = [], []
    # fixed splits in three exchanges: every buffer is made at the first, grows at the bf16 ones (1.2 and 2.4 MB)
    fixed = {0: 10, 5: 200_000, 9: 400_000}
    for step in range(12):
        dtype = DTYPES[step % len(DTYPES)]
        s = _splits(step, world_size) if step not in fixed else torch.full((world_size, world_size), fixed[step])
        x = _payload(rank, step, int(s[rank].sum()), dtype)
        handles.append(t.all_to_all(x.to(dev), s[rank].tolist(), s[:, rank].tolist()))
        cases.append((x, s, dtype))
    mismatches = []
    for h, (x, s, dtype) in zip(handles, cases):
        got = h.wait().cpu()
        want = torch.empty((int(s[:, rank].sum()), 3), dtype=dtype)
        row = 3 * x.element_size()  # gloo moves the bytes: it lacks bf16 and bool
        dist.all_to_all_single(
            want.view(torch.uint8).reshape(-1),
            x.view(torch.uint8).reshape(-1),
            (s[:, rank] * row).tolist(),
            (s[rank] * row).tolist(),
        )
        mismatches.append(not torch.equal(got, want))
    remaps_after_issue = t.buffer_stats()["remaps"]
    # all_gather: equal shapes, then per-rank sizes
    y = torch.full((2, 4), float(rank), device=dev)
    gathered = t.all_gather(y).wait().cpu()
    z = torch.arange(3 * (rank + 1), dtype=torch.int32, device=dev).reshape(rank + 1, 3)
    varied = t.all_gather(z, sizes=[r + 1 for r in range(world_size)]).wait().cpu()
    # a mismatch between a sender and a receiver: the same error everywhere, and the transport stays usable
    bad = [2, 2] if rank == 0 else [1, 2]
    try:
        t.all_to_all(torch.zeros(4, device=dev), [2, 2], bad).wait()
        mismatch_error = None
    except ValueError as exc:
        mismatch_error = str(exc)
    after = t.all_to_all(torch.full((2,), rank, device=dev), [1, 1], [1, 1]).wait().cpu()
    stats = t.buffer_stats()
    t.close()
    try:
        t.all_to_all(torch.zeros(2, device=dev), [1, 1], [1, 1])
        closed_error = None
    except RuntimeError as exc:
        closed_error = str(exc)
    return mismatches, remaps_after_issue, stats, gathered, varied, mismatch_error, after, closed_error


def test_all_to_all_matches_gloo_and_all_gather_is_right():
    results = run_ranks(_against_gloo, 2, timeout=180)
    for rank, (mismatches, remaps, stats, gathered, varied, mismatch_error, after, closed_error) in enumerate(results):
        assert not any(mismatches), mismatches
        assert remaps == 3 and stats["remaps"] == remaps, stats  # 1 MiB, then 2 and 4 MiB with the big ones
        assert stats["capacity_bytes"] == 4 << 20 and stats["exchanges"] == 12 + 2 + 1, stats
        assert torch.equal(gathered, torch.stack([torch.full((2, 4), float(r)) for r in range(2)]))
        assert torch.equal(
            varied, torch.cat([torch.arange(3 * (r + 1), dtype=torch.int32).reshape(r + 1, 3) for r in range(2)])
        )
        assert "rank 1 expects 4 bytes from rank 0, which sends 8" in mismatch_error, mismatch_error
        assert torch.equal(after, torch.tensor([0.0, 1.0]))
        assert closed_error is not None and "closed" in closed_error


def _profiled(rank, world_size):
    import torch.distributed as dist

    from benchmarks.gpu_trace import trace
    from fscomm.experimental.peer import PeerTransport

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    t = PeerTransport(dist.new_group(backend="gloo"))
    x = torch.ones(8 << 20, dtype=torch.uint8, device=dev)  # 4 MiB to each rank
    splits = [4 << 20, 4 << 20]

    def exchanges(n):
        hs = [t.all_to_all(x, splits, splits) for _ in range(n)]
        for h in hs:
            h.wait()

    exchanges(2)  # buffers mapped outside the trace
    torch.cuda.synchronize()
    act = trace(lambda: exchanges(4))
    t.close()
    return act.summary()


def test_peer_transport_launches_no_kernel():
    for summary in run_ranks(_profiled, 2, timeout=180):
        print(summary)
        assert summary["kernels"] == 0, summary
        assert summary["memcpys"] >= 12, summary  # per exchange: a push, the own piece, the copy out
        assert all("DtoD" in k for k in summary["memcpy_kinds"]), summary
        assert len(summary["memcpy_streams"]) <= 2, summary  # the transport's copy streams, one per destination
