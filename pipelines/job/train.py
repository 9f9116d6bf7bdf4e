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

Signals. SIGTERM, SIGINT (Ctrl-C, which reaches every process of the group) and SIGHUP end the job in one line naming
the step the ranks had reached and the newest complete checkpoint, exit status 128 + the signal: each rank reports
its step and ends at once (``_StopOnSignal``), and the launcher prints the line (under torchrun, each rank its own).
So at any moment, set-up included: a rank that has not ended 2 s after the signal is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pipelines.job.config import JobConfig
from pipelines.job.failure import LOG_DIR_ENV, report_failure
from pipelines.job.flags import add_config_arguments, config_from_args, ignored_option_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_LAUNCHED_ENV = "FREESCALE_LAUNCHED"  # the ranks of `freescale train` (not torchrun's): the launcher prints the line


class RankFailed(RuntimeError):
    """A rank of `freescale train` failed; the message is the one line the user sees."""


# What ends a job from outside: a scheduler's SIGTERM, Ctrl-C's SIGINT, a closed terminal's SIGHUP. The launcher
# (torch's elastic agent) forwards the signal it gets to the ranks.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_INTERRUPTED = "interrupted"  # a rank's report of the signal that ended it: rank<r>.interrupted in the log directory


class Interrupted(RuntimeError):
    """The job ended on a signal: the message is the one line the user sees; exit status 128 + ``signum``, as a
    shell reports a process that a signal ended."""

    def __init__(self, line: str, signum: int) -> None:
        super().__init__(line)
        self.signum = signum


def last_checkpoint(checkpoint_dir: Optional[str]) -> str:
    """Where a resume of an interrupted job starts, as its line says it."""
    if not checkpoint_dir:
        return "no checkpoint"
    from pipelines.job import checkpoint  # seconds to load on a busy host: check_before_launch loads it first

    newest = checkpoint.latest(checkpoint_dir)
    return f"last complete checkpoint step {int(newest.name.removeprefix('step_'))}" if newest else "no checkpoint"


def interrupted_line(what: str, step: Optional[int], checkpoint_dir: Optional[str]) -> str:
    """``what``: the signal's name (and the ranks it reached, when not every one); ``step``: the steps complete on
    every rank, None before the first (set-up, a checkpoint's restore)."""
    at = "during set-up" if step is None else f"at step {step}"
    return f"interrupted ({what}) {at}; {last_checkpoint(checkpoint_dir)}"


class _StopOnSignal:
    """A rank's end on a stop signal: it reports the step it had reached (for the launcher's line; under torchrun it
    prints its own), unlinks its shared-memory segments and exits at once with 128 + the signal. At once, not by
    unwinding: the unwinding's waits (the loader's item in flight, a collective) would wait on peers that are ending
    too, and a rank's error report would follow.

    The signals are taken by a thread of their own (``signal.sigwait``; they are blocked in every other thread), not
    by a Python handler: Python runs a handler in the main thread between two bytecodes, so a main thread inside a
    collective in C++ code, waiting on a peer that has gone, would take it only when the collective times out. The
    handler stays installed for the threads that were started before the signals were blocked (under torchrun)."""

    def __init__(self, rank: int, config: JobConfig) -> None:
        self.rank, self.config = rank, config
        self.trainer = None  # once built: its step counter is the step the report names
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
            return
        self._previous = {sig: signal.signal(sig, self) for sig in STOP_SIGNALS}
        # under `freescale train` the rank started with them blocked (launch): one that came while it set up is
        # pending, and the thread takes it now
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        threading.Thread(target=self._wait, name="freescale-stop-signals", daemon=True).start()

    def _wait(self) -> None:
        signum = signal.sigwait(STOP_SIGNALS)
        self(signum, None)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __call__(self, signum: int, frame) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:  # the launcher forwards the signal it got too: this rank is ending already
                signal.signal(sig, signal.SIG_IGN)
        try:
            self._report(signal.Signals(signum).name, getattr(self.trainer, "step", None))
        finally:
            os._exit(128 + signum)

    def _report(self, name: str, step: Optional[int]) -> None:
        if os.environ.get(_LAUNCHED_ENV) == "1":  # the launcher reads it, prints the line and removes it
            report = json.dumps({"rank": self.rank, "signal": name, "step": step})
            (Path(os.environ[LOG_DIR_ENV]) / f"rank{self.rank}.{_INTERRUPTED}").write_text(report)
        else:
            line = interrupted_line(name, step, self.config.checkpoint.dir)
            # os.write, not print: the interrupted main thread may hold sys.stderr's lock
            os.write(2, f"freescale train: rank {self.rank}: {line}\n".encode())
        from fscomm.shm import remove_own_segments

        remove_own_segments()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, RuntimeError, ValueError):  # held by the interrupted thread, or closed
                pass


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


