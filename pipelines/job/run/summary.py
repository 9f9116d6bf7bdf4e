"""The run summary: rank 0's, built from the trainer's parts and the run's own figures (:func:`run_summary`), printed
by `freescale train` (:func:`print_summary`) and written with ``--summary-json``."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from pipelines.api.dense_sync import gather_per_rank


def print_summary(summary: dict) -> None:
    print("\n=== FreeScale run summary ===")
    steps = summary.get("steps") or 0
    # loss and ne come from the trainer's summary: label-weighted over the second half of the steps this process ran
    notes = {
        "loss": f"mean BCE per label over the last {steps - steps // 2} of these {steps} steps (after a resume: of the "
        "resumed part)",
        "ne": "normalized entropy over the same steps: that BCE / the entropy of the labels' positive rate (1 = "
        "predicting the rate; lower is better)",
    }
    for key in (
        "mode",
        "steps",
        "world_size",
        "samples",
        "wall_s",
        "samples_per_s",
        "loss",
        "ne",
        "straggler_pct",
        "bubble_s",
    ):
        value = summary.get(key)
        line = (
            f"  {key:<16} {value:.4g}"
            if isinstance(value, float)
            else f"  {key:<16} {'n/m' if value is None else value}"
        )
        print(line + (f"  {notes[key]}" if key in notes else ""))
    first, last = summary.get("first_step"), summary.get("last_step")
    if first:  # resumed: --steps is the step the job runs to, not how many this process runs
        print(f"  resumed          at step {first}, ran to step {last} (--steps {last} is the step to reach)")
    counts = summary.get("data_counts")
    if counts:
        print("  data, all ranks  " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(counts.items())))
        ahead = counts.get("samples_read", 0) - (summary.get("samples") or 0)
        if ahead > 0:
            print(
                f"  read ahead       {ahead} of the {counts['samples_read']} samples read were not trained on: the "
                "loader reads batches ahead of the step (--prefetch-depth, lookahead), and the softmax model reads "
                "one sample per rank for its widths"
            )
    for rank, t in enumerate(summary.get("per_rank_compute_s", [])):
        print(f"  rank {rank} compute  " + ("n/m (not measured)" if t is None else f"{t * 1e3:.1f} ms/step (mean)"))
    if summary.get("unmeasured"):
        print(f"  not measured     {', '.join(summary['unmeasured'])} (interleaved inside torchrec's step)")
    if summary.get("hosts"):
        print(f"  hosts            {describe_hosts(summary['hosts'])}")
    paths = (summary.get("transport") or {}).get("host")
    if paths:
        print(f"  transport        host: {describe_paths(paths)}")
        print(f"  pairs            {describe_pairs(summary['transport']['pairs'])}")
    schedule = summary.get("embedding_schedule")
    if schedule and schedule["mode"] == "auto":
        from pipelines.job.run.schedule_probe import describe_choice

        print(f"  embedding        {describe_choice(schedule)}")  # with the margin that decided
    print(
        f"  timed steps      {summary['warmup_steps']} warm-up and {summary.get('drain_steps', 0)} drain step(s) left "
        "out"
    )
    for e in summary.get("eval") or []:
        print(
            f"  held-out         step {e['step']}: NE {e['ne']:.4f}, AUC {e['auc']:.4f} over {e['samples']} samples "
            f"({e['labels']} labels) never trained on"
        )


def pair_paths(hosts: list[str], paths: dict[str, dict]) -> dict[str, list[list[int]]]:
    """Every pair of ranks by the path its exchanges take: ``shm`` for two ranks of one host (when the host
    transport's groups share memory: not under ``--transport host-tcp``, nor with no room in /dev/shm), ``tcp`` for
    the others."""
    shared = bool(paths) and all(p["path"] != "tcp" for p in paths.values())
    by_path: dict[str, list[list[int]]] = {"shm": [], "tcp": []}
    for a in range(len(hosts)):
        for b in range(a + 1, len(hosts)):
            by_path["shm" if shared and hosts[a] == hosts[b] else "tcp"].append([a, b])
    return by_path


def describe_hosts(hosts: list[str]) -> str:
    """``fsnode0: ranks [0, 1]; fsnode1: ranks [2, 3]``, hosts in the order of their first rank."""
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
    return "; ".join(f"{host}: ranks {r}" for host, r in ranks.items())


def describe_pairs(pairs: dict[str, list[list[int]]], most: int = 12) -> str:
    """``shm 0-1, 2-3; tcp 0-2, 0-3, 1-2, 1-3``, at most ``most`` pairs a path (the JSON has them all)."""
    parts = []
    for path, listed in pairs.items():
        if listed:
            shown = ", ".join(f"{a}-{b}" for a, b in listed[:most])
            parts.append(f"{path} {shown}" + (f" and {len(listed) - most} more" if len(listed) > most else ""))
    return "; ".join(parts)


def describe_paths(paths: dict[str, dict]) -> str:
    """The host transport's groups by path, in one clause: ``shm+tcp (2 shm, 4 tcp pairs): balancer, id-prefetch``."""
    by_path: dict[tuple, list[str]] = {}
    for name, p in paths.items():
        by_path.setdefault((p["path"], p["shm_pairs"], p["tcp_pairs"]), []).append(name)
    return "; ".join(
        f"{path} ({shm} shm, {tcp} tcp pairs): {', '.join(names)}" for (path, shm, tcp), names in by_path.items()
    )


# ---------------------------------------------------------------------------------------------- building it
DATA_FAULTS = ("folded_ids", "dropped_bad_samples", "truncated_uih")  # the source's counts the summary always shows


def run_summary(trainer: Any, wall: float, totals: dict) -> dict:
    """Rank 0's run summary: the steps' running aggregates (pipelines.job.run.aggregates) and the run's own figures
    from the trainer's parts and from ``totals`` (:func:`run_totals`); its size does not grow with the number of
    steps."""
    steps = trainer.aggregates.summary()
    evaluations = trainer.held_out.evaluations if trainer.held_out is not None else []
    config = trainer.config
    return {
        "mode": config.run.mode,
        "steps": steps.pop("steps"),
        "world_size": trainer.world_size,
        "wall_s": wall,
        **steps,
        "embedding_schedule": trainer.schedule_probe.summary() if trainer.schedule_probe is not None else None,
        # held-out evaluations (--eval-data): one per --eval-every steps and one at the end, the last here too
        "eval": evaluations,
        "eval_ne": evaluations[-1]["ne"] if evaluations else None,
        "eval_auc": evaluations[-1]["auc"] if evaluations else None,
        "peak_memory_bytes": peak_memory(trainer.device),  # rank 0's
        "peak_memory_bytes_per_rank": totals["peak_memory_bytes_per_rank"],
        "kernel_variants": kernel_variants(trainer.device),
        "timing": trainer.timer.summary(),
        "loader_worker_timing": trainer.worker_timer.summary() if trainer.worker_timer is not trainer.timer else None,
        "source": trainer.source.describe(),
        # every rank's reads summed: samples read, folded ids, dropped samples, cut UIHs, ...
        "data_counts": totals["data_counts"],
        "first_step": trainer.first_step,  # this process's first step: after a resume, the step it resumed at
        "last_step": trainer.step,
        "config": config.to_dict(),
    }


def run_totals(source: Any, rank: int, world_size: int, device: torch.device) -> dict:
    """The summary's figures summed or gathered over every rank after the loop (collectives: every rank calls it):
    the source's read counts, and every rank's peak memory (a plan may load one rank more than the others)."""
    counts = count_data_faults(source, world_size, device)
    peaks = gather_per_rank((float(peak_memory(device)),), rank, world_size, device)
    return {"data_counts": counts, "peak_memory_bytes_per_rank": [int(v) for v in peaks[:, 0]]}


def count_data_faults(source: Any, world_size: int, device: torch.device) -> dict[str, int]:
    """The source's read counts summed over every rank (one tiny all-reduce after the loop): samples read, ids folded
    onto the table (id_overflow), samples left out (drop_bad_samples), histories cut to the cap, and whatever else
    the source counts (a user's source, ModelSpec.source, may keep none). Every rank's source counts the same
    names."""
    read = source.stats() if hasattr(source, "stats") else {}
    stats = {k: v for k, v in read.items() if isinstance(v, (int, float))}
    for name in DATA_FAULTS:
        stats.setdefault(name, 0)
    names = sorted(stats)
    counts = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    out = {n: int(v) for n, v in zip(names, counts.tolist())}
    mine = getattr(source, "unordered_samples", None)
    if mine is not None and world_size > 1:  # distinct samples: one may reach another rank next epoch
        every: list = [None] * world_size
        dist.all_gather_object(every, mine())
        out["unordered_timestamps"] = len(np.unique(np.concatenate(every)))
    return out


def peak_memory(device: torch.device) -> int:
    """This rank's peak: CUDA allocator peak on GPU, the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def kernel_variants(device: torch.device) -> Optional[dict]:
    """Rank 0's compiled Triton variants per kernel (CUDA only): more than a few per kernel means sizes that change
    per step are compiling new variants mid-run (kernels.triton.common.fixed_code)."""
    if device.type != "cuda":
        return None
    from kernels.triton.variants import compiled_variants

    return compiled_variants()
