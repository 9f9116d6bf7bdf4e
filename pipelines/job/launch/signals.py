"""How a job ends on a stop signal: SIGTERM (a job manager), SIGINT (Ctrl-C, which reaches every process of the group)
and SIGHUP (a closed terminal) end it in one line naming the step the ranks had reached and the newest complete
checkpoint, exit status 128 + the signal. Each rank reports its step and ends at once (:class:`StopOnSignal`), and the
launcher prints the line from the ranks' reports (:func:`interruption`; under torchrun each rank prints its own). So
at any moment, set-up included: a rank that has not ended 2 s after the signal is killed (launcher.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pipelines.job.failure_report import LAUNCHED_ENV, LOG_DIR_ENV
from pipelines.job.launch.failure import rank_reports

if TYPE_CHECKING:
    from pipelines.job.config import JobConfig


# What ends a job from outside: a job manager's SIGTERM, Ctrl-C's SIGINT, a closed terminal's SIGHUP. The launcher
# (torch's elastic agent) forwards the signal it gets to the ranks.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


INTERRUPTED = "interrupted"  # a rank's report of the signal that ended it: rank<r>.interrupted in the log directory


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
    from pipelines.job.checkpoint import (
        checkpointer,
    )  # seconds to load on a busy host: check_before_launch loads it first

    newest = checkpointer.latest(checkpoint_dir)
    return f"last complete checkpoint step {int(newest.name.removeprefix('step_'))}" if newest else "no checkpoint"


def interrupted_line(what: str, step: Optional[int], checkpoint_dir: Optional[str]) -> str:
    """``what``: the signal's name (and the ranks it reached, when not every one); ``step``: the steps complete on
    every rank, None before the first (set-up, a checkpoint's restore)."""
    at = "during set-up" if step is None else f"at step {step}"
    return f"interrupted ({what}) {at}; {last_checkpoint(checkpoint_dir)}"


class StopOnSignal:
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
        if os.environ.get(LAUNCHED_ENV) == "1":  # the launcher reads it, prints the line and removes it
            report = json.dumps({"rank": self.rank, "signal": name, "step": step})
            (Path(os.environ[LOG_DIR_ENV]) / f"rank{self.rank}.{INTERRUPTED}").write_text(report)
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


class SignalBeforeLaunch(BaseException):
    """A stop signal while the launcher checks the job, before any rank starts. A BaseException, as
    KeyboardInterrupt is: no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def stop_signals_before_launch():
    """The stop signals as ``SignalBeforeLaunch`` while the launcher checks the job (launch takes over after)."""

    def stop(signum: int, frame) -> None:
        raise SignalBeforeLaunch(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_signal(signum: int, frame) -> None:
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


def interruption(
    log_dir: Path, config: JobConfig, signum: Optional[int] = None, exitcodes: Optional[dict[int, int]] = None
) -> Optional[Interrupted]:
    """The job's end on a signal, from the ranks' reports of the step each had reached. ``signum``: the signal the
    launcher got (torch's agent forwarded it to every rank). Else ``exitcodes``: the ranks the launcher saw fail
    first; those that ended on a signal (sent to them alone) ended the job. The ranks that the agent stopped after
    a failure report its SIGTERM too, but ended nothing: with no rank of the first that ended on a signal, it was
    a failure (None). The reports are read once: they go."""
    reports = rank_reports(log_dir, INTERRUPTED)
    for path in log_dir.glob(f"rank*.{INTERRUPTED}"):
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
