"""Progress output of a long job: tqdm's bar on a terminal, plain lines in a file.

A bar redraws itself with carriage returns, which a log file keeps as one ever longer line (tens of KB for a few
hundred steps). When the stream is not a terminal, :class:`PlainProgress` prints one line every ``every`` steps
or ``seconds`` seconds, whichever comes first, and at the end, with the same figures the bar shows.

The rate is training steps per second of training: time spent inside :func:`paused` (the held-out evaluation)
is left out of it, and a plain line says how much of its elapsed time that was.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterator, Optional, TextIO


class PlainProgress:
    """tqdm's interface as far as the trainer uses it (update, set_postfix, write, close), as plain lines."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "",
        stream: Optional[TextIO] = None,
        every: Optional[int] = None,
        seconds: float = 30.0,
    ) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.stream = stream if stream is not None else sys.stderr
        self.every = every if every is not None else max(1, (total - initial) // 20)
        self.seconds = seconds
        self._start = self._last = time.monotonic()
        self._postfix = ""
        self._printed = self._initial = initial
        self.paused_s = 0.0  # time spent in paused(): not training, so not in the rate

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` of the elapsed time out of the rate."""
        self.paused_s += seconds

    def set_postfix(self, **values) -> None:
        self._postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n - self._printed >= self.every or now - self._last >= self.seconds or self.n >= self.total:
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self._start
        training, done = elapsed - self.paused_s, self.n - self._initial
        rate = f", {done / training:.2f} steps/s" if training > 0 and done > 0 else ""
        paused = f", {self.paused_s:.0f} s of it held-out evaluation" if self.paused_s >= 0.5 else ""
        postfix = f", {self._postfix}" if self._postfix else ""
        print(
            f"{self.desc}: step {self.n}/{self.total}{postfix} ({elapsed:.0f} s{paused}{rate})",
            file=self.stream,
            flush=True,
        )
        self._printed, self._last = self.n, now

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.n != self._printed:
            self._line(time.monotonic())


@contextlib.contextmanager
def paused(bar) -> Iterator[None]:
    """Leaves the time inside the block out of ``bar``'s rate (None: no bar). tqdm's bar is moved on by it, as its
    own ``unpause`` does for the time since its last print, so its rate and its smoothed rate skip the block."""
    started = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - started
        if isinstance(bar, PlainProgress):
            bar.exclude(seconds)
        elif bar is not None:
            bar.start_t += seconds
            bar.last_print_t += seconds


def progress_bar(total: int, initial: int = 0, desc: str = "", unit: str = "step"):
    """tqdm's bar where stderr is a terminal, else :class:`PlainProgress`."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit)
    return PlainProgress(total, initial, desc)


def use_thread_locks_for_progress_bars() -> None:
    """tqdm's bars take a multiprocessing lock by default: a POSIX semaphore registered with the launcher's
    resource tracker, released only by the process's clean-up at exit. A rank that ends without it (``os._exit``
    after its error, a kill) leaves it registered, and the tracker then warns at the launcher's exit about a
    "leaked semaphore" that the user cannot act on. A rank's bars are drawn by its own threads: a thread lock does."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def job_progress_bar(run: Any, rank: int, step: int, world_size: int):
    """A job's bar (``run``: its ``[run]`` section), on rank 0 with ``run.progress`` only; from ``step`` to
    ``run.steps``."""
    if rank != 0 or not run.progress:
        return None
    return progress_bar(run.steps, step, f"train {run.mode} ({world_size} ranks)")
