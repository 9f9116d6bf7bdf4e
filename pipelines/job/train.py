"""`freescale train` and `torchrun -m pipelines.job.train`: the training entry point.

    freescale train --nproc 2 --steps 20 --summary-json out.json     # launches 2 local ranks itself
    torchrun --nproc-per-node 2 -m pipelines.job.train --steps 20         # or under torchrun

Every rank holds the whole dense model (data parallel); the embedding tables are replicated or, in the sharded
modes, row-wise sharded. The dense gradients' all-reduce carries the step's bookkeeping too (label counts, per-rank
compute times), so the bookkeeping adds no collective and the straggler wait is measured where it happens (see
pipelines.job.trainer).

Errors. What can be checked before the ranks start is checked there (the config, the data's files and schema, an
explicit checkpoint directory). An error raised on a rank reaches the user as one line naming the rank and the cause,
and the rank's full traceback goes to a log file that the line names (``--log-dir``; printed too under
``--verbose``); the command exits non-zero. A rank that dies without an error (killed, out of memory) is
named with its exit code or signal. See docs/reliability.md.

Signals. SIGTERM, SIGINT and SIGHUP end the job in one line naming the step the ranks had reached and the newest
complete checkpoint (pipelines.job.launch.signals).

Here: one rank's job (``worker``) and the command's entry (``main``); the launcher of local ranks and hosts, the
checks before it, the failure and signal lines are pipelines.job.launch's, the summary's lines pipelines.job.run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pipelines.job.config import JobConfig
from pipelines.job.config.flags import add_config_arguments, config_from_args, ignored_option_lines
from pipelines.job.config.sections import JobProcessSection
from pipelines.job.failure_report import LAUNCHED_ENV, LOG_DIR_ENV, report_failure
from pipelines.job.launch.failure import CommTimeout, RankFailed, call_site, is_timeout
from pipelines.job.launch.launcher import launch
from pipelines.job.launch.preflight import check_before_launch
from pipelines.job.launch.signals import (
    Interrupted,
    SignalBeforeLaunch,
    StopOnSignal,
    interrupted_line,
    stop_signals_before_launch,
)
from pipelines.job.run.progress import use_thread_locks_for_progress_bars
from pipelines.job.run.summary import pair_paths, print_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """init_process_group, with the store keys of a restarted attempt (torchrun --max-restarts) kept apart.

    A restarted attempt talks to the launcher's same store. Without a prefix of its own, the thread groups made
    at set-up (fscomm.groups.new_thread_group) would find the previous attempt's keys there and try to connect to
    its dead processes ("Connection refused"): every attempt's keys get the attempt number as prefix.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=not agent_store and rank == 0
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"freescale/attempt{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def worker(config: JobConfig) -> Optional[dict]:
    """One rank's job. Returns the run summary on rank 0 (None elsewhere).

    An error ends the rank with one line (see the module docstring): under `freescale train` the launcher prints
    it; under torchrun the rank prints it itself and exits with status 1."""
    if os.environ.get(LAUNCHED_ENV) == "1" and config.run.nnodes > 1:  # ranks follow --node-rank, not torch's order
        from pipelines.job.launch.hosts import rank_offset

        run = config.run
        try:
            offset = rank_offset(run.rdzv_endpoint, run.node_rank, run.comm_timeout_s)
        except Exception as exc:
            report_failure(exc, int(os.environ["RANK"]), run.verbose, run.log_dir)
            os._exit(1)
        os.environ["RANK"] = str(offset + int(os.environ["LOCAL_RANK"]))
    rank = int(os.environ["RANK"])
    use_thread_locks_for_progress_bars()
    log_dir = config.run.log_dir or os.environ.get(LOG_DIR_ENV)
    if log_dir:  # which process is which rank: to inspect a stuck one (py-spy dump --pid), or to stop it
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
    stop = StopOnSignal(rank, config)
    stop.install()
    try:
        summary = _rank_job(config, stop)
    except Exception as exc:
        line = report_failure(exc, rank, config.run.verbose, config.run.log_dir)
        if os.environ.get(LAUNCHED_ENV) != "1":
            print(f"freescale train: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no second traceback from the process wrapper, no hang in a peer's collective at exit
    stop.uninstall()
    return summary


def _rank_job(config: JobConfig, stop: StopOnSignal) -> Optional[dict]:
    from fscomm import groups
    from fscomm.heartbeat import Heartbeat
    from pipelines.job.trainer import Trainer

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = config.run.device == "cuda" or (config.run.device == "auto" and torch.cuda.is_available())
    if config.run.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    # NCCL needs a GPU per rank; ranks sharing a GPU exchange through gloo.
    backend = "nccl" if use_cuda and torch.cuda.device_count() >= local_world else "gloo"
    if use_cuda:
        torch.cuda.set_device(device)
    configure_process(config.process, rank, device, local_world)
    timeout_s = config.run.comm_timeout_s
    groups.set_comm_timeout(timeout_s)
    if backend == "gloo":
        # torch's flight recorder keeps a Python traceback per gloo collective, and its memory kept growing by ~100
        # bytes a step past its 2,000 entries; the heartbeat names a stalled rank. Asking for it still turns it on.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    if not dist.is_initialized():
        _init_process_group(backend, rank, world_size, timeout_s)
    hosts: list = [None] * world_size  # each rank's host, for the summary (one small gather at set-up)
    dist.all_gather_object(hosts, socket.gethostname())
    # On failure the process ends without destroying the groups (worker): a peer may be gone, and an NCCL
    # group's destruction can then wait for it.
    with Heartbeat(rank, world_size, interval_s=min(1.0, timeout_s / 10)) as heartbeat:
        trainer = None
        try:
            trainer = stop.trainer = Trainer(config, rank=rank, world_size=world_size, device=device)
            heartbeat.set_status(lambda: f"step {trainer.step}")
            summary = trainer.train()
            if summary is not None:  # which path each exchange's group took (transports close with the trainer)
                from fscomm.host import host_paths

                paths = host_paths()
                summary["hosts"] = hosts
                summary["transport"] = {"host": paths, "pairs": pair_paths(hosts, paths)}
        except Exception as exc:
            if is_timeout(exc):
                step = f"step {trainer.step}" if trainer is not None else "set-up"
                raise CommTimeout(
                    f"a collective in {call_site(exc)} timed out after {timeout_s:g} s (--comm-timeout-s) at {step}; "
                    f"other ranks: {heartbeat.diagnose()}; backend said: {' '.join(str(exc).split())[:300]}"
                ) from exc
            raise
        trainer.close()  # on success only: after a failure a peer may be gone, and the process ends anyway
    dist.destroy_process_group()
    return summary


def configure_process(section: JobProcessSection, rank: int, device: torch.device, local_world: int) -> None:
    """This rank's process from its ``[process]`` section: torch's intra-op threads and Python's thread switch
    interval (the NUMA binding is the launcher's: pipelines.job.launch.launcher.numa_options)."""
    cuda = device.type == "cuda"
    if cuda and section.numa_binding is not None and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        print(
            f"[freescale] rank {rank} on {device}: {len(cpus)} CPUs ({cpus[0]}-{cpus[-1]}), "
            f"numa_binding={section.numa_binding}"
        )
    # 2 ranks on 2 cores must not each start a pool of 2 threads: split the cores between local ranks. On a GPU
    # the pool only runs small host ops; a large one crowds out the loader and exchange threads and stalls
    # single ops by milliseconds.
    share = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(section.threads or (min(2, share) if cuda else share))
    # oneDNN JIT-compiles and caches a kernel per input shape (GELU's among them), up to 1,024, 0.1-1 MB resident
    # each: jagged batches bring unseen shapes for as long as the job runs, so a rank's resident memory grew by up
    # to a GiB. 16 keeps it flat. oneDNN itself stays: its kernels give the same bits whatever a rank's thread
    # count. ATen's own CPU kernels do not (LayerNorm's weight/bias gradients, softmax's backward sum per-thread
    # parts), so two layouts of hosts and ranks share one loss curve only at the same threads per rank (the share
    # above differs between a host of 1 rank and one of 3: pass --process.threads). Read at oneDNN's first kernel,
    # which no rank has run yet here; the environment may set another capacity.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    # Several Python threads per rank (loader stages, exchange workers, the embedding chains): a thread that
    # needs the GIL waits up to the switch interval for it (Python's default is 5 ms), a gap in the model
    # thread. --process.gil-switch-ms bounds that wait.
    sys.setswitchinterval(section.gil_switch_ms / 1e3)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    for warning in ignored_option_lines(config):
        print(f"[freescale] warning: {warning}", file=sys.stderr)
    if _under_launcher():
        summary = worker(config)
    else:
        try:
            with stop_signals_before_launch():
                check_before_launch(config)
        except SignalBeforeLaunch as stop:
            print(f"freescale train: {interrupted_line(stop.name, None, config.checkpoint.dir)}", file=sys.stderr)
            return 128 + stop.signum
        try:
            summary = launch(config, worker)
        except RankFailed as failure:
            print(f"freescale train: error: {failure}", file=sys.stderr)
            return 1
        except Interrupted as stop:
            print(f"freescale train: {stop}", file=sys.stderr)
            return 128 + stop.signum
    if summary is None:
        return 0
    print_summary(summary)
    if config.run.summary_json:
        path = Path(config.run.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"  summary written to {path}")
    return 0


if __name__ == "__main__":  # torchrun -m pipelines.job.train ...
    parser = argparse.ArgumentParser(prog="pipelines.job.train", description="FreeScale training (one rank)")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