def use_thread_locks_for_progress_bars() -> None:
    """tqdm's bars take a multiprocessing lock by default: a POSIX semaphore registered with the launcher's
    resource tracker, released only by the process's clean-up at exit. A rank that ends without it (``os._exit``
    after its error, a kill) leaves it registered, and the tracker then warns at the launcher's exit about a
    "leaked semaphore" that the user cannot act on. A rank's bars are drawn by its own threads: a thread lock does."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker(config: JobConfig) -> Optional[dict]:
    """One rank's job. Returns the run summary on rank 0 (None elsewhere).

    An error ends the rank with one line (see the module docstring): under `freescale train` the launcher prints
    it; under torchrun the rank prints it itself and exits with status 1."""
    if os.environ.get(_LAUNCHED_ENV) == "1" and config.run.nnodes > 1:  # ranks follow --node-rank, not torch's order
        from pipelines.job.nodes import rank_offset

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
    stop = _StopOnSignal(rank, config)
    stop.install()
    try:
        summary = _rank_job(config, stop)
    except Exception as exc:
        line = report_failure(exc, rank, config.run.verbose, config.run.log_dir)
        if os.environ.get(_LAUNCHED_ENV) != "1":
            print(f"freescale train: error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no second traceback from the process wrapper, no hang in a peer's collective at exit
    stop.uninstall()
    return summary


def _rank_job(config: JobConfig, stop: _StopOnSignal) -> Optional[dict]:
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
    if use_cuda and config.tuning.numa_binding is not None and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        print(
            f"[freescale] rank {rank} on {device}: {len(cpus)} CPUs ({cpus[0]}-{cpus[-1]}), "
            f"numa_binding={config.tuning.numa_binding}"
        )
    # 2 ranks on 2 cores must not each start a pool of 2 threads: split the cores between local ranks. On a GPU
    # the pool only runs small host ops; a large one crowds out the loader and exchange threads and stalls
    # single ops by milliseconds.
    share = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(config.tuning.threads or (min(2, share) if use_cuda else share))
    if not use_cuda:
        # oneDNN JIT-compiles and caches (up to 1,024 entries) a GELU kernel per input shape, 0.1-1 MB resident
        # each; jagged batches bring unseen shapes for as long as the job runs, so a CPU rank's resident memory
        # kept growing. ATen's own CPU kernels keep nothing per shape and are as fast here.
        torch.backends.mkldnn.enabled = False
    # Several Python threads per rank (loader stages, exchange workers, the embedding chains): a thread that
    # needs the GIL waits up to the switch interval for it (Python's default is 5 ms), a gap in the model
    # thread. --tuning.gil-switch-ms bounds that wait.
    sys.setswitchinterval(config.tuning.gil_switch_ms / 1e3)
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
            if _is_timeout(exc):
                step = f"step {trainer.step}" if trainer is not None else "set-up"
                raise CommTimeout(
                    f"a collective in {_where(exc)} timed out after {timeout_s:g} s (--comm-timeout-s) at {step}; "
                    f"other ranks: {heartbeat.diagnose()}; backend said: {' '.join(str(exc).split())[:300]}"
                ) from exc
            raise
        trainer.close()  # on success only: after a failure a peer may be gone, and the process ends anyway
    dist.destroy_process_group()
    return summary


class CommTimeout(RuntimeError):
    """A collective or a hand-over between ranks exceeded the communication timeout."""


def _is_timeout(exc: BaseException) -> bool:
    while exc is not None:
        text = str(exc).lower()
        text = text.replace("group timeout", "")  # fscomm's errors name the group's timeout, whatever happened
        if isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
            return True
        exc = exc.__cause__
    return False


def _where(exc: BaseException) -> str:
    """The innermost frame of FreeScale's own code in the traceback: the collective's call site."""
    root = Path(__file__).resolve().parents[1]
    site = None
    while exc is not None:
        for frame in traceback.extract_tb(exc.__traceback__):
            path = Path(frame.filename).resolve()
            parts = path.relative_to(root).parts if root in path.parents else ()
            if parts and "tests" not in parts and "site-packages" not in parts:  # a venv may live in the tree
                site = f"{frame.name} ({path.relative_to(root)}:{frame.lineno})"
        exc = exc.__cause__
    return site or "an unknown place"


def _numa_options(config: JobConfig):
    """torch's NUMA binding for a GPU run (local rank r bound near GPU r), or None (CPU runs, or not asked for)."""
    mode = config.tuning.numa_binding
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
                "is_host": False,  # node 0's launcher serves the store (pipelines.job.nodes.ServedStore)
                "join_timeout": run.comm_timeout_s,
                "read_timeout": run.comm_timeout_s,
            },
        )
    return LaunchConfig(
        min_nodes=run.nnodes,
        max_nodes=run.nnodes,
        nproc_per_node=run.nproc,
        **{"run_id": f"freescale-{uuid.uuid4().hex[:8]}", "rdzv_endpoint": "localhost:0", **nodes},
        rdzv_backend="c10d",
        max_restarts=0,
        monitor_interval=0.2,
        shutdown_timeout=_ENDING_GRACE_S,  # after a stop signal: a rank still setting up takes it later (launch)
        # torch's agent would raise on these at once, also while it spawns a rank: the launcher's own handler
        # (_raise_signal) keeps the stop signals, torch's SIGQUIT
        signals_to_handle="SIGQUIT",
        start_method="spawn",
        numa_options=_numa_options(config),
        # torch's launcher keeps its own per-run folder: under ours, so that it goes with ours
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "torchelastic")),
    )


