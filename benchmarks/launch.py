"""How a multi-rank bench runs: on torchrun's ranks when launched under torchrun, else on ``--nproc`` local ranks
spawned here (gloo over a file store); rank 0's result comes back to the launching process.

Failures end as `freescale train`'s do (docs/reliability.md): a rank that raises writes its traceback to
``<log dir>/rank<r>.log`` and its one-line error beside it, then exits; the launcher stops the other ranks, removes
the shared-memory segments its ranks leave (killed ranks run no clean-up), and prints one line naming the rank
where the fault happened and the cause (``benchmarks NAME: error: rank 1: ...``), exit status 1. The log
directory is ``$FREESCALE_LOG_DIR`` when set, else one inside the launcher's temporary folder (``fs-bench-NAME-*``),
which goes when the ranks have ended unless it holds a rank's log (the line names it then). Under torchrun each
failing rank prints its line itself and exits with status 1; the next start's ``fscomm.shm.clean_stale`` removes
what a killed rank left.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from fscomm import groups
from fscomm.shm import remove_segments_of
from pipelines.job.failure_report import LOG_DIR_ENV, report_failure
from pipelines.job.launch.failure import failure_line
from pipelines.job.run.progress import use_thread_locks_for_progress_bars

RankMain = Callable[[Any, int, int], Optional[dict]]  # (args, rank, world_size) -> rank 0's result, else None

# After the first rank fails, how long the others get to end on their own (their peer's connection is gone, so
# they usually fail at once, each with its report) before they are stopped: SIGTERM, then SIGKILL.
_SETTLE_S, _TERM_GRACE_S = 2.0, 5.0


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(
    rank_main: RankMain, args: Any, name: str, env: Optional[dict[str, str]] = None, every_rank: bool = False
) -> Any:
    """Runs ``rank_main`` on every rank; returns rank 0's result (None on torchrun's other ranks), or with
    ``every_rank`` (local ranks only) every rank's result in rank order (any picklable value). ``args`` needs
    ``timeout`` (seconds of the gloo group) and ``nproc`` (local ranks when not under torchrun); ``env``: variables
    the spawned ranks start with, where not set already. A failed rank ends the command with one line on stderr
    and exit status 1 (SystemExit)."""
    timeout = datetime.timedelta(seconds=args.timeout)
    if under_torchrun() and every_rank:
        raise ValueError(f"bench {name}: every rank's result comes back from local ranks only, not under torchrun")
    if under_torchrun():
        use_thread_locks_for_progress_bars()
        groups.set_comm_timeout(args.timeout)
        dist.init_process_group("gloo", timeout=timeout)
        rank = dist.get_rank()
        try:
            result = rank_main(args, rank, dist.get_world_size())
        except Exception as exc:
            _fail(exc, rank, name, os.environ.get(LOG_DIR_ENV), print_line=True)
        dist.destroy_process_group()
        return result
    import multiprocessing as mp

    tmp = os.path.realpath(tempfile.mkdtemp(prefix=f"fs-bench-{name}-"))
    out_path = os.path.join(tmp, "result.json")
    log_dir = Path(os.environ.get(LOG_DIR_ENV) or os.path.join(tmp, "logs")).resolve()  # as the lines name it
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_spawned,
            name=f"bench-{name}-rank{r}",
            args=(
                r,
                args.nproc,
                rank_main,
                args,
                os.path.join(tmp, "store"),
                out_path,
                env or {},
                str(log_dir),
                name,
                every_rank,
            ),
        )
        for r in range(args.nproc)
    ]
    exitcodes = None
    try:
        for p in procs:
            p.start()
        exitcodes = _wait(procs)
        if not exitcodes:
            return _results(out_path, args.nproc, every_rank)
        line = failure_line(exitcodes, log_dir)
    finally:
        _stop(procs)
        remove_segments_of([p.pid for p in procs if p.pid is not None])
        kept = _tidy(Path(tmp), log_dir, clean=exitcodes == {})
    if kept and str(log_dir) not in line:
        line += f"; logs in {log_dir}"
    print(f"benchmarks {name}: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _results(out_path: str, nproc: int, every_rank: bool) -> Any:
    if every_rank:
        results = []
        for r in range(nproc):
            with open(f"{out_path}.rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
    with open(out_path) as f:
        return json.load(f)


def _tidy(tmp: Path, log_dir: Path, clean: bool) -> bool:
    """The launcher's temporary folder (the ranks' store, their results) goes once the ranks have ended; the log
    directory inside it stays only if it holds a rank's log, which the failure line names (returns True). The
    ranks' pid files, read for the failure line and the segments' removal, go after a clean run; after a failure
    they stay beside the logs (a ``$FREESCALE_LOG_DIR`` of the user's keeps them too)."""
    if clean:
        for path in log_dir.glob("rank*.pid"):
            path.unlink(missing_ok=True)
    keep = log_dir.parent == tmp and next(log_dir.glob("rank*.log"), None) is not None
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    for path in tmp.iterdir():
        if path != log_dir:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return True


def _wait(procs) -> dict[int, int]:
    """Waits for every rank; returns the exit codes of the ranks that failed (none: all succeeded). After the first
    failure, the others get ``_SETTLE_S`` to end on their own before they are stopped."""
    failed_at = None
    while True:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if all(c is not None for c in codes.values()):
            return failed
        if failed and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _SETTLE_S:
            _stop(procs)
            return {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        time.sleep(0.05)


def _stop(procs) -> None:
    """Ends the ranks still running: SIGTERM, then SIGKILL after ``_TERM_GRACE_S`` (a stopped process ignores
    SIGTERM)."""
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _fail(exc: BaseException, rank: int, name: str, log_dir: Optional[str], print_line: bool) -> None:
    """Reports a rank's error (traceback to its log, one line beside it) and ends the process: no second traceback
    from the process wrapper, no wait at exit on a peer that is gone."""
    line = report_failure(exc, rank, verbose=False, log_dir=log_dir)
    if print_line:
        print(f"benchmarks {name}: error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _spawned(
    rank: int,
    world: int,
    rank_main: RankMain,
    args: Any,
    store_path: str,
    out_path: str,
    env: dict[str, str],
    log_dir: str,
    name: str,
    every_rank: bool = False,
) -> None:
    for key, value in env.items():
        os.environ.setdefault(key, value)
    use_thread_locks_for_progress_bars()
    # which process is which rank: the launcher's report finds a rank that died without a word by its missing line
    (Path(log_dir) / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
    try:
        groups.set_comm_timeout(args.timeout)
        with _cpp_stderr_to(Path(log_dir) / f"rank{rank}.init.stderr"):
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(store_path, world),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=args.timeout),
            )
        result = rank_main(args, rank, world)
        if every_rank:
            with open(f"{out_path}.rank{rank}.pkl", "wb") as f:
                pickle.dump(result, f)
        elif rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    except Exception as exc:
        _fail(exc, rank, name, log_dir, print_line=False)
    dist.destroy_process_group()


@contextlib.contextmanager
def _cpp_stderr_to(path: Path):
    """The process's stderr (file descriptor 2) into ``path`` for the block, removed if it stays empty: gloo's C++
    logs a line of its own when a peer that has already failed drops out of the connection mesh, which would
    stand beside the launcher's one line; the exception that follows it carries the cause."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()


def write_json(result: Any, path: Optional[str]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
