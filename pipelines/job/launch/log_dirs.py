"""The launcher's temporary log folders (``/tmp/freescale-*``), and those a killed launcher left.

A launcher without ``--log-dir`` makes one for its ranks' pid files and failure reports, and removes it when the job
ends (:func:`tidy`), unless it keeps a failed rank's log, which the job's line names. A
launcher killed outright (its host lost, ``kill -9``) removes nothing: its folder stays. So each folder holds, while
its launcher runs, a marker naming it (host, process id, the process's start time); the launcher takes the marker
away when it tidies, and the next launcher on the host removes the folders whose marker names a launcher that is
gone (no such process, or one started at another time: its id was reused) and whose ranks are gone too. A kept
folder has no marker and stays; so does one of another host (a /tmp shared by several).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional

PREFIX = "freescale-"
MARKER = "launcher.pid"  # "<host> <pid> <start time>" of the launcher that made the folder, while it runs


def _start_time(pid: int) -> Optional[str]:
    """The process's start time since boot (clock ticks, /proc/<pid>/stat), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def make() -> Path:
    """A new temporary log folder with this launcher's marker, once the stale ones of this host are removed."""
    remove_stale()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX)).resolve()
    pid = os.getpid()
    (folder / MARKER).write_text(f"{socket.gethostname()} {pid} {_start_time(pid)}\n")
    return folder


def unmark(folder: Path) -> None:
    """The launcher is done with ``folder``: it stays only if it keeps a failed rank's log, which is then no one's
    to remove but the user's."""
    (folder / MARKER).unlink(missing_ok=True)


def _gone(pid: int, start: Optional[str] = None) -> bool:
    now = _start_time(pid)
    return now is None or (start is not None and now != start)


def remove_stale(root: Optional[Path] = None) -> list[Path]:
    """Removes the folders under ``root`` (the temporary directory) that a launcher of this host left when it was
    killed: its marker names this host and a process that is gone, and no rank of its pid files still runs.
    Returns them."""
    host = socket.gethostname()
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner, pid, start = (folder / MARKER).read_text().split()
            ranks = [int(p.read_text()) for p in folder.glob("rank*.pid")]
        except (OSError, ValueError):  # no marker (a kept folder, another program's), or one being written
            continue
        if owner != host or not _gone(int(pid), start) or not all(_gone(r) for r in ranks):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def tidy(log_dir: Path, made_here: bool, clean: bool) -> bool:
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
    unmark(log_dir)  # kept for the user, whom the line tells: no later launcher removes it
    return True


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
