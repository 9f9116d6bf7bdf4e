"""The launcher of `freescale train`: runs the job's ranks on this host with torch's elastic agent (on each of
several hosts, which meet at ``--rdzv-endpoint``: hosts.py), and turns how they ended into the job's one line
(failure.py, signals.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from pipelines.job.config import JobConfig
from pipelines.job.failure_report import LAUNCHED_ENV, LOG_DIR_ENV
from pipelines.job.launch.failure import RankFailed, exitcodes, job_failure, rendezvous_line
from pipelines.job.launch.log_dirs import rank_pids, remove_rank_segments, tidy
from pipelines.job.launch.signals import INTERRUPTED, STOP_SIGNALS, Interrupted, interruption, raise_signal


def numa_options(config: JobConfig):
    """torch's NUMA binding for a GPU run (local rank r bound near GPU r), or None (CPU runs, or not asked for)."""
    mode = config.process.numa_binding
    if mode is None:
        return None
    if not torch.cuda.is_available() or config.run.device == "cpu":
        print(f"[freescale] numa_binding={mode} ignored: it binds ranks near their GPUs, and this run has none")
        return None
    if config.run.nproc > torch.cuda.device_count():
        print(
            f"[freescale] numa_binding={mode} ignored: {config.run.nproc} ranks share {torch.cuda.device_count()} "
            "GPU(s)"
        )
        return None
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(mode))


MULTI_NODE_RUN_ID = "freescale"  # the hosts of one job agree on it without being told


def _launch_config(config: JobConfig, log_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    run = config.run
    nodes = {}
    if run.nnodes > 1:  # every host's agent: the same run id and the store at the endpoint
        nodes = dict(
            run_id=MULTI_NODE_RUN_ID,
            rdzv_endpoint=run.rdzv_endpoint,
            rdzv_configs={
                "is_host": False,  # node 0's launcher serves the store (pipelines.job.launch.hosts.ServedStore)
                "join_timeout": run.comm_timeout_s,
                "read_timeout": run.comm_timeout_s,
            },
        )
    options = dict(
        min_nodes=run.nnodes,
        max_nodes=run.nnodes,
        nproc_per_node=run.nproc,
        **{"run_id": f"freescale-{uuid.uuid4().hex[:8]}", "rdzv_endpoint": "localhost:0", **nodes},
        rdzv_backend="c10d",
        max_restarts=0,
        monitor_interval=0.2,
        shutdown_timeout=_ENDING_GRACE_S,  # after a stop signal: a rank still setting up takes it later (launch)
        # torch's agent would raise on these at once, also while it spawns a rank: the launcher's own handler
        # (raise_signal) keeps the stop signals, torch's SIGQUIT
        signals_to_handle="SIGQUIT",
        start_method="spawn",
        numa_options=numa_options(config),
        # torch's launcher keeps its own per-run folder: under ours, so that it goes with ours
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "torchelastic")),
    )
    # shutdown_timeout, signals_to_handle and numa_options came in later torch releases than the oldest one the job
    # runs on (2.11 has no shutdown_timeout); where one is missing torch's own default stands.
    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{name: value for name, value in options.items() if name in known})


