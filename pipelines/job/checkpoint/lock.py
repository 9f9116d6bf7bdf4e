"""One job per checkpoint folder: an exclusive ``flock`` on a lock file in the folder, held for the job's life.

Two jobs saving into one folder replace each other's steps, and a step can end up with files of both. A job takes
the folder's lock at start and holds it until its process ends; the OS releases it then, however the process ended
(``kill -9`` included), so a lock is never stale. The lock file records the holder (host, pid, start time, role)
for the line that refuses a second job.

Who holds it. Under ``freescale train`` the launcher takes it before any rank starts (:func:`hold` with role
``launcher``), so a second job is refused before its ranks start. Rank 0 takes it under every launcher (role
``rank 0``; plain torchrun has no launcher of ours), on a lock file of its own: should the launcher be killed and
its ranks live on, the folder is still held. Each role takes its own file and tests the other's: a launcher refuses
a folder whose rank-0 lock is held, and a rank 0 refuses a folder whose launcher lock is held by any process but
its own launcher (its parent, on the same host).

File systems. On a local file system ``flock`` is exact. On NFS (Linux 2.6.12 and later) it is carried out as a
POSIX lock through the server's lock manager, so it holds across hosts, unless the folder is mounted with
``nolock`` or ``local_lock=flock``, where a lock binds one host only. Lustre grants ``flock`` across clients only when
mounted with ``-o flock`` (``localflock``: one host; neither: the call fails). Where the call fails, the job goes on
with a warning that says another job would not be refused.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

LAUNCHER_FILE = ".freescale-launcher.lock"
RANK0_FILE = ".freescale-rank0.lock"
_FILES = {"launcher": LAUNCHER_FILE, "rank 0": RANK0_FILE}
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_held: dict[tuple[str, str], int] = {}  # (folder, role) -> the open lock file's descriptor, for the process's life
_guard = threading.Lock()


def _holder(path: Path) -> Optional[dict]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _describe(record: Optional[dict]) -> str:
    if record is None:
        return "holder not recorded yet"
    return (
        f"{record.get('role', 'a process')} on host {record.get('host', '?')}, pid {record.get('pid', '?')}, "
        f"since {record.get('started', '?')}"
    )


def _refuse(folder: Path, path: Path, record: Optional[dict]) -> ValueError:
    return ValueError(
        f"--checkpoint-dir {folder}: another job uses it ({_describe(record)}; lock file {path}): two jobs would "
        "replace each other's steps; give this job another --checkpoint-dir, or end that job"
    )


def _try_lock(path: Path, shared: bool = False) -> Optional[int]:
    """An open descriptor of ``path`` holding its lock, or None if another open file holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ours(record: Optional[dict]) -> bool:
    """The launcher lock's holder is this rank's own launcher: its parent process, on this host."""
    return (
        record is not None
        and record.get("pid") == os.getppid()
        and record.get("host") == socket.gethostname()
        and record.get("role") == "launcher"
    )


def _take(folder: Path, role: str, other_is_mine: bool) -> int:
    """Locks ``role``'s file and tests the other role's (held by this process: ``other_is_mine``)."""
    mine, other = folder / _FILES[role], folder / _FILES["rank 0" if role == "launcher" else "launcher"]
    fd = _try_lock(mine)
    if fd is None:
        raise _refuse(folder, mine, _holder(mine))
    try:
        probe = None if other_is_mine else _try_lock(other, shared=True)  # its holder holds it exclusively
        if probe is not None:
            os.close(probe)
        elif not (other_is_mine or (role == "rank 0" and _ours(_holder(other)))):
            raise _refuse(folder, other, _holder(other))
        record = {
            "role": role,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold(folder: str | Path, role: str) -> None:
    """Takes ``folder``'s lock for ``role`` (``"launcher"`` or ``"rank 0"``) until this process ends; ValueError (one
    line, naming the folder and the holder) if another job holds it. Holding it already in this process is fine."""
    if role not in _FILES:
        raise ValueError(f"checkpoint lock: unknown role {role!r} (one of {sorted(_FILES)})")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {folder}: cannot create it: {e.strerror}") from None
    key = (os.path.realpath(folder), role)
    with _guard:
        if key in _held:
            return
        other_is_mine = any(k[0] == key[0] for k in _held)
        try:
            _held[key] = _take(folder, role, other_is_mine)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise ValueError(f"--checkpoint-dir {folder}: cannot take its lock: {e.strerror}") from None
            print(
                f"[freescale] warning: --checkpoint-dir {folder}: its file system does not lock files "
                f"({e.strerror}): a second job using this folder would not be refused",
                file=sys.stderr,
                flush=True,
            )
            _held[key] = -1
