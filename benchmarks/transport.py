"""`python -m benchmarks transport`: latency and bandwidth of each transport, and how much each slows the compute it
overlaps (paper section 6.3: SM-free communication left the overlapped kernels about 10% faster than NCCL).

(a) latency / bandwidth: all_to_all (equal blocks) and all_gather per backend and block size, rank 0's median.
    The host transport is measured on each of its paths (host-tcp: gloo over loopback; host-shm: shared memory),
    and, on a GPU rank, next to the floor of any host path: one device-to-host copy of the exchange's input
    followed by one host-to-device copy of its output, pinned, in the same run ("copies" rows). The summary
    gives the ratios from that one run: shm over tcp bandwidth, and the GPU rank's shm exchange over the copies.
(b) contention: a compute kernel (20 causal SDPA calls B8 H16 L4096 D128 bf16; 20 bf16 8192^3 GEMMs) alone and
    overlapped with each kind of traffic, as interleaved pairs (alone/overlapped, then overlapped/alone), median
    of the per-pair ratios. A pair counts only if the traffic outlasted the kernel; when it did not, the traffic
    is lengthened for the next pairs. Traffic kinds: each available transport between the ranks, and, on the
    compute rank alone: pinned D2H/H2D copies on a side stream (copy engines: the host backend's GPU part),
    an SM copy kernel with NCCL-like block count (16 blocks x 512 threads: the *proxy* for NCCL where NCCL
    cannot run, e.g. on one GPU), and an elementwise copy over all SMs.
(c) each host path under torch.profiler: kernels it launches (must be 0), the streams of its copies, and
    the share of copy time that overlaps compute kernels.

Ranks: under torchrun, one GPU per rank (2-8 GPUs run unchanged). Otherwise it starts --nproc local ranks
itself; with fewer GPUs than ranks, rank 0 takes the GPU and the others are CPU peers (gloo over loopback),
which is the only way to run the host backend between two ranks on one GPU; NCCL backends are then skipped.
A CPU peer stands in for a second GPU rank: it gets --peer-threads intra-op threads, so that its host copies
into and out of shared memory keep pace with the copy engines of the GPU rank it serves.

NCCL's copy-engine backend is not offered here until it has run on two GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from benchmarks.launch import launch, under_torchrun, write_json
from benchmarks.traffic import ExchangeTraffic, contention_kernel, contention_row, traffic_units
from fscomm import TransportUnavailableError, get_transport, new_thread_group

SIZES = [4 << 10, 256 << 10, 4 << 20, 32 << 20]
PEER_KINDS = ("host", "host-tcp", "host-shm", "nccl", "rdma")
LOCAL_KINDS = ("ce-copies", "nccl-proxy-sm16", "sm-copy-all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--backends",
        default="host-tcp,host-shm,nccl,rdma",
        help="comma-separated transports: host (the default path for these ranks), host-tcp, host-shm, "
        "nccl, rdma (rdma is untested on real NICs)",
    )
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="with fewer GPUs than ranks: every rank exchanges from GPU 0 (two GPU ranks on one GPU) "
        "instead of CPU peers; rank 0 alone runs the contention kernels",
    )
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=8,
        help="intra-op threads of a CPU peer of a GPU rank (its copies to and from shared memory)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block bytes per destination")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per latency point")
    parser.add_argument("--pairs", type=int, default=9, help="interleaved alone/overlapped pairs per contention point")
    parser.add_argument("--kernels", default="sdpa,gemm", help="contention kernels: sdpa, gemm")
    parser.add_argument("--proxy-blocks", type=int, default=16, help="thread blocks of the NCCL proxy copy kernel")
    parser.add_argument("--no-contention", action="store_true", help="latency/bandwidth only")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")


# --- rank set-up ---------------------------------------------------------------------------------------


class Ctx:
    """One rank's view: its device, whether it computes, the control group, the transports."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int):
        self.args, self.rank, self.world = args, rank, world
        want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device here")
        n_gpus = torch.cuda.device_count() if want == "cuda" else 0
        local = int(os.environ.get("LOCAL_RANK", rank))
        self.gpu_per_rank = want == "cuda" and world <= n_gpus
        if want == "cuda" and (self.gpu_per_rank or rank == 0 or args.share_gpu):
            self.device = torch.device("cuda", local if self.gpu_per_rank else 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if want == "cuda":
                torch.set_num_threads(max(1, min(args.peer_threads, (os.cpu_count() or 2) - 1)))
            else:  # CPU ranks share the cores: more intra-op threads than cores/ranks only spin against each other
                torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        # sharing one GPU, only rank 0 runs the contention kernels; every GPU rank exchanges from the GPU
        self.computes = self.device.type == "cuda" and (self.gpu_per_rank or rank == 0)
        self.any_cuda = want == "cuda"
        self.transports: dict[str, Any] = {}  # driven by the main thread (latency)
        self.traffic_transports: dict[str, Any] = {}  # driven by the traffic thread: a group of its own
        self.skipped: dict[str, str] = {}

    def bcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def open_transports(self) -> None:
        timeout = datetime.timedelta(seconds=self.args.timeout)
        for name in [b.strip() for b in self.args.backends.split(",") if b.strip()]:
            if name == "nccl-ce":
                self.skipped[name] = (
                    "withdrawn from the command line until it has run on two GPUs (fscomm/experimental/nccl_ce.py)"
                )
                continue
            if name not in PEER_KINDS:
                raise ValueError(f"unknown backend {name!r}; choose from {PEER_KINDS}")
            if name.startswith("nccl") and not self.gpu_per_rank:
                self.skipped[name] = (
                    f"needs one GPU per rank ({torch.cuda.device_count()} GPU(s) for {self.world} "
                    "ranks); on one GPU see the nccl-proxy-sm16 contention row"
                )
                continue
            reasons = self.gather(_reason(name))  # every rank must agree before a collective group is made
            reason = next((r for r in reasons if r), None)
            if reason:
                self.skipped[name] = reason
                continue
            try:
                self.transports[name] = get_transport(name, self._group(name, "main", timeout))
                self.traffic_transports[name] = get_transport(name, self._group(name, "traffic", timeout))
            except TransportUnavailableError as exc:
                self.skipped[name] = str(exc)
                self.transports.pop(name, None)

    def _group(self, name: str, role: str, timeout: datetime.timedelta):
        """One group per backend and issuing thread (fscomm refuses a second thread on a group)."""
        return new_thread_group(f"bench-{name}-{role}", backend="nccl" if name == "nccl" else "gloo", timeout=timeout)


def _reason(name: str) -> Optional[str]:
    import importlib

    from fscomm.transport import BACKENDS

    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls).unavailable_reason()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