@contextlib.contextmanager
def _quiet_torch_launcher(verbose: bool):
    """Silences torch's launcher: its failure report is a page long, and a signal adds a line per rank it stops;
    the one line of ours says what happened. Each of its loggers is set, not their parent: torch sets every one's
    own level when it makes it ($LOGLEVEL, else WARNING), which a parent's level does not override."""
    if verbose:
        yield
        return
    sys.unraisablehook = _without_agent_thread_join(sys.unraisablehook)
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


def _without_agent_thread_join(hook):
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


class _SignalBeforeLaunch(BaseException):
    """A stop signal while the launcher checks the job, before any rank starts. A BaseException, as
    KeyboardInterrupt is: no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def _stop_signals_before_launch():
    """The stop signals as ``_SignalBeforeLaunch`` while the launcher checks the job (launch takes over after)."""

    def stop(signum: int, frame) -> None:
        raise _SignalBeforeLaunch(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_signal(signum: int, frame) -> None:
    """What torch's agent does with a stop signal (the launcher catches it), except while the agent spawns the ranks:
    raised there, it would leave a rank half started (it prints an EOFError traceback of its own) or started but
    unknown to the agent, which then stops only the others. The signal is sent again 50 ms later instead."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    while frame is not None:
        code = frame.f_code
        if code.co_name == "start_processes" and Path(code.co_filename).match("multiprocessing/spawn.py"):
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))


