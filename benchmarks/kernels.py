"""`python -m benchmarks kernels`: the jagged kernels (Triton) against their vectorized PyTorch twins and the naive
per-sample eager loops, per op and world size (paper section 4.2, Figure 7).

Every world size W gets one workload drawn here with numpy (no dataset needed): a local batch of B samples per
rank (default 128) with heavy-tailed UIH lengths (lognormal, median ~3.4k, mean ~5k, capped at 21,000:
KuaiRand-like), and the global batch of W * B samples the balancer sees after its AllGather. What each op is fed:

    indexed_permute/plan     the plan's order applied to the gathered candidate lengths (W*B jagged segments)
    indexed_permute/stage3   the Stage III send buffer: the local UIH (ids, action types, timestamps) [N, 3]
                             int64, reordered by destination
    indexed_permute/global   the plan applied to all W*B samples' gathered UIH ids (the bandwidth-bound case)
    ranged_dispatch          the local UIH ids -> W row-wise shards of a 2^30-row table (ID AllToAll send side;
                             the eager loop walks samples, and shards within a sample)
    ranged_combine           embeddings [N, dim] back from the shards, restored to batch order (one scatter per
                             sample and source shard in the eager loop)
    keyed_transpose          a shard's received ids as a KJT: 3 keys x W*B samples (each sample's ids that hit
                             this shard) -> batch-major
    segment_sum              AllToAll send splits: per-sample UIH lengths in plan order summed per dest rank
                             (the eager loop adds one sample at a time)
    collision_mask           batch i's received ids vs batch i+1's (Zipf-like ids; the eager loop tests one
                             sample of one source rank at a time)

Speedups compare latencies (host wall clock from an idle GPU to the result, launches and host syncs included:
see :class:`Timer`); the bandwidth column uses the Triton op's device time and counts the fewest bytes the op
must read plus write, against an H200's copy rate (``H200_COPY_BANDWIDTH``). Run on CPU (``--device cpu``)
the Triton column is skipped unless TRITON_INTERPRET=1 (useful only as a smoke test with tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch

from kernels import ops
from kernels.impl import Impl

H200_COPY_BANDWIDTH = 4.3e12  # bytes/s, read + write: an H200's device-to-device copy rate, the bandwidth column's 100%
NUM_ROWS = 1 << 30  # embedding rows, row-wise sharded over the ranks
UIH_KEYS = 3  # uih_item_ids, uih_action_types, uih_timestamps


@dataclass
class Row:
    op: str
    world_size: int
    triton_us: Optional[float]  # latency (host wall clock, idle GPU to result)
    triton_gpu_us: Optional[float]  # device time of the sync-free Triton op
    twin_us: float
    eager_us: float
    speedup_vs_eager: Optional[float]
    speedup_vs_twin: Optional[float]
    bytes_moved: int
    achieved_gbps: Optional[float]
    bandwidth_fraction: Optional[float]
    eager_reps: int
    agree: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--world-sizes", default="8,32,128,512", help="comma-separated world sizes")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows (and the set-up) as JSON")
    parser.add_argument("--batch-size", type=int, default=128, help="local batch size per rank")
    parser.add_argument("--uih-median", type=float, default=3400.0, help="median UIH length")
    parser.add_argument("--uih-mean", type=float, default=5000.0, help="mean UIH length before the cap")
    parser.add_argument("--uih-cap", type=int, default=21000, help="longest UIH kept")
    parser.add_argument("--embedding-dim", type=int, default=128, help="embedding width for ranged_combine")
    parser.add_argument("--reps", type=int, default=30, help="timed calls of the Triton kernel and the twin")
    parser.add_argument("--eager-reps", type=int, default=5, help="timed eager calls (1 at world sizes >= 256)")
    parser.add_argument("--ops", default="all", help="comma-separated subset of op rows, or 'all'")
    parser.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------------------------------------------- data
def uih_lengths(rng: np.random.Generator, n: int, median: float, mean: float, cap: int) -> np.ndarray:
    """Lognormal lengths with the given median and (uncapped) mean, clipped to [1, cap]."""
    sigma = math.sqrt(2.0 * math.log(max(mean / median, 1.0 + 1e-9)))
    return np.clip(rng.lognormal(math.log(median), sigma, n).astype(np.int64), 1, cap)


def zipf_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Popular items repeat (so batches collide), spread over the whole row space."""
    ranks = rng.zipf(1.2, n) % NUM_ROWS
    return (ranks * 2654435761) % NUM_ROWS  # scatter the popular ranks across shards


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class Workload:
    """All inputs for one world size, on the device."""

    def __init__(self, args: argparse.Namespace, world_size: int, device: torch.device):
        rng = np.random.default_rng(args.seed + world_size)
        b, w = args.batch_size, world_size
        dev = device
        self.world_size = w
        glob = uih_lengths(rng, w * b, args.uih_median, args.uih_mean, args.uih_cap)
        self.global_uih_lengths = torch.from_numpy(glob).to(dev)
        local = glob[:b]
        n_local = int(local.sum())
        self.local_uih_offsets = offsets_of(torch.from_numpy(local).to(dev))
        self.local_ids = torch.from_numpy(zipf_ids(rng, n_local)).to(dev)
        self.next_ids = torch.from_numpy(zipf_ids(rng, n_local)).to(dev)
        # Plan: a random permutation of the global batch, destination rank r gets b samples.
        self.order = torch.from_numpy(rng.permutation(w * b)).to(dev)
        self.dest_offsets = torch.arange(w + 1, device=dev, dtype=torch.int64) * b
        num_candidates = torch.from_numpy(rng.integers(1, 65, w * b)).to(dev)
        self.candidate_offsets = offsets_of(num_candidates)
        self.candidate_lengths = torch.from_numpy(rng.integers(1, 9, int(num_candidates.sum()))).to(dev)
        # Stage III: the local batch's per-event features, reordered by destination.
        self.local_features = torch.stack(
            [
                self.local_ids,
                torch.from_numpy(rng.integers(0, 8, n_local)).to(dev),
                torch.from_numpy(rng.integers(1_600_000_000, 1_700_000_000, n_local)).to(dev),
            ],
            dim=1,
        )
        self.local_order = torch.from_numpy(rng.permutation(b)).to(dev)
        self.boundaries = torch.div(
            torch.arange(w + 1, device=dev, dtype=torch.int64) * NUM_ROWS, w, rounding_mode="floor"
        )
        _, self.splits, self.perm = ops.ranged_dispatch(self.local_ids, self.boundaries, impl=Impl.TORCH)
        self.embeddings = torch.randn(n_local, args.embedding_dim, device=dev).to(torch.bfloat16)
        # A shard's KJT after the ID AllToAll: W*B samples, each contributing ~1/W of its UIH per key.
        per_shard = rng.binomial(np.repeat(glob[None, :], UIH_KEYS, axis=0), 1.0 / w)
        self.kjt_lengths = torch.from_numpy(per_shard.astype(np.int64)).to(dev)
        self.kjt_values = torch.from_numpy(zipf_ids(rng, int(per_shard.sum()))).to(dev)
        self.plan_lengths = self.global_uih_lengths[self.order]
        # The literal reading of section 4.2: the plan applied to every gathered UIH id (GBs at W = 512).
        self.global_uih_offsets = offsets_of(self.global_uih_lengths)
        self.global_ids = torch.randint(0, NUM_ROWS, (int(glob.sum()),), device=dev)
        # Received ids of batch i on this shard, grouped by source rank and sample (for the eager per-sample loop).
        recv_counts = rng.multinomial(n_local, np.full(w * b, 1.0 / (w * b)))
        self.recv_offsets = offsets_of(torch.from_numpy(recv_counts).to(dev))

    def cases(self) -> dict[str, tuple[Callable[..., object], int]]:
        """op row -> (call(impl, sized=False), fewest bytes read + written). ``sized``: pass the output size
        the caller knows, so the op needs no host sync (how the GPU time is measured)."""
        w = self.world_size
        i8 = 8
        n_local = self.local_ids.numel()
        k_plan = self.order.numel()
        plan_values = int(self.candidate_lengths.numel())
        kjt = self.kjt_values.numel()
        emb_row = self.embeddings.shape[1] * self.embeddings.element_size()
        return {
            "indexed_permute/plan": (
                lambda impl, sized=False: ops.indexed_permute(
                    self.candidate_lengths,
                    self.candidate_offsets,
                    self.order,
                    output_size=plan_values if sized else None,
                    impl=impl,
                ),
                2 * plan_values * i8 + k_plan * 3 * i8,
            ),
            "indexed_permute/stage3": (
                lambda impl, sized=False: ops.indexed_permute(
                    self.local_features,
                    self.local_uih_offsets,
                    self.local_order,
                    output_size=n_local if sized else None,
                    impl=impl,
                ),
                2 * self.local_features.numel() * i8,
            ),
            "indexed_permute/global": (
                lambda impl, sized=False: ops.indexed_permute(
                    self.global_ids,
                    self.global_uih_offsets,
                    self.order,
                    output_size=self.global_ids.numel() if sized else None,
                    impl=impl,
                ),
                2 * self.global_ids.numel() * i8 + k_plan * 3 * i8,
            ),
            "ranged_dispatch": (
                lambda impl, sized=False: ops.ranged_dispatch(
                    self.local_ids, self.boundaries, offsets=self.local_uih_offsets, impl=impl
                ),
                3 * n_local * i8 + w * i8,
            ),
            "ranged_combine": (
                lambda impl, sized=False: ops.ranged_combine(
                    self.embeddings, self.perm, splits=self.splits, offsets=self.local_uih_offsets, impl=impl
                ),
                2 * n_local * emb_row + n_local * i8,
            ),
            "keyed_transpose": (
                lambda impl, sized=False: ops.keyed_transpose(self.kjt_values, self.kjt_lengths, impl=impl),
                2 * kjt * i8 + 2 * self.kjt_lengths.numel() * i8,
            ),
            "segment_sum": (
                lambda impl, sized=False: ops.segment_sum(self.plan_lengths, self.dest_offsets, impl=impl),
                k_plan * i8 + 2 * (w + 1) * i8,
            ),
            "collision_mask": (
                lambda impl, sized=False: ops.collision_mask(
                    self.local_ids, self.next_ids, offsets=self.recv_offsets, impl=impl
                ),
                2 * n_local * i8 + n_local,
            ),
        }