@contextlib.contextmanager
def _quiet_torch_launcher(verbose: bool):
    """Silences torch's launcher: its failure report is a page long, and a signal adds a line per rank it stops;
    the one line of ours says what happened. Each of its loggers is set, not their parent: torch sets every one's
    own level when it makes it ($LOGLEVEL, else WARNING), which a parent's level does not override."""
    if verbose:
        yield
        return
    sys.unraisablehook = without_agent_thread_join(sys.unraisablehook)
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def without_agent_thread_join(hook):
    """sys.unraisablehook that drops one harmless report of torch's agent: a signal that stops the agent can leave
    its rendezvous keep-alive thread to run, on itself, the finalizer that joins it, which then prints "Exception
    ignored in: <finalize ...> RuntimeError: cannot join current thread" after the job has ended. Kept for the
    process's life (the finalizer may run at exit); every other report goes to ``hook``."""
    if getattr(hook, "drops_agent_thread_join", False):
        return hook

    def quiet(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and "cannot join current thread" in str(exc):
            return
        hook(unraisable)

    quiet.drops_agent_thread_join = True
    return quiet


def launch(config: JobConfig, worker: Callable[[JobConfig], Optional[dict]]) -> Optional[dict]:
    """Runs ``worker`` (the rank's job, pipelines.job.train.worker: given, not imported, as the entry point is
    above the launcher; the spawned ranks find it by its module path) on ``config.run.nproc`` local ranks with
    torch's elastic launcher (on each of ``run.nnodes`` hosts, which meet at ``run.rdzv_endpoint``); rank 0's
    summary (None on the hosts without rank 0).
    Raises RankFailed (a rank failed, a host was lost, the hosts did not meet) or Interrupted (a signal ended the
    job), each with its one line, which names the log directory when a temporary one stays (it holds the ranks'
    logs)."""
    from multiprocessing import resource_tracker

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from pipelines.job.launch import log_dirs
    from pipelines.job.launch.hosts import RendezvousFailed

    log_dir = Path(config.run.log_dir).resolve() if config.run.log_dir else log_dirs.make()  # as lines name it
    os.environ[LOG_DIR_ENV], os.environ[LAUNCHED_ENV] = str(log_dir), "1"  # inherited by the spawned ranks
    # a stop signal becomes SignalException from now on, as torch's agent makes it (raise_signal)
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main_thread else {}
    for sig in handlers:
        signal.signal(sig, raise_signal)
    done = threading.Event()
    watch = threading.Thread(
        target=_kill_ranks_left_after_an_end, args=(log_dir, done), name="freescale-ending", daemon=True
    )
    watch.start()
    ended: Optional[RuntimeError] = None
    clean = False
    board = mask = None
    try:
        with _meeting(config, log_dir) as board, _quiet_torch_launcher(config.run.verbose):
            try:
                # The ranks start with the stop signals blocked (a thread's mask is inherited through fork and exec),
                # so that one arriving while they import (seconds) waits for their own handling (StopOnSignal)
                # instead of printing a KeyboardInterrupt traceback per rank. This thread keeps them blocked until
                # the agent returns: the watch thread, started before, takes them for the launcher, and Python runs
                # the launcher's handler in this thread all the same. multiprocessing's resource tracker is started
                # first: starting it unblocks them in the thread that does.
                resource_tracker.ensure_running()
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                results = elastic_launch(_launch_config(config, log_dir), worker)(config)
                clean = True
            except ChildFailedError as failure:  # a rank signalled alone (not through the launcher) ends the job too
                ended = interruption(log_dir, config, exitcodes=exitcodes(failure, log_dir)) or job_failure(
                    failure, log_dir, board
                )
            except SignalException as received:  # torch's agent has stopped the ranks, forwarding the signal
                ended = interruption(log_dir, config, signum=received.sigval)
            except RendezvousError as error:
                ended = RankFailed(rendezvous_line(error, config, log_dir, board))
            if board is not None:  # the other hosts' launchers read how this one ended
                board.post_end("ok" if clean else str(ended), root=getattr(ended, "root", False))
    except RendezvousFailed as failure:  # node 0 could not serve the rendezvous
        ended = RankFailed(str(failure))
    finally:
        for sig in handlers:  # the tidying below runs to its end
            signal.signal(sig, signal.SIG_IGN)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        done.set()
        watch.join()
        os.environ.pop(LOG_DIR_ENV, None), os.environ.pop(LAUNCHED_ENV, None)
        remove_rank_segments(log_dir)
        kept = tidy(log_dir, made_here=config.run.log_dir is None, clean=clean)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if ended is not None:
        line = str(ended) + (f"; logs in {log_dir}" if kept and str(log_dir) not in str(ended) else "")
        raise Interrupted(line, ended.signum) if isinstance(ended, Interrupted) else RankFailed(line)
    # keyed by torch's ranks, which are not the job's on several hosts (worker): rank 0 alone returns a summary
    return next((summary for summary in results.values() if summary is not None), None)


_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"  # read by torch when a process loads it: set for ranks yet to start


@contextlib.contextmanager
def _meeting(config: JobConfig, log_dir: Path):
    """A multi-node job's board (pipelines.job.launch.hosts), None on one host: node 0's launcher serves the rendezvous
    store, and every launcher posts its record there for the others; at the end node 0 keeps the store up until
    the other hosts have ended."""
    run = config.run
    if run.nnodes == 1:
        yield None
        return
    from pipelines.job.launch.hosts import HostBoard, ServedStore, wait_for_endpoint

    served = ServedStore(run.rdzv_endpoint, run.comm_timeout_s) if run.node_rank == 0 else None
    if served is None:
        wait_for_endpoint(run.rdzv_endpoint, run.nnodes, run.comm_timeout_s)
    aside = _StderrAside(log_dir / "launcher.log", run.nproc) if not run.verbose else None

    def local_ranks() -> list[int]:
        ranks = sorted(rank_pids(log_dir))
        if aside is not None and len(ranks) == run.nproc:
            aside.start()
        return ranks

    board = HostBoard(run.rdzv_endpoint, run.nnodes, run.node_rank, run.nproc, run.comm_timeout_s, local_ranks)
    board.start()
    # The ranks' store clients print a C++ warning with its stack trace for each call that finds a lost host's store
    # gone (heartbeats, failure diagnoses): on several hosts the ranks keep torch's C++ errors only (--verbose: all).
    quiet = None if run.verbose or _CPP_LOG_LEVEL in os.environ else os.environ.setdefault(_CPP_LOG_LEVEL, "ERROR")
    try:
        yield board
    finally:
        if quiet is not None:
            os.environ.pop(_CPP_LOG_LEVEL, None)
        if served is not None:
            board.linger()
        board.close()
        if served is not None:
            served.close()
        if aside is not None:
            aside.stop()


class _StderrAside:
    """The launcher's own stderr (fd 2), once its ranks run, in ``path``: torch's agent and the store clients of
    this process print C++ warnings with their stack traces there, a page of them when the host serving the
    rendezvous store is lost, which no logger setting quiets (torch reads their level from the environment when it
    is loaded). The ranks, started before, keep the terminal; the launcher's own line comes after ``stop``."""

    def __init__(self, path: Path, nproc: int):
        self.path, self.nproc = path, nproc
        self._saved: Optional[int] = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._saved is not None:
                return
            sys.stderr.flush()
            self._saved = os.dup(2)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 2)
            os.close(fd)

    def stop(self) -> None:
        with self._lock:
            if self._saved is None:
                return
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = None
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()


_ENDING_GRACE_S = 2  # how long a rank is given to end on the launcher's stop signal before it is killed


def _kill_ranks_left_after_an_end(log_dir: Path, done: threading.Event) -> None:
    """Once a rank has reported an error or a stop signal (rank<r>.error, rank<r>.interrupted), kills the ranks still
    running ``_ENDING_GRACE_S`` later. torch's elastic launcher stops the others with SIGTERM after a failure and
    waits 30 s before its SIGKILL, and a rank that does not take it in that time is stopped (SIGSTOP, a debugger) or
    in uninterruptible sleep: the job would end that long after its error line. Only this launcher's own children
    are touched (a pid file left by an earlier job in the same directory may name another process).

    Started before the launcher blocks the stop signals in its main thread (launch): this thread takes them."""
    ended_at = None
    while not done.wait(0.25):
        if ended_at is None:
            if any(next(log_dir.glob(f"rank*.{kind}"), None) for kind in ("error", INTERRUPTED)):
                ended_at = time.monotonic()
            continue
        if time.monotonic() - ended_at < _ENDING_GRACE_S:
            continue
        for pid in rank_pids(log_dir).values():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                if state != "Z" and int(ppid) == os.getpid():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                continue