def launch(config: JobConfig) -> Optional[dict]:
    """Runs ``worker`` on ``config.run.nproc`` local ranks with torch's elastic launcher (on each of ``run.nnodes``
    hosts, which meet at ``run.rdzv_endpoint``); rank 0's summary (None on the hosts without rank 0).
    Raises RankFailed (a rank failed, a host was lost, the hosts did not meet) or Interrupted (a signal ended the
    job), each with its one line, which names the log directory when a temporary one stays (it holds the ranks'
    logs)."""
    from multiprocessing import resource_tracker

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from pipelines.job import log_dirs
    from pipelines.job.nodes import RendezvousFailed

    log_dir = Path(config.run.log_dir).resolve() if config.run.log_dir else log_dirs.make()  # as lines name it
    os.environ[LOG_DIR_ENV], os.environ[_LAUNCHED_ENV] = str(log_dir), "1"  # inherited by the spawned ranks
    # a stop signal becomes SignalException from now on, as torch's agent makes it (_raise_signal)
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main_thread else {}
    for sig in handlers:
        signal.signal(sig, _raise_signal)
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
                # so that one arriving while they import (seconds) waits for their own handling (_StopOnSignal)
                # instead of printing a KeyboardInterrupt traceback per rank. This thread keeps them blocked until
                # the agent returns: the watch thread, started before, takes them for the launcher, and Python runs
                # the launcher's handler in this thread all the same. multiprocessing's resource tracker is started
                # first: starting it unblocks them in the thread that does.
                resource_tracker.ensure_running()
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                results = elastic_launch(_launch_config(config, log_dir), worker)(config)
                clean = True
            except ChildFailedError as failure:  # a rank signalled alone (not through the launcher) ends the job too
                ended = _interruption(log_dir, config, exitcodes=_exitcodes(failure, log_dir)) or _failed(
                    failure, log_dir, board
                )
            except SignalException as received:  # torch's agent has stopped the ranks, forwarding the signal
                ended = _interruption(log_dir, config, signum=received.sigval)
            except RendezvousError as error:
                ended = RankFailed(_rendezvous_line(error, config, log_dir, board))
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
        os.environ.pop(LOG_DIR_ENV, None), os.environ.pop(_LAUNCHED_ENV, None)
        remove_rank_segments(log_dir)
        kept = _tidy_log_dir(log_dir, made_here=config.run.log_dir is None, clean=clean)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if ended is not None:
        line = str(ended) + (f"; logs in {log_dir}" if kept and str(log_dir) not in str(ended) else "")
        raise Interrupted(line, ended.signum) if isinstance(ended, Interrupted) else RankFailed(line)
    # keyed by torch's ranks, which are not the job's on several hosts (worker): rank 0 alone returns a summary
    return next((summary for summary in results.values() if summary is not None), None)


def _exitcodes(failure, log_dir: Path) -> dict[int, int]:
    """The exit codes of the ranks torch's agent saw fail, by the job's rank: torch's agent numbers the ranks in its
    own order of the hosts, the job by ``--node-rank`` (worker); the pid files say which process is which rank."""
    ranks = {pid: rank for rank, pid in rank_pids(log_dir).items()}
    return {ranks.get(f.pid, rank): f.exitcode for rank, f in failure.failures.items()}


_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"  # read by torch when a process loads it: set for ranks yet to start


@contextlib.contextmanager
def _meeting(config: JobConfig, log_dir: Path):
    """A multi-node job's board (pipelines.job.nodes), None on one host: node 0's launcher serves the rendezvous
    store, and every launcher posts its record there for the others; at the end node 0 keeps the store up until
    the other hosts have ended."""
    run = config.run
    if run.nnodes == 1:
        yield None
        return
    from pipelines.job.nodes import NodeBoard, ServedStore, wait_for_endpoint

    served = ServedStore(run.rdzv_endpoint, run.comm_timeout_s) if run.node_rank == 0 else None
    if served is None:
        wait_for_endpoint(run.rdzv_endpoint, run.nnodes, run.comm_timeout_s)
    aside = _StderrAside(log_dir / "launcher.log", run.nproc) if not run.verbose else None

    def local_ranks() -> list[int]:
        ranks = sorted(rank_pids(log_dir))
        if aside is not None and len(ranks) == run.nproc:
            aside.start()
        return ranks

    board = NodeBoard(run.rdzv_endpoint, run.nnodes, run.node_rank, run.nproc, run.comm_timeout_s, local_ranks)
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


def _failed(failure, log_dir: Path, board) -> RankFailed:
    """The job's failure in one line. On several hosts, when the failure began elsewhere: the host lost (its ranks
    ended this host's through their closed connections), else the failure line of the host where it began."""
    reports = _reports(log_dir, "error")
    local_root = any(r["root"] for r in reports)
    lost, began_elsewhere = board.verdict() if board is not None else (None, None)
    local = sorted(rank_pids(log_dir))
    after = f"; this host's rank(s) {local} ended after it"
    if lost:
        return RankFailed(lost + after)
    if began_elsewhere and not local_root:
        return RankFailed(began_elsewhere + after)
    failed = RankFailed(_failure_line(failure, log_dir))
    failed.root = local_root
    return failed


