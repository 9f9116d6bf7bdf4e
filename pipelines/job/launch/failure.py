"""The job's one failure line, made from its ranks' reports.

A failed rank writes its traceback to ``<log dir>/rank<r>.log`` and its one line to ``rank<r>.error``
(pipelines.job.failure_report); the launcher reads them to print the job's one line (:func:`failure_line`,
docs/reliability.md)."""

from __future__ import annotations

import json
import signal
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.job.launch.log_dirs import rank_pids

if TYPE_CHECKING:
    from pipelines.job.config import JobConfig


class RankFailed(RuntimeError):
    """A rank of `freescale train` failed; the message is the one line the user sees."""


class CommTimeout(RuntimeError):
    """A collective or a hand-over between ranks exceeded the communication timeout."""


def is_timeout(exc: BaseException) -> bool:
    while exc is not None:
        text = str(exc).lower()
        text = text.replace("group timeout", "")  # fscomm's errors name the group's timeout, whatever happened
        if isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
            return True
        exc = exc.__cause__
    return False


def call_site(exc: BaseException) -> str:
    """The innermost frame of FreeScale's own code in the traceback: the collective's call site."""
    root = Path(__file__).resolve().parents[2]
    site = None
    while exc is not None:
        for frame in traceback.extract_tb(exc.__traceback__):
            path = Path(frame.filename).resolve()
            parts = path.relative_to(root).parts if root in path.parents else ()
            if parts and "tests" not in parts and "site-packages" not in parts:  # a venv may live in the tree
                site = f"{frame.name} ({path.relative_to(root)}:{frame.lineno})"
        exc = exc.__cause__
    return site or "an unknown place"


def rank_reports(log_dir: Path, kind: str) -> list[dict]:
    """The ranks' reports of one kind (``rank<r>.error``, ``rank<r>.interrupted``) in ``log_dir``."""
    reports = []
    for path in sorted(log_dir.glob(f"rank*.{kind}")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def job_failure(failure, log_dir: Path, board) -> RankFailed:
    """The job's failure in one line. On several hosts, when the failure began elsewhere: the host lost (its ranks
    ended this host's through their closed connections), else the failure line of the host where it began."""
    reports = rank_reports(log_dir, "error")
    local_root = any(r["root"] for r in reports)
    lost, began_elsewhere = board.verdict() if board is not None else (None, None)
    local = sorted(rank_pids(log_dir))
    after = f"; this host's rank(s) {local} ended after it"
    if lost:
        return RankFailed(lost + after)
    if began_elsewhere and not local_root:
        return RankFailed(began_elsewhere + after)
    failed = RankFailed(child_failure_line(failure, log_dir))
    failed.root = local_root
    return failed


def rendezvous_line(error, config: JobConfig, log_dir: Path, board) -> str:
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


def exitcodes(failure, log_dir: Path) -> dict[int, int]:
    """The exit codes of the ranks torch's agent saw fail, by the job's rank: torch's agent numbers the ranks in its
    own order of the hosts, the job by ``--node-rank`` (worker); the pid files say which process is which rank."""
    ranks = {pid: rank for rank, pid in rank_pids(log_dir).items()}
    return {ranks.get(f.pid, rank): f.exitcode for rank, f in failure.failures.items()}


def child_failure_line(failure, log_dir: Path) -> str:
    return failure_line(exitcodes(failure, log_dir), log_dir)


def failure_line(exitcodes: dict[int, int], log_dir: Path) -> str:
    """The one line naming the rank where the job failed and why, from the ranks' reports in ``log_dir`` and the
    exit codes of the ranks the launcher saw fail (negative: the signal): a rank's own report of the fault, else a
    rank that died without one (killed, out of memory), else the reports of ranks that failed because of another."""
    reports = rank_reports(log_dir, "error")
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
