"""`python -m benchmarks embedding`: exposed embedding communication, synchronous vs prioritized (paper section 5.2,
Figure 9).

Every configuration trains the same synthetic batches twice on ``--nproc`` local ranks: once with the
synchronous collection ("vanilla TorchRec": ID AllToAll inside the step, blocking embedding and gradient
AllToAlls) and once with prioritized updates (ids prefetched one step ahead, only collision rows waited for).
Exposed time is the time the training thread spends blocked in ``wait()`` on each part (Timer spans ids_a2a,
emb_a2a, grad_a2a) per step: on each rank the median over the timed steps (after a warm-up), then the mean
over ranks; ``total`` is the median of the per-step sums, so the parts need not add up to it exactly.

Sweeps: the generator's collision knob (fraction of a global batch's unique rows that the previous global batch
also used) at ``--max-uih``, and the UIH length at ``--fit-collision``; a least-squares line of prioritized
exposed time against the measured collision rate (the paper: linear). Every record carries ``parity`` (true
only when both runs' losses and final tables were equal bit for bit) and ``exposed_reduction`` (synchronous
over prioritized exposed time).

A small dense model (``--dense-layers`` tanh layers over every embedding row) gives the exchanges something to
overlap with. Every step ends where data-parallel training's dense all-reduce would: the GPU's work done, then
the ranks meet (a barrier on a group of its own, standing in for the all-reduce). Its wait is reported apart
(``dense_ms``), not as embedding communication: it holds the ranks' skew (on one shared GPU the two processes
are time-sliced, so one finishes its step milliseconds after the other), which would otherwise land in whichever
embedding exchange waits first in the next step. Needs neither torchdata nor torchrec.

``--torchrec`` (CPU) adds two runs on the same batches and initial tables: torchrec's synchronous sharded
EmbeddingCollection and its prioritized embedding communication, PEC (benchmarks/embedding_torchrec.py), with
their exposed parts and their losses' largest difference to the sync run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

TORCHREC_MODES = ("torchrec", "torchrec_pec")  # benchmarks/embedding_torchrec.py's runs

PARTS = ("ids_a2a", "emb_a2a", "grad_a2a")
LR = 0.05  # the tables' row-wise Adagrad


@dataclass
class BenchConfig:
    nproc: int = 2
    zipf: float = 1.05
    max_uih: int = 256
    batch_size: int = 16
    dim: int = 64
    vocab: int = 200_003
    steps: int = 12
    warmup: int = 3
    dense_layers: int = 4
    compute_ms: float = 0.0
    collisions: list[float] = field(default_factory=lambda: [0.0, 0.02, 0.05, 0.1, 0.2, 0.5])
    fit_collision: float = 0.05
    device: str = "cpu"
    seed: int = 0
    timeout: float = 300.0  # seconds a collective may wait on a peer
    trace: Optional[str] = None  # directory: torch.profiler traces of the first point's steps, per rank and mode
    torchrec: bool = False  # also torchrec's synchronous collection and its PEC (CPU)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--nproc", type=int, default=d.nproc, help="local ranks (gloo / host transport)")
    parser.add_argument("--zipf", type=float, default=d.zipf, help="Zipf exponent of within-batch popularity")
    parser.add_argument("--max-uih", type=int, default=d.max_uih, help="longest UIH; the UIH sweep runs L/4, L/2, L")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per rank and step")
    parser.add_argument("--dim", type=int, default=d.dim, help="embedding dim")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per configuration (after warm-up)")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--dense-layers", type=int, default=d.dense_layers, help="tanh layers of the toy dense model")
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=d.compute_ms,
        help="emulated dense compute per step (1/3 forward, 2/3 backward) for the exchanges to overlap",
    )
    parser.add_argument("--collisions", type=str, default=",".join(map(str, d.collisions)), help="collision knob sweep")
    parser.add_argument("--fit-collision", type=float, default=d.fit_collision, help="collision knob of the UIH sweep")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="cuda: every rank on GPU 0")
    parser.add_argument(
        "--trace",
        type=str,
        default=None,
        help="directory: a torch.profiler trace (Perfetto / "
        "chrome://tracing) of the first point's steps, warm-up included, per rank and mode (that "
        "point's figures are then measured under the profiler)",
    )
    parser.add_argument("--timeout", type=float, default=d.timeout, help="collective timeout in seconds")
    parser.add_argument(
        "--torchrec",
        action="store_true",
        help="also torchrec's synchronous sharded collection and its PEC on the same batches (CPU)",
    )
    parser.add_argument("--json", type=str, default=None, help="write the records here")
    parser.add_argument(
        "--plot", type=str, default=None, help="PNG of exposed time against collision rate (needs matplotlib)"
    )


def _config_from_args(args) -> BenchConfig:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = BenchConfig(
        nproc=args.nproc,
        zipf=args.zipf,
        max_uih=args.max_uih,
        batch_size=args.batch_size,
        dim=args.dim,
        steps=args.steps,
        warmup=args.warmup,
        dense_layers=args.dense_layers,
        compute_ms=args.compute_ms,
        collisions=[float(x) for x in args.collisions.split(",") if x.strip()],
        fit_collision=args.fit_collision,
        device=device,
        timeout=getattr(args, "timeout", BenchConfig.timeout),
        trace=getattr(args, "trace", None),
        torchrec=getattr(args, "torchrec", False),
    )
    if cfg.torchrec and cfg.device != "cpu":
        raise ValueError("--torchrec runs on CPU only (torchrec's CPU build): add --device cpu")
    if cfg.nproc < 2:
        raise ValueError(f"--nproc must be >= 2 (exchanges need peers), got {cfg.nproc}")
    if cfg.max_uih < 4 or cfg.batch_size < 1 or cfg.steps < 1:
        raise ValueError("need --max-uih >= 4, --batch-size >= 1, --steps >= 1")
    if any(not 0.0 <= c <= 1.0 for c in cfg.collisions):
        raise ValueError(f"collision rates must lie in [0, 1], got {cfg.collisions}")
    return cfg


# ----------------------------------------------------------------------------------------------------- one rank
def _plan(cfg: BenchConfig, world_size: int):
    from fsembed.plan import ShardingPlan, TableConfig

    return ShardingPlan(
        [TableConfig("items", cfg.vocab, cfg.dim, ("uih", "cand")), TableConfig("users", 1000, cfg.dim, ("user",))],
        world_size,
    )


def _batches(cfg: BenchConfig, rank: int, world_size: int, collision: float, max_uih: int) -> list[dict]:
    """This rank's ids per step, on the CPU (where the loader holds them)."""
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    n_steps = cfg.warmup + cfg.steps
    gb = cfg.batch_size * world_size
    source = SyntheticSource(
        SyntheticConfig(
            num_samples=gb * n_steps,
            seed=cfg.seed,
            uih_median=max(2.0, max_uih / 4),
            uih_max=max_uih,
            vocab_size=cfg.vocab,
            zipf_exponent=cfg.zipf,
            collision_rate=collision,
            collision_block_size=gb,
            side_features=False,
        )
    )
    out = []
    for s in range(n_steps):
        b = source.read(0, s * gb + rank * cfg.batch_size, s * gb + (rank + 1) * cfg.batch_size)
        out.append({"uih": b.uih_item_ids, "cand": b.content_ids, "user": b.user_ids % 1000})
    return out


