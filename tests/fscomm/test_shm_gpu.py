"""The shared-memory host path on a GPU: results equal the CPU truth, the segments are pinned, no kernel is
launched. Two layouts on one GPU: a GPU rank with a CPU peer, and two ranks sharing the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _payload(src: int, dst: int, step: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * src + dst)
    x = torch.randint(-50, 50, (rows, 3), generator=g)
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _exchanges(rank, world_size, devices):
    from benchmarks.gpu_trace import trace
    from fscomm import get_transport

    dev = torch.device(devices[rank])
    t = get_transport("host")
    t.shm.host_copy_on_cpu = True  # on CPU ranks too: the GPU rank's keep_host layout (own block via the segment)
    checks = []

    def run():
        for step, dtype in enumerate((torch.bfloat16, torch.int64, torch.float32, torch.bool)):
            rows = [
                [(step + 2 * s + d) % 4 * (50 if step == 2 else 1) for d in range(world_size)]
                for s in range(world_size)
            ]
            x = torch.cat([_payload(rank, d, step, rows[rank][d], dtype) for d in range(world_size)]).to(dev)
            h1 = t.all_to_all(x, rows[rank], [rows[s][rank] for s in range(world_size)], keep_host=step % 2 == 0)
            y = _payload(rank, 99, step, 2 + rank, dtype).to(dev)
            h2 = t.all_gather(y, sizes=[2 + r for r in range(world_size)])
            h3 = t.all_gather(y[:2])
            del x, y  # the caller may drop its inputs at once
            want1 = torch.cat([_payload(s, rank, step, rows[s][rank], dtype) for s in range(world_size)])
            got1 = h1.wait()
            host = h1.host() if step % 2 == 0 else None
            checks.append(torch.equal(got1.cpu(), want1) and (host is None or torch.equal(host, want1)))
            ys = [_payload(s, 99, step, 2 + s, dtype) for s in range(world_size)]
            checks.append(torch.equal(h2.wait().cpu(), torch.cat(ys)))
            checks.append(torch.equal(h3.wait().cpu(), torch.stack([y[:2] for y in ys])))
        if dev.type == "cuda":
            torch.cuda.synchronize()

    run()  # warm: segments grown and pinned
    activity = None
    if dev.type == "cuda":
        activity = trace(run).summary()
    elif "cuda" in devices:  # a CPU peer of a GPU rank takes part in its traced round
        run()
    pinned = t.shm._data[rank].tensor.is_pinned() if dev.type == "cuda" else None
    return t.active_path, all(checks), len(checks), activity, pinned


def _check(results, devices):
    for rank, (path, ok, n, activity, pinned) in enumerate(results):
        assert path == "shm" and ok and n == (24 if "cuda" in devices else 12), (rank, path, ok, n)
        if devices[rank] == "cuda":
            assert pinned
            assert activity["kernels"] == 0, activity  # copies only: the copy engines, no SM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("devices", [("cuda", "cpu"), ("cuda", "cuda")])
def test_shared_memory_path_on_a_gpu_is_exact_and_launches_no_kernel(devices):
    _check(run_ranks(_exchanges, 2, args=(devices,), timeout=180), devices)


def test_the_same_exchanges_on_cpu_ranks():
    results = run_ranks(_exchanges, 2, args=(("cpu", "cpu"),), timeout=120)
    for path, ok, n, _, _ in results:
        assert path == "shm" and ok and n == 12
