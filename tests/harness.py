"""Multi-process test harness: runs a function on N real gloo ranks on CPU, with a timeout that names the rank
and what it was doing, so a hang fails fast instead of eating the CI budget.

    def body(rank, world_size, n):      # module-level, picklable
        doing("all_gather")              # optional: what the rank is doing now, shown if it hangs
        ...
        return something_picklable

    results = run_ranks(body, world_size=2, args=(5,), timeout=60)

Processes come from a forkserver that has imported torch once, so a rank starts in well under a second and no
child inherits a parent's OpenMP pool. Each rank runs with one intra-op thread (2 cores, up to 4 ranks).

A rank that returns from ``fn`` waits at a barrier (on the harness's own store, bounded by the call's ``timeout``)
until every rank has returned, and only then ends its process: otherwise a rank's exit closes connections that a
peer is still making (a ``new_group`` that the peer is still joining fails with "Connection closed by peer").
The communication timeout of the world group and of every fscomm group is the harness's ``timeout``, so a wait
that cannot finish fails within the test's time, never after torch's 30 minutes.

The ranks' folder (``fs-ranks-*``: the store, each rank's ``rankN.doing``) goes when the call returns or raises.

Tests that call it carry the ``multiprocess`` marker (tests/conftest.py fails one that does not).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

_RANKS_DIR_ENV = "FREESCALE_TEST_RANKS_DIR"
_FINISHED_KEY, _RELEASED_KEY = "harness/finished", "harness/released"
ranks_started = 0  # calls of run_ranks in this process (tests/conftest.py checks the marker against it)
_ctx: Optional[mp.context.BaseContext] = None


def _context() -> mp.context.BaseContext:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return _ctx


def doing(name: str) -> None:
    """Records what the calling rank is doing now (read by the parent only when the rank hangs or dies)."""
    d = os.environ.get(_RANKS_DIR_ENV)
    if d is None:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    with open(os.path.join(d, f"rank{rank}.doing"), "w") as f:
        f.write(name)


def _read_doing(ranks_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(ranks_dir, f"rank{rank}.doing")) as f:
            return f.read() or "start"
    except FileNotFoundError:
        return "start (before init_process_group)"


def _barrier_at_exit(store, world_size: int, deadline: float) -> None:
    """Waits until every rank has returned from ``fn``, or until ``deadline`` (then the parent, whose own deadline
    is the same, names the ranks that did not finish; a rank's error ends the run there sooner)."""
    if store.add(_FINISHED_KEY, 1) == world_size:
        store.set(_RELEASED_KEY, "1")
    remaining = max(0.1, deadline + 1.0 - time.time())
    try:
        store.wait([_RELEASED_KEY], datetime.timedelta(seconds=remaining))
    except Exception:  # its result is posted already: what the parent reports is the peer that did not finish
        pass


def _rank_main(
    fn, rank, world_size, args, ranks_dir, store_path, timeout, backend, env, results, deadline: Optional[float] = None
):
    """One rank. ``deadline`` (``time.time()``): where its exit barrier ends; None: no exit barrier (a caller whose
    ranks die on purpose)."""
    os.environ.update(env)
    os.environ.update({_RANKS_DIR_ENV: ranks_dir, "RANK": str(rank), "WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    from fscomm import groups

    torch.set_num_threads(1)
    try:
        doing("init_process_group")
        store = dist.FileStore(store_path, world_size)
        groups.set_comm_timeout(timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        doing("running")
        out = fn(rank, world_size, *args)
        doing("done")
        # Plain pickle (bytes), not the queue's ForkingPickler: that one shares tensors through file
        # descriptors that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
        if deadline is not None:
            _barrier_at_exit(store, world_size, deadline)
    except BaseException:  # carried to the parent as a value, re-raised there with the rank named
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankFailure(RuntimeError):
    pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 60.0,
    backend: str = "gloo",
    env: Optional[dict[str, str]] = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results in rank order.

    Raises RankFailure naming the rank (and its traceback) if any rank raised or died, and TimeoutError naming
    every unfinished rank and what it was doing if the ranks did not all finish within ``timeout`` seconds.
    """
    global ranks_started
    ranks_started += 1
    ctx = _context()
    ranks_dir = tempfile.mkdtemp(prefix="fs-ranks-")
    store_path = os.path.join(ranks_dir, "store")
    results = ctx.Queue()
    base_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    wall_deadline = time.time() + timeout  # the ranks' exit barrier ends with the call's own deadline
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                r,
                world_size,
                tuple(args),
                ranks_dir,
                store_path,
                timeout,
                backend,
                base_env,
                results,
                wall_deadline,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = [f"rank {r} doing '{_read_doing(ranks_dir, r)}'" for r in range(world_size) if r not in outcome]
                raise TimeoutError(f"{fn.__name__}: ranks did not finish within {timeout:.0f} s: " + "; ".join(stuck))
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
                outcome[rank] = (status, payload)
                if status == "error":  # fail fast: the other ranks are likely blocked on this one
                    break
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outcome and not p.is_alive() and p.exitcode not in (None, 0):
                        raise RankFailure(
                            f"{fn.__name__}: rank {r} died with exit code {p.exitcode} "
                            f"while doing '{_read_doing(ranks_dir, r)}'"
                        )
    finally:
        for p in procs:
            p.join(timeout=0.05 if len(outcome) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(ranks_dir, ignore_errors=True)  # the store and the rankN.doing files: read above, if at all
    errors = [(r, tb) for r, (s, tb) in sorted(outcome.items()) if s == "error"]
    if errors:
        r, tb = errors[0]
        raise RankFailure(f"{fn.__name__}: rank {r} raised:\n{tb}")
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