def _dense(cfg: BenchConfig, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 17)
    return [(torch.randn(cfg.dim, cfg.dim, generator=g) / cfg.dim**0.5).to(device) for _ in range(cfg.dense_layers)]


class _Busy(torch.autograd.Function):
    """Emulated dense compute of a fixed duration: on GPU a sleep kernel on the compute stream (the stream is
    busy, the host is free, as under a real model's kernels); on CPU a sleep that leaves the cores to the
    exchange threads (as a GPU model would). Isolates what the paper's section 5.2 measures: how much of the
    embedding communication the step's compute hides."""

    cycles_per_ms: Optional[float] = None

    @staticmethod
    def _spend(ms: float, device) -> None:
        if ms <= 0:
            return
        if device.type == "cuda":
            if _Busy.cycles_per_ms is None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(10_000_000)
                end.record()
                end.synchronize()
                _Busy.cycles_per_ms = 10_000_000 / start.elapsed_time(end)
            torch.cuda._sleep(int(ms * _Busy.cycles_per_ms))
        else:
            time.sleep(ms / 1e3)

    @staticmethod
    def forward(ctx, x, fwd_ms: float, bwd_ms: float):
        ctx.bwd_ms = bwd_ms
        _Busy._spend(fwd_ms, x.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Busy._spend(ctx.bwd_ms, grad.device)
        return grad, None, None


def _loss(emb: dict[str, torch.Tensor], dense: list[torch.Tensor], compute_ms: float = 0.0) -> torch.Tensor:
    if compute_ms > 0:
        emb = dict(emb)
        first = next(iter(emb))
        emb[first] = _Busy.apply(emb[first], compute_ms / 3, 2 * compute_ms / 3)
    total = 0.0
    for e in emb.values():
        h = e
        for w in dense:
            h = torch.tanh(h @ w)
        total = total + h.square().mean() * 1e3 if h.numel() else total + e.sum()
    return total


def _train(coll, batches, dense, prefetcher, warmup: int, device, compute_ms: float = 0.0, meet=None):
    """Trains over ``batches`` (CPU) with a one-step lookahead. ``prefetcher`` (prioritized runs): the
    ID-prefetch stage in a thread of its own, two batches ahead, exchanging the CPU ids as the trainer's loader
    does (fsembed.id_prefetch, off the GPU streams), the result delivered with ``.to(device)``; waiting for it is
    counted as ID exchange time. Without it (synchronous runs) the ids, already on the device like a batch the
    loader copied there, are exchanged inside the step. ``meet()``: the step's end, where the dense all-reduce
    would make the ranks meet; its wait is returned per step apart from the embedding parts."""
    losses, step_s, exposed = [], [], []
    futures = {}
    sync_device = device.type == "cuda"
    on_device = [{k: v.to(device) for k, v in b.items()} for b in batches] if prefetcher is None else None

    def ids_of(s):
        if prefetcher is None:
            return on_device[s]
        for k in range(s, min(s + 2, len(batches))):  # keep two batches in flight
            if k not in futures:
                futures[k] = prefetcher(batches[k])
        with coll.timer.span("ids_a2a"):
            return futures.pop(s).result().to(device)

    nxt = ids_of(0)
    for s in range(len(batches)):
        if s == warmup:
            if sync_device:
                torch.cuda.synchronize()
            coll.timer.reset()
        t0 = time.perf_counter()
        cur = nxt
        nxt = ids_of(s + 1) if s + 1 < len(batches) else None
        emb = coll(cur, nxt if prefetcher is not None else None)
        loss = _loss(emb, dense, compute_ms)
        loss.backward()
        losses.append(loss.detach())
        if sync_device:
            torch.cuda.synchronize()
        t_meet = time.perf_counter()
        if meet is not None:
            meet()
        if s >= warmup:
            step_s.append(time.perf_counter() - t0)
            summary = coll.timer.summary()
            exposed.append({p: summary.get(p, {"total_s": 0.0})["total_s"] for p in PARTS})
            exposed[-1]["dense"] = time.perf_counter() - t_meet
        coll.timer.reset()
    return losses, step_s, exposed


@contextlib.contextmanager
def _traced(directory: Optional[str], name: str, device: torch.device):
    """A torch.profiler trace of the block into ``directory/name`` (nothing when ``directory`` is None)."""
    if directory is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    os.makedirs(directory, exist_ok=True)
    prof.export_chrome_trace(os.path.join(directory, name))


def _rank_run(rank: int, world_size: int, cfg: BenchConfig, points: list[tuple[float, int]]) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsembed.transports import embedding_transports

    # One GPU per rank where there are enough; otherwise the ranks share them (e.g. two ranks on one GPU).
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = dict(
        transports=embedding_transports(),
        prefetch_transport=get_transport("host", group=new_thread_group("bench-id-prefetch")),
        dense_group=new_thread_group("bench-dense-allreduce"),
        pool=ThreadPoolExecutor(1, thread_name_prefix="id-prefetch"),
    )
    plan = _plan(cfg, world_size)
    dense = _dense(cfg, device)
    records = [
        _run_point(cfg, plan, dense, rank, world_size, device, point, c, L, **comm)
        for point, (c, L) in enumerate(points)
    ]
    comm["pool"].shutdown()  # on success only: after a failure a prefetch may wait on a peer that has gone
    return records


def _run_point(
    cfg,
    plan,
    dense,
    rank,
    world_size,
    device,
    point,
    collision,
    max_uih,
    transports,
    prefetch_transport,
    dense_group,
    pool,
) -> dict:
    """One point of the sweep: the same batches under sync and prioritized updates, their exposed times and parity."""
    import torch.distributed as dist

    from fsembed.id_prefetch import start_prefetch
    from fsembed.optim import RowWiseAdagrad
    from fsembed.prioritized import PrioritizedEmbeddingCollection
    from fsembed.sharded import ShardedEmbeddingCollection

    batches = _batches(cfg, rank, world_size, collision, max_uih)
    runs = {}
    init_tables = None
    for mode, cls in (("sync", ShardedEmbeddingCollection), ("prioritized", PrioritizedEmbeddingCollection)):
        coll = cls(plan, rank, transport=transports, optimizer=RowWiseAdagrad(lr=LR), seed=cfg.seed, device=device)
        if cfg.torchrec and init_tables is None:
            init_tables = coll.full_tables()  # torchrec's runs start from the same weights
        dist.barrier()
        prefetcher = (
            (lambda f: pool.submit(start_prefetch, plan.stack_ids(f), plan.group_boundaries, prefetch_transport, rank))
            if mode == "prioritized"
            else None
        )
        with _traced(cfg.trace if point == 0 else None, f"embedding_{mode}_rank{rank}.json", device):
            losses, step_s, per_step = _train(
                coll,
                batches,
                dense,
                prefetcher,
                warmup=cfg.warmup,
                device=device,
                compute_ms=cfg.compute_ms,
                meet=lambda: dist.barrier(group=dense_group),
            )
        # Median over steps: the CPU machines are shared, and one step that lost its core to another
        # process would otherwise dominate a mean of a dozen steps.
        exposed = {p: float(np.median([e[p] for e in per_step])) for p in (*PARTS, "dense")}
        exposed["total"] = float(np.median([sum(e[p] for p in PARTS) for e in per_step]))
        runs[mode] = dict(
            losses=torch.stack(losses).cpu(),
            tables=coll.full_tables(),
            exposed=exposed,
            step_s=float(np.median(step_s)),
            collision=float(np.mean(coll.collision_rates[cfg.warmup : -1])) if mode == "prioritized" else None,
            ids=int(sum(v.numel() for b in batches for v in b.values())),
        )
    s, p = runs["sync"], runs["prioritized"]
    parity = torch.equal(s["losses"], p["losses"]) and all(
        torch.equal(s["tables"][k], p["tables"][k]) for k in s["tables"]
    )
    outside = _torchrec_runs(cfg, plan, init_tables, batches, dense, dense_group, s["losses"]) if cfg.torchrec else {}
    return dict(
        **outside,
        collision_knob=collision,
        max_uih=max_uih,
        parity=parity,
        collision_measured=p["collision"],
        ids_per_step=s["ids"] / len(batches),
        sync_exposed=s["exposed"],
        prioritized_exposed=p["exposed"],
        sync_step_s=s["step_s"],
        prioritized_step_s=p["step_s"],
    )


def _torchrec_runs(cfg, plan, init_tables, batches, dense, dense_group, sync_losses: torch.Tensor) -> dict:
    """``--torchrec``: torchrec's two runs of one point (benchmarks/embedding_torchrec.py), as record fields."""
    import torch.distributed as dist

    from benchmarks import embedding_torchrec

    meet = lambda: dist.barrier(group=dense_group)  # noqa: E731
    out = {}
    for mode, r in embedding_torchrec.run(
        plan, init_tables, batches, dense, cfg.warmup, cfg.compute_ms, meet, _loss, LR
    ).items():
        out[f"{mode}_exposed"] = r["exposed"]
        out[f"{mode}_step_s"] = r["step_s"]
        out[f"{mode}_loss_max_diff"] = float((r["losses"] - sync_losses.cpu()).abs().max())
    return out


def _rank_main(job: argparse.Namespace, rank: int, world_size: int) -> list[dict]:
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-3)  # as the trainer's ranks (pipelines/job/train.py): several Python threads per rank
    return _rank_run(rank, world_size, job.cfg, job.points)