# -------------------------------------------------------------------------------------------------------- timing
class Timer:
    """Two clocks, each a median over calls with the L2 flushed first.

    latency_us: host wall clock from an idle GPU to the op's result being ready, launches, host syncs and
    Python included; what a caller waits for, and the fair comparison across the three implementations.
    gpu_us: CUDA events around the op while the GPU is held busy by a spin, so the whole op is queued before
    its first kernel starts and only device execution (plus inter-kernel gaps) is counted; valid for ops
    without a host sync (the Triton path given its output size). The achieved bandwidth uses this.
    """

    SPIN_CYCLES = 4_000_000  # about 2 ms at 1.98 GHz: longer than any op here takes to launch

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def latency_us(self, fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                self.flush.zero_()
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def gpu_us(self, fn: Callable[[], object], reps: int) -> Optional[float]:
        if not self.cuda:
            return None
        fn()
        times = []
        for _ in range(reps):
            self.flush.zero_()
            torch.cuda._sleep(self.SPIN_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return all(_same(x, y) for x, y in zip(a, b))


def _triton_runs(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    import os

    return os.environ.get("TRITON_INTERPRET", "") == "1"


def bench_world_size(args: argparse.Namespace, world_size: int, device: torch.device, selected: set[str]) -> list[Row]:
    work = Workload(args, world_size, device)
    timer = Timer(device)
    rows = []
    for name, (call, bytes_moved) in work.cases().items():
        if selected and name not in selected:
            continue
        eager_out = call(Impl.EAGER)
        twin_out = call(Impl.TORCH)
        agree = _same(eager_out, twin_out)
        del eager_out
        triton_us = gpu_us = None
        if _triton_runs(device):
            agree = agree and _same(call(Impl.TRITON), twin_out) and _same(call(Impl.TRITON, sized=True), twin_out)
            triton_us = timer.latency_us(lambda: call(Impl.TRITON), args.reps)
            gpu_us = timer.gpu_us(lambda: call(Impl.TRITON, sized=True), args.reps)
        del twin_out
        twin_us = timer.latency_us(lambda: call(Impl.TORCH), args.reps)
        eager_reps = 1 if world_size >= 256 else args.eager_reps
        eager_us = timer.latency_us(lambda: call(Impl.EAGER), eager_reps, warmup=1)
        gbps = bytes_moved / (gpu_us * 1e-6) / 1e9 if gpu_us else None
        rows.append(
            Row(
                op=name,
                world_size=world_size,
                triton_us=triton_us,
                triton_gpu_us=gpu_us,
                twin_us=twin_us,
                eager_us=eager_us,
                speedup_vs_eager=eager_us / triton_us if triton_us else None,
                speedup_vs_twin=twin_us / triton_us if triton_us else None,
                bytes_moved=bytes_moved,
                achieved_gbps=gbps,
                bandwidth_fraction=gbps * 1e9 / H200_COPY_BANDWIDTH if gbps else None,
                eager_reps=eager_reps,
                agree=agree,
            )
        )
        print(_format_row(rows[-1]), flush=True)
    del work
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


HEADER = (
    f"{'op':<24}{'W':>5}{'triton_us':>11}{'twin_us':>11}{'eager_us':>13}{'vs_eager':>10}{'vs_twin':>9}"
    f"{'gpu_us':>9}{'MB':>9}{'GB/s':>8}{'%4.3T':>8}  ok"
)


def _fmt(v: Optional[float], spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))


def _format_row(r: Row) -> str:
    return (
        f"{r.op:<24}{r.world_size:>5}{_fmt(r.triton_us, '11.1f')}{r.twin_us:>11.1f}{r.eager_us:>13.1f}"
        f"{_fmt(r.speedup_vs_eager, '10.1f')}{_fmt(r.speedup_vs_twin, '9.2f')}{_fmt(r.triton_gpu_us, '9.1f')}"
        f"{r.bytes_moved / 1e6:>9.2f}{_fmt(r.achieved_gbps, '8.0f')}"
        f"{_fmt(None if r.bandwidth_fraction is None else 100 * r.bandwidth_fraction, '7.1f')}"
        f"  {'yes' if r.agree else 'NO'}"
    )


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available")
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}") from None
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"world sizes must be >= 1, got {args.world_sizes!r}")
    selected = set() if args.ops == "all" else {o.strip() for o in args.ops.split(",")}
    copy_gbps = None
    if device.type == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_us = Timer(device).gpu_us(lambda: dst.copy_(src), 10)
        copy_gbps = 2 * src.numel() / copy_us / 1e3
        print(
            f"device-to-device copy of 1 GiB: {copy_us:.0f} us = {copy_gbps:.0f} GB/s read + write "
            f"(the bandwidth column's yardstick: {H200_COPY_BANDWIDTH / 1e9:.0f} GB/s)"
        )
        del src, dst
    print(HEADER, flush=True)
    rows: list[Row] = []
    for w in world_sizes:
        rows.extend(bench_world_size(args, w, device, selected))
    print("\n" + HEADER)
    for name in dict.fromkeys(r.op for r in rows):
        for r in rows:
            if r.op == name:
                print(_format_row(r))
    if args.json:
        setup = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        env = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "measured_copy_gbps": copy_gbps,
        }
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0 if all(r.agree for r in rows) else 1