def _rendezvous_line(error, config: JobConfig, log_dir: Path, board) -> str:
    """The hosts did not meet at the endpoint: why, and how many of them did; or, once the ranks ran, the store's
    host was lost (torch's agent finds its store gone before its ranks fail)."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    run = config.run
    local = sorted(rank_pids(log_dir))
    if local and board is not None:
        lost, _ = board.verdict()
        if lost:
            return f"{lost}; this host's rank(s) {local} ended after it"
    where = f"at {run.rdzv_endpoint} (--rdzv-endpoint)"
    joined = board.joined_line() if board is not None else "unknown how many joined"
    if isinstance(error, RendezvousTimeoutError):
        return f"the hosts did not meet {where} within {run.comm_timeout_s:g} s (--comm-timeout-s): {joined}"
    if isinstance(error, RendezvousClosedError) and not local:  # the host that timed out first closed it for all
        return (
            f"the hosts did not meet {where}: another host closed the rendezvous when its {run.comm_timeout_s:g} s "
            f"(--comm-timeout-s) ran out; {joined}"
        )
    if isinstance(error, RendezvousConnectionError) and not local:
        return (
            f"no rendezvous answered {where} within {run.comm_timeout_s:g} s (--comm-timeout-s): node 0, which "
            f"serves it, has not started or the address is not its own; {joined}"
        )
    said = " ".join(str(error).split())[:300]
    return f"the rendezvous {where} failed: {type(error).__name__}: {said}; {joined}"


def _reports(log_dir: Path, kind: str) -> list[dict]:
    """The ranks' reports of one kind (``rank<r>.error``, ``rank<r>.interrupted``) in ``log_dir``."""
    reports = []
    for path in sorted(log_dir.glob(f"rank*.{kind}")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def _interruption(
    log_dir: Path, config: JobConfig, signum: Optional[int] = None, exitcodes: Optional[dict[int, int]] = None
) -> Optional[Interrupted]:
    """The job's end on a signal, from the ranks' reports of the step each had reached. ``signum``: the signal the
    launcher got (torch's agent forwarded it to every rank). Else ``exitcodes``: the ranks the launcher saw fail
    first; those that ended on a signal (sent to them alone) ended the job. The ranks that the agent stopped after
    a failure report its SIGTERM too, but ended nothing: with no rank of the first that ended on a signal, it was
    a failure (None). The reports are read once: they go."""
    reports = _reports(log_dir, _INTERRUPTED)
    for path in log_dir.glob(f"rank*.{_INTERRUPTED}"):
        path.unlink(missing_ok=True)
    steps = [r["step"] for r in reports if r["step"] is not None]
    if signum is not None:
        what = signal.Signals(signum).name
    else:
        first = [r for r in reports if (exitcodes or {}).get(r["rank"]) == 128 + signal.Signals[r["signal"]]]
        if not first:
            return None
        names = sorted({r["signal"] for r in first})
        ranks = sorted(r["rank"] for r in first)
        signum = signal.Signals[names[0]]
        every = len(names) == 1 and len(ranks) == config.run.nproc
        what = names[0] if every else f"{', '.join(names)} to rank(s) {ranks}"
    return Interrupted(interrupted_line(what, min(steps) if steps else None, config.checkpoint.dir), signum)


def _tidy_log_dir(log_dir: Path, made_here: bool, clean: bool) -> bool:
    """The ranks' pid files are the launcher's to read while the job runs (segments, stopped ranks, the failure
    line): after a clean run they go, and a temporary directory made here goes with them. After a failure or a
    signal a temporary directory stays only if it holds a rank's log (then the line names it: returns True), with
    the pid files beside it; a ``--log-dir`` of the user's keeps the logs and pid files the ranks wrote."""
    if clean:
        for path in log_dir.glob("rank*.pid"):
            path.unlink(missing_ok=True)
    if not made_here:
        return False
    if clean or next(log_dir.glob("rank*.log"), None) is None:
        shutil.rmtree(log_dir, ignore_errors=True)
        return False
    from pipelines.job import log_dirs

    log_dirs.unmark(log_dir)  # kept for the user, whom the line tells: no later launcher removes it
    return True


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
            if any(next(log_dir.glob(f"rank*.{kind}"), None) for kind in ("error", _INTERRUPTED)):
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


def rank_pids(log_dir: Path) -> dict[int, int]:
    """The process id each rank left in ``log_dir`` (``rank<r>.pid``) when it started."""
    pids = {}
    for path in log_dir.glob("rank*.pid"):
        try:
            pids[int(path.stem[4:])] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return pids


def remove_rank_segments(log_dir: Path) -> list[str]:
    """Unlinks the shared-memory segments of the job's ranks (their names carry the owner's pid) once they have
    exited: a rank that was killed, or ended by the launcher after a peer failed, ran no clean-up."""
    from fscomm.shm import remove_segments_of

    return remove_segments_of(list(rank_pids(log_dir).values()))


def _failure_line(failure, log_dir: Path) -> str:
    return failure_line(_exitcodes(failure, log_dir), log_dir)


def failure_line(exitcodes: dict[int, int], log_dir: Path) -> str:
    """The one line naming the rank where the job failed and why, from the ranks' reports in ``log_dir`` and the
    exit codes of the ranks the launcher saw fail (negative: the signal): a rank's own report of the fault, else a
    rank that died without one (killed, out of memory), else the reports of ranks that failed because of another."""
    reports = _reports(log_dir, "error")
    reported = {r["rank"] for r in reports}
    roots = [r for r in reports if r["root"]]
    if roots:
        first = min(roots, key=lambda r: r["rank"])
        others = sorted(reported - {first["rank"]})
        return first["line"] + (f"; rank(s) {others} failed after it" if others else "")
    died = []
    for rank, code in sorted(exitcodes.items()):
        if rank in reported or code == -signal.SIGTERM:  # SIGTERM: the launcher stopping the others
            continue
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        died.append(f"rank {rank} died ({how})")
    if not died and reports:  # the launcher saw only the ranks that failed after it: find it by its missing report
        started = {int(p.stem[4:]) for p in log_dir.glob("rank*.pid") if p.stem[4:].isdigit()}
        died = [f"rank {rank} died" for rank in sorted(started - reported)]
    if died:
        line = "; ".join(died) + " without an error of its own (killed, out of memory, or a crash in native code)"
        return line + (f"; rank(s) {sorted(reported)} failed after it" if reported else "")
    if reports:
        return min(reports, key=lambda r: r["rank"])["line"]
    return "; ".join(f"rank {rank} ended with exit code {code}" for rank, code in sorted(exitcodes.items()))


def check_before_launch(config: JobConfig) -> None:
    """What can be checked before any rank starts, so that a bad path or file is one line, not N ranks' errors:
    the Parquet files' footers and schema, that they hold samples (and, with --drop-bad-samples, one that is kept),
    the held-out data's widths and columns against the training data's, an explicit checkpoint directory."""
    if config.data.path != "synthetic":
        from fsdata.parquet import ParquetSource

        source = ParquetSource(
            config.data.path,
            uih_cap=config.data.uih_cap,  # footers only: no data is read
            drop_bad_samples=config.data.drop_bad_samples,
        )
        if config.data.drop_bad_samples and source.first_kept_sample() is None:  # reads until a sound sample
            raise ValueError(
                f"{config.data.path}: no samples left: every one of its {source.num_samples(0)} samples "
                "has bad values, and --drop-bad-samples leaves them out"
            )
    if config.data.eval_path is not None:  # its footers and schema, and the widths and columns the model reads
        from pipelines.job.data_check import check_eval_data

        check_eval_data(config.data, config.data.batch_size * config.run.nproc * config.run.nnodes)
    resume = config.checkpoint.resume
    if resume and resume != "latest":
        from pipelines.job import checkpoint

        for r in range(checkpoint.check_complete(resume)):  # weights-only reads of checked bytes: refuses unsafe files
            checkpoint.read_file(Path(resume) / f"rank{r}.pt")
    # one job per folder: a second job is refused here, before its ranks start. On several hosts rank 0 alone holds
    # it (its launcher may be on any host, so no launcher's lock can be the one rank 0 expects from its parent)
    if config.checkpoint.dir:  # loaded now, not in the seconds after a stop signal, whose line names the newest step
        from pipelines.job import checkpoint  # noqa: F401
    if config.checkpoint.dir and config.run.nnodes == 1:
        from pipelines.job import checkpoint_lock

        checkpoint_lock.hold(config.checkpoint.dir, "launcher")


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
        from pipelines.job.schedule import describe_choice

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


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    for warning in ignored_option_lines(config):
        print(f"[freescale] warning: {warning}", file=sys.stderr)
    if _under_launcher():
        summary = worker(config)
    else:
        try:
            with _stop_signals_before_launch():
                check_before_launch(config)
        except _SignalBeforeLaunch as stop:
            print(f"freescale train: {interrupted_line(stop.name, None, config.checkpoint.dir)}", file=sys.stderr)
            return 128 + stop.signum
        try:
            summary = launch(config)
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