# --- (a) latency and bandwidth ----------------------------------------------------------------------------


def bench_latency(ctx: Ctx) -> list[dict]:
    """Every backend (and, on a GPU rank, the copy floor) at each size, interleaved repetition by repetition, so
    that the ratios between them are not skewed by a machine whose load drifts during the run."""
    rows = []
    sizes = [int(s) for s in ctx.args.sizes.split(",")]
    for size in sizes:
        for op in ("all_to_all", "all_gather"):
            x = torch.empty(size * (ctx.world if op == "all_to_all" else 1), dtype=torch.uint8, device=ctx.device)
            splits = [size] * ctx.world
            cases: dict[tuple[str, str], Any] = {}
            for name, t in ctx.transports.items():
                cases[(name, op)] = (
                    (lambda t=t: t.all_to_all(x, splits, splits).wait())
                    if op == "all_to_all"
                    else (lambda t=t: t.all_gather(x).wait())
                )
            if op == "all_to_all" and ctx.any_cuda:
                cases.update(_copy_floor(ctx, size))
            times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
            for i in range(ctx.args.reps + 2):
                for key, run in cases.items():
                    dist.barrier()  # every rank enters the exchange together: its latency, not overlapped exchanges'
                    t0 = time.perf_counter()
                    run()
                    ctx.sync()
                    if i >= 2:
                        times[key].append(time.perf_counter() - t0)
            for (name, label), ts in times.items():
                if name.startswith("copies") and not ctx.computes:
                    continue
                med = statistics.median(ts)
                rows.append(
                    {
                        "backend": name,
                        "op": label,
                        "block_bytes": size,
                        "median_us": med * 1e6,
                        "min_us": min(ts) * 1e6,
                        "gb_per_s": size * ctx.world / med / 1e9,
                    }
                )
    return rows


