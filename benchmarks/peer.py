"""`python -m benchmarks peer`: the copy-engine peer transport (fscomm.experimental.peer) measured against plain
copies.

(a) bandwidth: all_to_all with a block of ``--sizes`` bytes to every rank: one exchange alone (median latency)
    and a stream of exchanges, two in flight (GB/s of what leaves each rank: (W - 1) x block per exchange),
    next to a plain device-to-device copy of one block from GPU 0 to GPU 1 (``copy_``: cudaMemcpyAsync, copy
    engines) timed in the same run; ``vs copy`` is their ratio.
(b) kernels: the exchanges of 4 MiB blocks under torch.profiler on every rank: kernels launched (0 expected)
    and the kinds and streams of the copies.
(c) contention: 20 causal SDPA calls (B8 H16 L4096 D128 bf16) or 20 bf16 8192^3 GEMMs on GPU 0, alone and next
    to (peer) a stream of 16 MiB-block exchanges on every rank, or (copies) plain device-to-device copies of
    16 MiB blocks from GPU 0 to GPU 1 on a side stream of the computing process, queued right after the kernel;
    where the ranks share GPU 0, also (copies-other-process) those copies from another process on that GPU,
    which separates the GPU's time-slicing between processes from the copies themselves. Interleaved pairs, the
    median of the per-pair ratios. A pair counts only if the traffic outlasted the kernel on every rank (on the
    host's monotonic clock, or by events within one process); when it did not, the traffic is lengthened.
(d) where the time of an exchange goes: the transport's worker, per exchange and step (fscomm.experimental.peer.PHASES).

Ranks: one GPU each when there are as many GPUs as ranks. With fewer GPUs every rank shares GPU 0 (CUDA IPC maps
buffers between processes on one device too): then every copy is a copy within one GPU's memory, not over
NVLink, the "plain copy" is GPU 0 to GPU 0, and the ranks' copies compete for the same device; the table says so.
Under torchrun it runs as launched; otherwise it starts ``--nproc`` local ranks itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from benchmarks.launch import launch, under_torchrun, write_json
from benchmarks.traffic import (
    KERNELS,
    TRAFFIC_BLOCK,
    ExchangeTraffic,
    contention_kernel,
    contention_row,
    traffic_units,
)

SIZES = [4 << 20, 32 << 20]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block bytes per destination")
    parser.add_argument("--reps", type=int, default=10, help="timed exchanges per bandwidth point")
    parser.add_argument("--pairs", type=int, default=7, help="alone/overlapped pairs per contention point (0: none)")
    parser.add_argument("--kernels", default="sdpa,gemm", help="contention kernels: sdpa, gemm")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON here")


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise ValueError(f"--sizes must be comma-separated byte counts, got {text!r}") from exc
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--sizes must be positive byte counts, got {text!r}")
    return sizes


def check_args(args: argparse.Namespace) -> None:
    parse_sizes(args.sizes)
    if args.reps < 1 or args.pairs < 0:
        raise ValueError(f"--reps must be >= 1 and --pairs >= 0, got {args.reps} and {args.pairs}")
    for k in (k.strip() for k in args.kernels.split(",") if k.strip()):
        if k not in KERNELS:
            raise ValueError(f"unknown kernel {k!r} in --kernels; choose {' or '.join(KERNELS)}")


class Rank:
    def __init__(self, rank: int, world: int):
        from fscomm import new_thread_group
        from fscomm.experimental.peer import PeerTransport

        self.rank, self.world = rank, world
        self.shared = torch.cuda.device_count() < world
        local = int(os.environ.get("LOCAL_RANK", rank))
        self.device = torch.device("cuda", 0 if self.shared else local)
        torch.cuda.set_device(self.device)
        self.peer_device = torch.device("cuda", 0 if self.shared else 1)
        self.main = PeerTransport(new_thread_group("bench-peer-main"))
        self.traffic = PeerTransport(new_thread_group("bench-peer-traffic"))  # driven by a thread of its own

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier()


def bench_bandwidth(r: Rank, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for size in sizes:
        x = torch.empty(size * r.world, dtype=torch.uint8, device=r.device)
        splits = [size] * r.world
        for _ in range(2):
            r.main.all_to_all(x, splits, splits).wait()
        latencies = []
        for _ in range(reps):
            r.barrier()
            t0 = time.perf_counter()
            r.main.all_to_all(x, splits, splits).wait()
            torch.cuda.synchronize(r.device)
            latencies.append(time.perf_counter() - t0)
        r.barrier()
        t0 = time.perf_counter()
        inflight: deque = deque()
        for _ in range(reps):
            inflight.append(r.main.all_to_all(x, splits, splits))
            if len(inflight) >= 2:
                inflight.popleft().wait()
        while inflight:
            inflight.popleft().wait()
        torch.cuda.synchronize(r.device)
        stream_s = (time.perf_counter() - t0) / reps
        slowest = max(_gather(stream_s))
        copy_s = plain_copy_seconds(r, size, reps) if r.rank == 0 else None
        if r.rank == 0:
            off_rank = (r.world - 1) * size
            rows.append(
                {
                    "block_bytes": size,
                    "latency_median_us": 1e6 * statistics.median(latencies),
                    "a2a_s": slowest,
                    "a2a_gb_per_s": off_rank / slowest / 1e9,
                    "copy_gb_per_s": size / copy_s / 1e9,
                    "vs_copy": (off_rank / slowest) / (size / copy_s),
                    # within one GPU: every byte any rank pushes, keeps and copies out goes through that GPU's memory
                    "all_copies_gb_per_s": r.world * (2 * r.world - 1) * size / slowest / 1e9 if r.shared else None,
                }
            )
        r.barrier()
    return rows


def plain_copy_seconds(r: Rank, size: int, reps: int) -> float:
    """One block from this rank's GPU to the peer GPU (or within GPU 0 when shared) with copy_, on a side stream:
    the rate the pushes of the transport can at best reach."""
    src = torch.empty(size, dtype=torch.uint8, device=r.device)
    dst = torch.empty(size, dtype=torch.uint8, device=r.peer_device)
    stream = torch.cuda.Stream(r.device)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def trace_exchanges(r: Rank) -> dict:
    from benchmarks.gpu_trace import trace

    x = torch.empty((4 << 20) * r.world, dtype=torch.uint8, device=r.device)
    splits = [4 << 20] * r.world

    def exchanges() -> None:
        hs = [r.main.all_to_all(x, splits, splits) for _ in range(4)]
        for h in hs:
            h.wait()

    exchanges()
    r.barrier()
    summary = trace(exchanges).summary()
    return {"kernels_per_rank": _gather(summary["kernels"]), "rank0": summary}


# --- contention -------------------------------------------------------------------------------------------


class CopyTraffic:
    """n plain copies of 16 MiB from the rank's GPU to the peer GPU on a side stream, on one rank only: ``who`` 0
    is the computing process itself; ``who`` 1, where the ranks share GPU 0, another process on that GPU (its
    copies then also cost the compute the GPU's time-slicing between processes, as the transport's do)."""

    def __init__(self, r: Rank, who: int):
        self.r, self.who, self.active = r, who, r.rank == who
        self.stream = torch.cuda.Stream(r.device)
        self.src = torch.empty(TRAFFIC_BLOCK, dtype=torch.uint8, device=r.device)
        self.dst = torch.empty(TRAFFIC_BLOCK, dtype=torch.uint8, device=r.peer_device)
        self.after_kernel = who == 0  # queued after the kernel: else the host's queueing gives the copies a head start

    def start(self, n: int) -> "CopyTraffic":
        self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.end_host: Optional[float] = None
        if self.active:
            with torch.cuda.stream(self.stream):
                self.begin.record()
                for _ in range(n):
                    self.dst.copy_(self.src, non_blocking=True)
                self.end.record()
            if self.who != 0:  # another process than the kernel's: its end on the host clock, as the peer traffic's
                self.waiter = threading.Thread(target=self._wait, name="bench-copy-waiter")
                self.waiter.start()
        return self

    def _wait(self) -> None:
        self.end.synchronize()
        self.end_host = time.monotonic()

    def join(self, kernel_end: Optional[float], kernel_end_event=None) -> bool:
        if not self.active:
            return True
        if self.who != 0:
            self.waiter.join()
            return kernel_end is None or self.end_host >= kernel_end
        self.end.synchronize()
        return kernel_end_event is None or kernel_end_event.elapsed_time(self.end) >= 0

    def seconds(self) -> float:
        return self.begin.elapsed_time(self.end) / 1e3 if self.active else 0.0


def _trial(r: Rank, kernel, traffic, n: int) -> tuple[Optional[float], bool]:
    """Every rank starts the traffic (if any); rank 0 runs the kernel: (its seconds, the traffic outlasted it,
    judged on the host's monotonic clock, which all processes of the host share, or by events in one process)."""
    late = traffic is not None and getattr(traffic, "after_kernel", False)
    if traffic is not None and not late:
        traffic.start(n)
    seconds, end_evt, end_host = None, None, None
    if r.rank == 0:
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        kernel()
        end_evt.record()
        if late:
            traffic.start(n)
        end_evt.synchronize()
        end_host = time.monotonic()
        seconds = start_evt.elapsed_time(end_evt) / 1e3
    elif late:
        traffic.start(n)
    outlasted = True
    if traffic is not None:
        kernel_end = _gather(end_host)[0]
        outlasted = traffic.join(kernel_end, end_evt)
    return seconds, outlasted


def traffic_kinds(r: Rank) -> list[tuple[str, object]]:
    kinds = [
        ("peer", ExchangeTraffic(r.traffic, r.world, r.device, "bench-peer-traffic")),
        ("copies", CopyTraffic(r, 0)),
    ]
    if r.shared:
        kinds.append(("copies-other-process", CopyTraffic(r, 1)))
    return kinds


def bench_contention(r: Rank, kernels: list[str], pairs: int) -> list[dict]:
    rows = []
    for kname in kernels:
        kernel = contention_kernel(kname, r.device, "peer") if r.rank == 0 else None
        for _ in range(2):
            _trial(r, kernel, None, 0)
        t_alone = _gather(statistics.median([_trial(r, kernel, None, 0)[0] or 0.0 for _ in range(3)]))[0]
        for kind, traffic in traffic_kinds(r):
            traffic.start(2).join(None)
            r.barrier()
            traffic.start(4).join(None)
            unit = max(_gather(traffic.seconds() / 4))
            n = traffic_units(t_alone, unit)
            ratios, dropped = [], 0
            for p in range(pairs):
                got = {}
                for overlapped in (False, True) if p % 2 == 0 else (True, False):
                    r.barrier()
                    got[overlapped] = _trial(r, kernel, traffic if overlapped else None, n)
                if not all(_gather(got[True][1])):
                    dropped += 1
                    n *= 2
                elif r.rank == 0:
                    ratios.append(got[True][0] / got[False][0])
            if r.rank == 0:
                rows.append(contention_row(kname, kind, t_alone, ratios, dropped, n, unit))
    return rows


def _gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- driver -----------------------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace, rank: int, world: int) -> Optional[dict]:
    r = Rank(rank, world)
    result = {
        "world_size": world,
        "shared_gpu": r.shared,
        "gpu": torch.cuda.get_device_name(r.device),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "bandwidth": bench_bandwidth(r, parse_sizes(args.sizes), args.reps),
        "trace": trace_exchanges(r),
    }
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    result["contention"] = bench_contention(r, kernels, args.pairs) if args.pairs else []
    result["buffers"] = _gather(r.main.buffer_stats())
    result["phase_ms_per_exchange"] = _gather(
        {k: 1e3 * v / max(r.main.exchanges, 1) for k, v in r.main.phase_seconds().items()}
    )
    r.main.close()
    r.traffic.close()
    return result if rank == 0 else None


