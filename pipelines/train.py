"""`freescale train` and `torchrun -m pipelines.train`: the training entry point.

    freescale train --nproc 2 --steps 20 --summary-json out.json     # launches 2 local ranks itself
    torchrun --nproc-per-node 2 -m pipelines.train --steps 20         # or under torchrun

Data parallel for now: every rank holds the whole model; after backward one all-reduce carries the gradients
and the step's bookkeeping (label counts, per-rank compute times), so a step has exactly one blocking
collective and the straggler wait is measured where it happens (see pipelines.trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pipelines.config import JobConfig, add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_process_group(backend: str, rank: int, world_size: int) -> None:
    """init_process_group, with the store keys of a restarted attempt (torchrun --max-restarts) kept apart.

    A restarted attempt talks to the launcher's same store. Without a prefix of its own, the stage groups made
    at set-up (fscomm.groups.new_stage_group) would find the previous attempt's keys there and try to connect to
    its dead processes ("Connection refused"): every attempt's keys get the attempt number as prefix.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group(backend)
        return
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=not agent_store and rank == 0
    )
    dist.init_process_group(backend, store=dist.PrefixStore(f"freescale/attempt{attempt}", store), rank=rank, world_size=world_size)


def worker(config: JobConfig) -> Optional[dict]:
    """One rank's job. Returns the run summary on rank 0 (None elsewhere)."""
    from pipelines.trainer import Trainer

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    # NCCL needs a GPU per rank; ranks sharing a GPU exchange through gloo.
    backend = "nccl" if use_cuda and torch.cuda.device_count() >= local_world else "gloo"
    if use_cuda:
        torch.cuda.set_device(device)
    if use_cuda and config.train.numa_binding is not None and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        print(f"[freescale] rank {rank} on {device}: {len(cpus)} CPUs ({cpus[0]}-{cpus[-1]}), numa_binding={config.train.numa_binding}")
    # 2 ranks on 2 cores must not each start a pool of 2 threads: split the cores between local ranks. On a GPU
    # the pool only runs small host ops; a large one crowds out the loader and exchange threads and stalls
    # single ops by milliseconds.
    share = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(config.train.threads or (min(2, share) if use_cuda else share))
    # Several Python threads per rank (loader stages, exchange workers, the embedding chains): a thread that
    # needs the GIL waits up to the switch interval for it (Python's default is 5 ms), a gap in the model
    # thread. --gil-switch-ms bounds that wait.
    sys.setswitchinterval(config.train.gil_switch_ms / 1e3)
    if not dist.is_initialized():
        _init_process_group(backend, rank, world_size)
    try:
        return Trainer(config, rank=rank, world_size=world_size, device=device).train()
    finally:
        dist.destroy_process_group()


def _numa_options(config: JobConfig):
    """torch's NUMA binding for a GPU run (local rank r bound near GPU r), or None (CPU runs, or not asked for)."""
    mode = config.train.numa_binding
    if mode is None:
        return None
    if not torch.cuda.is_available() or config.train.device == "cpu":
        print(f"[freescale] numa_binding={mode} ignored: it binds ranks near their GPUs, and this run has none")
        return None
    if config.train.nproc > torch.cuda.device_count():
        print(f"[freescale] numa_binding={mode} ignored: {config.train.nproc} ranks share {torch.cuda.device_count()} GPU(s)")
        return None
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(mode))


def launch(config: JobConfig) -> Optional[dict]:
    """Runs ``worker`` on ``config.train.nproc`` local ranks with torch's elastic launcher; rank 0's summary."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.train.nproc,
        run_id=f"freescale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        numa_options=_numa_options(config),
    )
    results = elastic_launch(launch_config, worker)(config)
    return results.get(0)


def print_summary(summary: dict) -> None:
    print("\n=== FreeScale run summary ===")
    steps = summary.get("steps") or 0
    # loss and ne come from the trainer's summary: label-weighted over the second half of the steps this process ran
    notes = {
        "loss": f"mean BCE per label over the last {steps - steps // 2} of these {steps} steps (after a resume: of the resumed part)",
        "ne": "normalized entropy over the same steps: that BCE / the entropy of the labels' positive rate (1 = predicting the rate; lower is better)",
    }
    for key in ("mode", "steps", "world_size", "samples", "wall_s", "samples_per_s", "loss", "ne", "straggler_pct", "bubble_s"):
        value = summary.get(key)
        line = f"  {key:<16} {value:.4g}" if isinstance(value, float) else f"  {key:<16} {'n/m' if value is None else value}"
        print(line + (f"  {notes[key]}" if key in notes else ""))
    for rank, t in enumerate(summary.get("per_rank_compute_s", [])):
        print(f"  rank {rank} compute  " + ("n/m (not measured)" if t is None else f"{t * 1e3:.1f} ms/step (mean)"))
    if summary.get("unmeasured"):
        print(f"  not measured     {', '.join(summary['unmeasured'])} (hidden inside torchrec's progress())")
    schedule = summary.get("embedding_schedule")
    if schedule and schedule["mode"] == "auto":
        probe = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in schedule["probe_median_s"].items() if v is not None)
        chosen = (f"{schedule['choice']} from step {schedule['decided_at']}" if schedule["choice"]
                  else "not chosen: the run ended inside the schedule probe")
        print(f"  embedding        {chosen}" + (f" (probe medians: {probe})" if probe else ""))
    print(f"  timed steps      {summary['warmup_steps']} warm-up and {summary.get('drain_steps', 0)} drain step(s) left out")


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    summary = worker(config) if _under_launcher() else launch(config)
    if summary is None:
        return 0
    print_summary(summary)
    if config.train.summary_json:
        path = Path(config.train.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"  summary written to {path}")
    return 0


if __name__ == "__main__":  # torchrun -m pipelines.train ...
    parser = argparse.ArgumentParser(prog="pipelines.train", description="FreeScale training (one rank)")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