def _copy_floor(ctx: Ctx, size: int) -> dict:
    """The floor of a host path on the GPU rank: D2H of the all_to_all's input, then H2D of its output, pinned,
    on a side stream ("copies"); and the same for the bytes that leave the rank only ("copies-peer"). Other
    ranks only keep step."""
    cases = {}
    stream = torch.cuda.Stream(ctx.device) if ctx.computes else None
    for label, nbytes in (("copies", size * ctx.world), ("copies-peer", size * (ctx.world - 1))):
        if not ctx.computes:
            cases[(label, "d2h+h2d")] = lambda: None
            continue
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev_in = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        dev_out = torch.empty_like(dev_in)

        def copies(host=host, dev_in=dev_in, dev_out=dev_out) -> None:
            with torch.cuda.stream(stream):
                host.copy_(dev_in, non_blocking=True)
                dev_out.copy_(host, non_blocking=True)
            stream.synchronize()

        cases[(label, "d2h+h2d")] = copies
    return cases


def summary(rows: list[dict]) -> list[dict]:
    """Ratios within one run, per block size: shm over tcp all_to_all bandwidth; on a GPU rank, the shm
    exchange's time over the copies' (target: at most 1/0.7)."""
    by = {(r["backend"], r["op"], r["block_bytes"]): r for r in rows}
    out = []
    for size in sorted({r["block_bytes"] for r in rows}):
        shm, tcp = by.get(("host-shm", "all_to_all", size)), by.get(("host-tcp", "all_to_all", size))
        if shm is None:
            continue
        row = {"block_bytes": size, "shm_gb_per_s": shm["gb_per_s"]}
        if tcp is not None:
            row.update(tcp_gb_per_s=tcp["gb_per_s"], shm_over_tcp=shm["gb_per_s"] / tcp["gb_per_s"])
        for label in ("copies", "copies-peer"):
            ref = by.get((label, "d2h+h2d", size))
            if ref is not None:
                row[f"shm_time_over_{label.replace('-', '_')}"] = shm["median_us"] / ref["median_us"]
        out.append(row)
    return out


# --- traffic ---------------------------------------------------------------------------------------------