def print_result(result: dict) -> None:
    where = (
        "ranks SHARE GPU 0: copies within one GPU's memory, not NVLink"
        if result["shared_gpu"]
        else "one GPU per rank: peer copies between GPUs"
    )
    print(
        f"peer transport, {result['world_size']} ranks, {result['gpus']} x {result['gpu']} ({where}), torch "
        f"{result['torch']}"
    )
    copy_label = "copy GPU0->GPU0" if result["shared_gpu"] else "copy GPU0->GPU1"
    print(
        f"{'block MiB':>9} {'a2a lat us':>10} {'a2a GB/s':>9} {copy_label + ' GB/s':>20} {'vs copy':>8} "
        f"{'all copies GB/s':>16}"
    )
    for b in result["bandwidth"]:
        allc = f"{b['all_copies_gb_per_s']:>16.1f}" if b["all_copies_gb_per_s"] is not None else f"{'-':>16}"
        print(
            f"{b['block_bytes'] / 2**20:>9.0f} {b['latency_median_us']:>10.0f} {b['a2a_gb_per_s']:>9.1f} "
            f"{b['copy_gb_per_s']:>20.1f} {b['vs_copy']:>8.2f} {allc}"
        )
    t = result["trace"]
    print(
        f"profiler: kernels per rank {t['kernels_per_rank']}; rank 0 copies {t['rank0']['memcpys']} "
        f"{t['rank0']['memcpy_kinds']} on streams {t['rank0']['memcpy_streams']}"
    )
    if result["contention"]:
        print(
            f"{'kernel':<6} {'traffic':<7} {'alone ms':>9} {'ratio med':>10} {'min':>6} {'max':>6} {'pairs':>6} "
            f"{'dropped':>8}"
        )
        for c in result["contention"]:
            fmt = lambda v: f"{v:.3f}" if v is not None else "-"
            print(
                f"{c['kernel']:<6} {c['traffic']:<7} {c['kernel_alone_ms']:>9.2f} {fmt(c['median_ratio']):>10} "
                f"{fmt(c['min_ratio']):>6} {fmt(c['max_ratio']):>6} {c['pairs']:>6} "
                f"{c['pairs_dropped_traffic_too_short']:>8}"
            )
    print(f"buffers per rank: {result['buffers']}")
    for rank, phases in enumerate(result.get("phase_ms_per_exchange", [])):
        print(
            f"rank {rank}, worker ms per exchange (bandwidth and trace exchanges): "
            + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        )


def main(args: argparse.Namespace) -> int:
    check_args(args)
    if not torch.cuda.is_available():
        raise ValueError("needs CUDA (the peer transport copies between GPUs)")
    if not under_torchrun() and args.nproc < 2:
        raise ValueError("--nproc must be at least 2 (an exchange needs a peer)")
    result = launch(rank_main, args, "peer")
    if result is None:  # torchrun ranks other than 0
        return 0
    print_result(result)
    write_json(result, args.json)
    return 0
