"""`python -m benchmarks host`: the host work per step that grows with the world size, at world sizes one host
cannot run.

At 64-256 ranks a per-rank Python loop, or a torch op per rank, in a per-step path costs milliseconds of host time
and holds the GIL beside the model's threads. Each row times one such path on the CPU, on one step's worth of
synthetic data for W ranks (no process group: the paths are pure functions of what the collectives delivered),
and counts the top-level torch ops it dispatches:

    balance measures   Stage III's per-rank tokens and sparsity, before and after the plan (fsdata.nodes.shuffle)
    stage II unpad     the all-gather of unequal sizes taking each rank's rows out of its padded block
                       (fscomm.host.unpad_blocks, the candidates' lengths)
    flags split        the prioritized backward taking step i's and step i+1's flags apart (Algorithm 2's lines
                       13-14, fsembed.prioritized)
    fbs plan           the FBS partition of the step, for scale (a sort of all the step's samples)
    NAME plan [B]      with ``--plans``: each partitioner named there, ``NAME:B`` under the memory budget B
                       (``vbs:1.05x``: 1.05 times the step's mean tokens per rank), on the same step

Usage: ``python -m benchmarks host [--world-sizes 8,64,256,1024] [--batch-size 128] [--plans fbs,kk,vbs,vbs:1.05x]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.profiler import profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default="8,64,256,1024", help="comma-separated world sizes W")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank and step")
    parser.add_argument("--ids-per-rank", type=int, default=64, help="ids this rank sent to each rank (flags split)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per row (the median is shown)")
    parser.add_argument(
        "--plans",
        default="fbs",
        help="comma-separated partitioners timed as 'NAME plan' rows; NAME:B plans under the memory budget B"
        " (a token count or Nx), e.g. fbs,kk,vbs,vbs:1.05x",
    )
    parser.add_argument("--json", help="write the rows here")


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """Median ms per call, and the top-level torch ops one call dispatches."""
    fn()
    with profile() as prof:
        fn()
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), ops


def _paths(world: int, args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    from fscomm.host import unpad_blocks
    from fsdata.nodes.shuffle import _per_rank_stats
    from fsdata.partition import GatheredLengths, RuntimeInfo, get_partitioner
    from fsembed.prioritized import _deinterleave, _interleave

    rng = np.random.default_rng(world)
    uih = np.minimum(rng.lognormal(np.log(3379), 0.89, world * args.batch_size), 21_000).astype(np.int64)
    lengths = GatheredLengths.from_rank_lengths(np.split(uih, world))
    plan = get_partitioner("fbs")(lengths, RuntimeInfo())
    order, offsets, dest = plan.order.numpy(), lengths.rank_offsets.numpy(), plan.dest_offsets.numpy()

    rows = rng.integers(0, 4 * args.batch_size, world)  # candidates per rank: Stage II's unequal sizes
    recv = torch.zeros(world * int(rows.max()) * 8, dtype=torch.uint8)
    out = torch.empty(int(rows.sum()), dtype=torch.int64)

    splits = [args.ids_per_rank] * world
    flags = _interleave(
        torch.zeros(sum(splits), dtype=torch.bool), splits, torch.ones(sum(splits), dtype=torch.bool), splits
    )
    paths = {
        "balance measures": lambda: (_per_rank_stats(uih, offsets), _per_rank_stats(uih[order], dest)),
        "stage II unpad": lambda: unpad_blocks(recv, rows.tolist(), 8, out),
        "flags split": lambda: _deinterleave(flags, splits, splits),
    }
    for spec in filter(None, (p.strip() for p in args.plans.split(","))):
        paths[_plan_path(spec)] = _plan(spec, lengths)
    return paths


def _plan_path(spec: str) -> str:
    """The row of ``NAME`` or ``NAME:B``: 'NAME plan' or 'NAME plan B'."""
    name, _, budget = spec.partition(":")
    return f"{name} plan" + (f" {budget}" if budget else "")


def _plan(spec: str, lengths) -> Callable[[], object]:
    """One call of the partitioner ``spec`` names on the step's ``lengths``, under its budget if it names one."""
    from fsdata.partition import BudgetSpec, RuntimeInfo, get_partitioner

    name, _, budget = spec.partition(":")
    partitioner = get_partitioner(name)
    spec_budget = BudgetSpec.parse(budget) if budget else None
    runtime = RuntimeInfo(memory_budget=None if spec_budget is None else spec_budget.for_step(lengths))
    return lambda: partitioner(lengths, runtime)


def main(args: argparse.Namespace) -> int:
    worlds = [int(w) for w in args.world_sizes.split(",") if w]
    if not worlds or min(worlds) < 1 or args.batch_size < 1 or args.repeats < 1:
        raise SystemExit("--world-sizes, --batch-size and --repeats must be positive")
    rows = []
    for world in worlds:
        for name, fn in _paths(world, args).items():
            ms, ops = _time(fn, args.repeats)
            rows.append({"path": name, "world_size": world, "batch_size": args.batch_size, "ms": ms, "torch_ops": ops})
    print(f"{'path':<20} {'W':>5} {'ms/step':>9} {'torch ops':>9}")
    for r in rows:
        print(f"{r['path']:<20} {r['world_size']:>5} {r['ms']:>9.3f} {r['torch_ops']:>9}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0