def _launch(cfg: BenchConfig, points) -> list[list[dict]]:
    """Every rank's records, in rank order; a failed rank ends the command with one line (bench/launch.py)."""
    from benchmarks.launch import launch

    job = argparse.Namespace(cfg=cfg, points=points, nproc=cfg.nproc, timeout=cfg.timeout)
    return launch(_rank_main, job, "embedding", env={"OMP_NUM_THREADS": "1"}, every_rank=True)


# ----------------------------------------------------------------------------------------------------- summary
def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Averages exposed times over ranks; parity must hold on every rank."""
    out = []
    for recs in zip(*per_rank):
        r0 = recs[0]
        rec = dict(collision_knob=r0["collision_knob"], max_uih=r0["max_uih"], parity=all(r["parity"] for r in recs))
        rec["collision_measured"] = float(np.mean([r["collision_measured"] for r in recs]))
        rec["ids_per_rank_step"] = float(np.mean([r["ids_per_step"] for r in recs]))
        for mode in ("sync", "prioritized"):
            parts = {
                p: float(np.mean([r[f"{mode}_exposed"][p] for r in recs])) * 1e3 for p in (*PARTS, "total", "dense")
            }
            rec[f"{mode}_exposed_ms"] = parts
            rec[f"{mode}_step_ms"] = float(np.mean([r[f"{mode}_step_s"] for r in recs])) * 1e3
        for mode in TORCHREC_MODES if "torchrec_exposed" in r0 else ():
            rec[f"{mode}_exposed_ms"] = {
                p: float(np.mean([r[f"{mode}_exposed"][p] for r in recs])) * 1e3 for p in (*PARTS, "total")
            }
            rec[f"{mode}_step_ms"] = float(np.mean([r[f"{mode}_step_s"] for r in recs])) * 1e3
            rec[f"{mode}_loss_max_diff"] = max(r[f"{mode}_loss_max_diff"] for r in recs)
        p_total = rec["prioritized_exposed_ms"]["total"]
        rec["exposed_reduction"] = rec["sync_exposed_ms"]["total"] / p_total if p_total > 0 else float("inf")
        out.append(rec)
    return out


def _fit(records: list[dict], key: str) -> Optional[dict]:
    xs = np.array([r["collision_measured"] for r in records])
    ys = np.array([r[key]["total"] for r in records])
    if len(xs) < 2 or np.ptp(xs) == 0:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    pred = slope * xs + intercept
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1.0 - float(((ys - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"slope_ms_per_unit": float(slope), "intercept_ms": float(intercept), "r2": r2}


def run(cfg: BenchConfig) -> dict:
    uih_sweep = sorted({max(4, cfg.max_uih // 4), max(4, cfg.max_uih // 2), cfg.max_uih})
    points = [(c, cfg.max_uih) for c in cfg.collisions] + [
        (cfg.fit_collision, L) for L in uih_sweep if L != cfg.max_uih
    ]
    records = _merge(_launch(cfg, points))
    by_collision = [r for r in records if r["max_uih"] == cfg.max_uih]
    return {
        "config": asdict(cfg),
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if cfg.device == "cuda" else None,
        },
        "records": records,
        "fit_vs_collision": {
            "prioritized": _fit(by_collision, "prioritized_exposed_ms"),
            "sync": _fit(by_collision, "sync_exposed_ms"),
        },
    }


def _table(result: dict) -> str:
    head = (
        f"{'coll.knob':>9} {'measured':>8} {'max_uih':>7} {'ids/rk':>7} | {'sync ids/emb/grad = total ms':>30} | "
        f"{'prio ids/emb/grad = total ms':>30} | {'reduct.':>7} {'parity':>6} | {'step ms s/p':>13} | "
        f"{'dense ms s/p':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in result["records"]:
        s, p = r["sync_exposed_ms"], r["prioritized_exposed_ms"]
        lines.append(
            f"{r['collision_knob']:>9.3f} {r['collision_measured']:>8.3f} {r['max_uih']:>7d} "
            f"{r['ids_per_rank_step']:>7.0f} | "
            f"{s['ids_a2a']:>6.2f}/{s['emb_a2a']:>6.2f}/{s['grad_a2a']:>6.2f} = {s['total']:>6.2f} | "
            f"{p['ids_a2a']:>6.2f}/{p['emb_a2a']:>6.2f}/{p['grad_a2a']:>6.2f} = {p['total']:>6.2f} | "
            f"{r['exposed_reduction']:>6.1f}x {str(r['parity']):>6} | "
            f"{r['sync_step_ms']:>6.1f}/{r['prioritized_step_ms']:>6.1f} | "
            f"{s['dense']:>5.2f}/{p['dense']:>5.2f}"
        )
    if any("torchrec_exposed_ms" in r for r in result["records"]):
        lines.append(_torchrec_table(result))
    for mode, fit in result["fit_vs_collision"].items():
        if fit:
            lines.append(
                f"fit {mode}: exposed_ms = {fit['intercept_ms']:.3f} + {fit['slope_ms_per_unit']:.3f} * collision  (r2 "
                f"{fit['r2']:.3f})"
            )
    return "\n".join(lines)


def _torchrec_table(result: dict) -> str:
    """torchrec's two runs beside the sync run of each point: exposed parts, step time, losses against sync."""
    head = (
        f"{'coll.knob':>9} {'max_uih':>7} | {'torchrec ids/emb/grad = total ms':>34} | "
        f"{'torchrec-pec ids/emb/grad = total ms':>36} | {'step ms tr/pec':>14} | {'loss max|diff| tr/pec':>21}"
    )
    lines = ["", head, "-" * len(head)]
    for r in result["records"]:
        t, p = r["torchrec_exposed_ms"], r["torchrec_pec_exposed_ms"]
        lines.append(
            f"{r['collision_knob']:>9.3f} {r['max_uih']:>7d} | "
            f"{t['ids_a2a']:>7.2f}/{t['emb_a2a']:>7.2f}/{t['grad_a2a']:>7.2f} = {t['total']:>7.2f} | "
            f"{p['ids_a2a']:>8.2f}/{p['emb_a2a']:>7.2f}/{p['grad_a2a']:>7.2f} = {p['total']:>7.2f} | "
            f"{r['torchrec_step_ms']:>6.1f}/{r['torchrec_pec_step_ms']:>7.1f} | "
            f"{r['torchrec_loss_max_diff']:>10.1e}/{r['torchrec_pec_loss_max_diff']:>10.1e}"
        )
    lines.append(
        "torchrec: its gradient AllToAll and fused update run inside autograd's backward (grad = from the last "
        "feature's gradient to the backward's end);\ntorchrec-pec's losses part from sync's where torchrec 1.8.0's "
        "PEC updates other rows (three features here: docs/pec.md)"
    )
    return "\n".join(lines)


def plot(results: list[tuple[str, dict]], path: str) -> None:
    """Exposed embedding communication against the measured collision rate (Figure 9's right half), one pair of
    lines (synchronous, prioritized) per labelled result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in results:
        recs = sorted(
            (r for r in result["records"] if r["max_uih"] == result["config"]["max_uih"]),
            key=lambda r: r["collision_measured"],
        )
        xs = [100 * r["collision_measured"] for r in recs]
        for mode, style in (("sync", "o--"), ("prioritized", "s-")):
            ax.plot(xs, [r[f"{mode}_exposed_ms"]["total"] for r in recs], style, label=f"{label}: {mode}")
    ax.set_xlabel("collision rate (% of shard-major ids)")
    ax.set_ylabel("exposed embedding communication per step (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    cfg = _config_from_args(args)
    result = run(cfg)
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot([(cfg.device, result)], args.plot)
    return 0 if all(r["parity"] for r in result["records"]) else 1
