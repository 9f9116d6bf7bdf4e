"""The run summary as `freescale train` prints it (rank 0's summary, also written with ``--summary-json``)."""

from __future__ import annotations


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
                "loader reads batches ahead of the step (--prefetch-depth, lookahead), and the reference model reads "
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
        from pipelines.job.run.schedule import describe_choice

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