class LocalTraffic:
    """n units of GPU-local traffic on a side stream of the compute rank."""

    def __init__(self, ctx: Ctx, kind: str):
        self.ctx, self.kind = ctx, kind
        self.stream = torch.cuda.Stream(ctx.device)
        n = 64 << 20
        if kind == "ce-copies":
            self.host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.empty(n, dtype=torch.uint8, device=ctx.device)
        else:
            self.src = torch.empty(4 * n // 4, dtype=torch.float32, device=ctx.device)
            self.dst = torch.empty_like(self.src)
        if kind == "nccl-proxy-sm16":
            self.copy = _proxy_copy_kernel(ctx.args.proxy_blocks)

    def _unit(self) -> None:
        if self.kind == "ce-copies":
            self.host.copy_(self.dev, non_blocking=True)
            self.dev.copy_(self.host, non_blocking=True)
        elif self.kind == "nccl-proxy-sm16":
            self.copy(self.src, self.dst)
        else:
            torch.mul(self.src, 1.0, out=self.dst)  # an elementwise kernel over every SM

    def start(self, n: int) -> "LocalTraffic":
        self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.begin.record()
            for _ in range(n):
                self._unit()
            self.end.record()
        return self

    def join(self, compute_end_event: Optional["torch.cuda.Event"]) -> bool:
        self.end.synchronize()
        return compute_end_event is None or compute_end_event.elapsed_time(self.end) >= 0

    def seconds(self) -> float:
        return self.begin.elapsed_time(self.end) / 1e3


def _proxy_copy_kernel(blocks: int):
    """A Triton copy kernel on exactly ``blocks`` thread blocks of 512 threads (NCCL runs one block of 512
    threads per channel; 16 channels is typical for an intra-node AllToAll): it holds that many SMs."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr, NPROG: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, NPROG * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    def run(src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_kernel[(blocks,)](src, dst, src.numel(), BLOCK=4096, NPROG=blocks, num_warps=16)

    return run


# --- (b) contention ---------------------------------------------------------------------------------------


def _trial(ctx: Ctx, kernel, traffic, n: int) -> tuple[Optional[float], bool]:
    """All ranks: start the traffic (if any), run the kernel on compute ranks; (kernel seconds, outlasted)."""
    if traffic is not None:
        traffic.start(n)
    seconds, end_evt, end_host = None, None, None
    if ctx.computes:
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        kernel()
        end_evt.record()
        end_evt.synchronize()
        end_host = time.monotonic()
        seconds = start_evt.elapsed_time(end_evt) / 1e3
    outlasted = True
    if traffic is not None:
        outlasted = traffic.join(end_evt if isinstance(traffic, LocalTraffic) else end_host)
    return seconds, outlasted


def bench_contention(ctx: Ctx) -> list[dict]:
    rows = []
    for kname in [k.strip() for k in ctx.args.kernels.split(",") if k.strip()]:
        kernel = contention_kernel(kname, ctx.device, "transport") if ctx.computes else None
        for _ in range(2):
            _trial(ctx, kernel, None, 0)  # warm-up
        alone = ctx.gather(statistics.median([_trial(ctx, kernel, None, 0)[0] or 0.0 for _ in range(3)]))
        t_alone = max(alone)
        kinds = [k for k in PEER_KINDS if k in ctx.transports] + list(LOCAL_KINDS)
        for kind in kinds:
            local = kind in LOCAL_KINDS
            if local and not ctx.any_cuda:
                continue
            traffic = None
            if local and ctx.computes:
                try:
                    traffic = LocalTraffic(ctx, kind)
                    traffic.start(1).join(None)  # compiles the proxy kernel here, where a failure is caught
                except Exception as exc:  # e.g. no Triton for the proxy kernel
                    traffic = exc
            elif not local:
                traffic = ExchangeTraffic(ctx.traffic_transports[kind], ctx.world, ctx.device)
            errs = ctx.gather(str(traffic) if isinstance(traffic, Exception) else None)
            if any(errs):
                rows.append({"kernel": kname, "traffic": kind, "skipped": next(e for e in errs if e)})
                continue
            # calibrate: how long one unit of traffic takes alone (slowest rank), after a warm-up (kernel
            # compilation, relay pool)
            if traffic is not None:
                traffic.start(2).join(None)
                traffic.start(4).join(None)
            unit = max(ctx.gather(traffic.seconds() / 4 if traffic is not None else 0.0))
            n = traffic_units(t_alone, unit)
            ratios, dropped = [], 0
            for p in range(ctx.args.pairs):
                order = (False, True) if p % 2 == 0 else (True, False)
                got = {}
                for overlapped in order:
                    got[overlapped] = _trial(ctx, kernel, traffic if overlapped else None, n)
                ok = all(ctx.gather(got[True][1]))
                if not ok:
                    dropped += 1
                    n = 2 * n
                elif ctx.computes:
                    ratios.append(got[True][0] / got[False][0])
            all_ratios = [r for rs in ctx.gather(ratios) for r in rs]
            rows.append(
                {
                    **contention_row(kname, kind, t_alone, all_ratios, dropped, n, unit),
                    "proxy": kind == "nccl-proxy-sm16",
                }
            )
            del traffic
    return rows


# --- (c) the host backend under the profiler -------------------------------------------------------------


def trace_hosts(ctx: Ctx) -> dict:
    return {
        name: trace_host(ctx, name)
        for name in ("host", "host-tcp", "host-shm")
        if name in ctx.transports and ctx.any_cuda
    }


def trace_host(ctx: Ctx, name: str) -> dict:
    from benchmarks.gpu_trace import trace

    traffic = ExchangeTraffic(ctx.traffic_transports[name], ctx.world, ctx.device)
    traffic.start(2).join(None)  # warm the pool before tracing
    out: dict = {}
    if ctx.computes:
        out["host_only"] = trace(lambda: traffic.start(4).join(None)).summary()
    else:
        traffic.start(4).join(None)
    kernel = contention_kernel("sdpa", ctx.device, "transport") if ctx.computes else None
    if ctx.computes:
        kernel()  # build cuDNN's plan outside the trace, or the copies finish before the first attention kernel
        torch.cuda.synchronize(ctx.device)
        out["overlapped_with_sdpa"] = trace(lambda: _trial(ctx, kernel, traffic, 4)).summary()
        out["compute_stream"] = torch.cuda.current_stream(ctx.device).stream_id
    else:
        _trial(ctx, kernel, traffic, 4)
    out["pool"] = ctx.traffic_transports[name].pool_stats()
    return out


# --- driver ----------------------------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> Optional[dict]:
    ctx = Ctx(args, rank, world)
    ctx.open_transports()
    result: dict = {
        "world_size": world,
        "devices": ctx.gather(str(ctx.device)),
        "skipped": ctx.skipped,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.computes else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.computes else None,
    }
    result["load_average_before"] = os.getloadavg()
    result["latency"] = bench_latency(ctx)
    result["load_average_after"] = os.getloadavg()
    result["summary"] = summary(result["latency"])
    result["paths"] = {name: t.active_path for name, t in ctx.transports.items()}
    if ctx.any_cuda and not args.no_contention:
        result["host_trace"] = trace_hosts(ctx)
        result["contention"] = bench_contention(ctx)
    return result if rank == 0 else None


def _print(result: dict) -> None:
    print(
        f"ranks {result['world_size']} on {result['devices']}  gpu={result.get('gpu')}  nccl={result.get('nccl')}  "
        f"torch={result['torch']}"
    )
    if "load_average_before" in result:  # a loaded machine's figures are not its capacity
        print(
            f"load average (1, 5, 15 min) before {result['load_average_before']}, after {result['load_average_after']}"
        )
    for name, why in result["skipped"].items():
        print(f"  skipped {name}: {why}")
    print(f"\n{'backend':<9} {'op':<11} {'block':>10} {'median us':>11} {'min us':>9} {'GB/s':>8}")
    for r in result["latency"]:
        print(
            f"{r['backend']:<9} {r['op']:<11} {r['block_bytes']:>10} {r['median_us']:>11.1f} {r['min_us']:>9.1f} "
            f"{r['gb_per_s']:>8.2f}"
        )
    if result.get("summary"):
        print(
            f"\n{'block':>10} {'tcp GB/s':>9} {'shm GB/s':>9} {'shm/tcp':>8} {'shm t / copies t':>17} "
            f"{'shm t / peer copies t':>22}"
        )
        for r in result["summary"]:
            f = lambda k, w: f"{r[k]:>{w}.2f}" if k in r else f"{'-':>{w}}"
            print(
                f"{r['block_bytes']:>10} {f('tcp_gb_per_s', 9)} {f('shm_gb_per_s', 9)} {f('shm_over_tcp', 8)} "
                f"{f('shm_time_over_copies', 17)} {f('shm_time_over_copies_peer', 22)}"
            )
    for name, tr in (result.get("host_trace") or {}).items():
        print(f"\n{name} under the profiler:", json.dumps(tr))
    if result.get("contention"):
        print(
            f"\n{'kernel':<6} {'traffic':<16} {'alone ms':>9} {'ratio med':>10} {'min':>6} {'max':>6} {'pairs':>6} "
            f"{'dropped':>8} {'units':>6}"
        )
        for r in result["contention"]:
            if "skipped" in r:
                print(f"{r['kernel']:<6} {r['traffic']:<16} skipped: {r['skipped']}")
                continue
            med = f"{r['median_ratio']:.3f}" if r["median_ratio"] else "-"
            lo = f"{r['min_ratio']:.3f}" if r["min_ratio"] else "-"
            hi = f"{r['max_ratio']:.3f}" if r["max_ratio"] else "-"
            label = r["traffic"] + (" (proxy)" if r["proxy"] else "")
            print(
                f"{r['kernel']:<6} {label:<16} {r['kernel_alone_ms']:>9.2f} {med:>10} {lo:>6} {hi:>6} {r['pairs']:>6} "
                f"{r['pairs_dropped_traffic_too_short']:>8} {r['traffic_units']:>6}"
            )


def main(args: argparse.Namespace) -> int:
    if not under_torchrun() and args.nproc < 2:
        raise ValueError("--nproc must be at least 2 (an exchange needs a peer)")
    result = launch(_rank_main, args, "transport", env={"OMP_NUM_THREADS": "2"})
    if result is None:  # torchrun ranks other than 0
        return 0
    _print(result)
    write_json(result, args.json)
    return 0
