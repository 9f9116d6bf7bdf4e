"""The host backend on a GPU: the host relay's CUDA path is correct, launches no kernel, and its copies run on a
stream of their own, overlapping compute. Rank 0 holds the GPU, rank 1 is a CPU peer (one GPU suffices)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _cuda_or_cpu(rank: int) -> torch.device:
    return torch.device("cuda", 0) if rank == 0 else torch.device("cpu")


def _correct(rank, world_size, name):
    from fscomm import get_transport

    dev = _cuda_or_cpu(rank)
    t = get_transport(name)
    out = []
    for dtype in (torch.bfloat16, torch.int64, torch.float32, torch.bool):
        x = (torch.arange(24).reshape(8, 3) + 100 * rank).to(dtype).to(dev)
        send = [5, 3] if rank == 0 else [0, 8]
        recv = [5, 0] if rank == 0 else [3, 8]
        h1 = t.all_to_all(x, send, recv)
        h2 = t.all_gather(x[: 2 + rank], sizes=[2, 3])
        h3 = t.all_gather(x)
        del x  # the caller may drop its input at once: the copy stream still owns it
        out.append([h.wait().cpu() for h in (h1, h2, h3)])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out, t.pool_stats()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["host-tcp", "host-shm"])
def test_relay_cuda_path_matches_cpu_truth(name):
    results = run_ranks(_correct, 2, args=(name,), timeout=120)
    base = [torch.arange(24).reshape(8, 3) + 100 * r for r in range(2)]
    for i, dtype in enumerate((torch.bfloat16, torch.int64, torch.float32, torch.bool)):
        b = [x.to(dtype) for x in base]
        a2a0, ag0, full0 = results[0][0][i]
        a2a1, ag1, full1 = results[1][0][i]
        assert torch.equal(a2a0, torch.cat([b[0][:5], b[1][:0]]))
        assert torch.equal(a2a1, torch.cat([b[0][5:], b[1][0:8]]))
        assert torch.equal(ag0, torch.cat([b[0][:2], b[1][:3]])) and torch.equal(ag1, ag0)
        assert torch.equal(full0, torch.stack(b)) and torch.equal(full1, full0)
    assert results[0][1]["bytes_in_use"] == 0


def _profiled(rank, world_size):
    from benchmarks.gpu_trace import trace
    from fscomm import get_transport

    dev = _cuda_or_cpu(rank)
    t = get_transport("host-tcp")  # the host relay's path (its pool); the shared-memory path: test_shm_gpu.py
    x = torch.ones(8 << 20, dtype=torch.uint8, device=dev)  # 4 MiB to each rank
    splits = [4 << 20, 4 << 20]

    def exchanges(n):
        hs = [t.all_to_all(x, splits, splits) for _ in range(n)]
        for h in hs:
            h.wait()

    # Four exchanges in flight at most below, each with a work buffer of 16 MiB (what leaves | what arrives).
    # Issuing four is no warm-up: the first may finish before the fourth is issued, leaving three blocks.
    t.relay.pool.reserve(16 << 20, 4)
    exchanges(4)
    warm = t.pool_stats()["allocations"]
    if dev.type != "cuda":
        exchanges(4)
        exchanges(2)
        return None
    alone = trace(lambda: exchanges(4))
    q, k, v = (torch.randn(8, 16, 4096, 128, dtype=torch.bfloat16, device=dev) for _ in range(3))

    side = torch.cuda.Stream()  # the issuing thread's stream, as a loader's would be: not the compute stream

    def overlapped():
        for _ in range(60):  # about 60 ms of attention queued first ...
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.cuda.stream(side):  # ... then exchanges whose copies must run under it
            hs = [t.all_to_all(x, splits, splits) for _ in range(2)]
            for h in hs:
                h.wait()

    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # cuDNN plan built outside the trace
    torch.cuda.synchronize()
    mixed = trace(overlapped)
    return {
        "alone": alone.summary(),
        "mixed": mixed.summary(),
        "compute_streams": sorted(mixed.streams(mixed.kernels)),
        "allocations_after_warmup": t.pool_stats()["allocations"] - warm,
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_backend_launches_no_kernel_and_copies_overlap_compute():
    out = run_ranks(_profiled, 2, timeout=180)[0]
    print(out)
    alone, mixed = out["alone"], out["mixed"]
    assert alone["kernels"] == 0, alone  # SM-free: nothing but copies
    assert alone["memcpys"] >= 8, alone  # a D2H and an H2D per exchange
    kinds = " ".join(alone["memcpy_kinds"])
    assert "DtoH" in kinds and "HtoD" in kinds and "Pageable" not in kinds, alone  # pinned both ways
    assert not set(mixed["memcpy_streams"]) & set(out["compute_streams"]), mixed  # a stream of their own
    assert mixed["copy_overlap_with_kernels"] > 0.5, mixed  # they run under the attention kernels
    assert out["allocations_after_warmup"] == 0
