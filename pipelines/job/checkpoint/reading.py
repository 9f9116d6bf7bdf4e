"""Reading a checkpoint's files: nothing is opened before it is checked, its bytes are compared with the sums the
save recorded, and no read waits forever.

Paths. A step folder's files are named by COMPLETE, by DCP's ``.metadata`` (its data files) and by the rank files'
fixed names. :func:`inside` takes a plain name only (a ``str``, no separator, not ``.`` or ``..``; a crafted
``pathlib`` object whose text reads ``__0_0.distcp`` while its parts lead elsewhere is refused as any other type),
resolves it (links followed) and accepts a regular file inside the step folder: a link out of the folder, a FIFO, a
socket or a device is refused in one line before anything is opened. :func:`open_checked` then opens the resolved
path without following a link and without blocking, and checks that what it opened is that regular file (a file
swapped in between is refused too).

Sums. :func:`digest` reads a file once, in chunks, for its size, its sha256 and a crc32 of each byte range asked for
(the DCP items of a data file): the save records them right after writing (pipelines.job.checkpoint.manifest), a
resume compares them and names the file, and for a data file the item (the metadata's item key) whose bytes differ.

Stalls. A read from a hung network mount never returns, and no exception reaches the rank. While a rank reads a
checkpoint (:func:`watching`), a watchdog thread ends the rank when one read call has not returned within its bound,
half the communication timeout: the stuck rank's own line then comes before its peers' collectives give up on it.
The watchdog writes the rank's failure report (pipelines.job.failure_report, which the launcher prints; under
torchrun the rank prints it) and ends the process, since the stuck thread cannot be interrupted.
``FREESCALE_CHECKPOINT_FAULT=stall:RANK`` makes that rank's first checkpoint read stall (the test of the watchdog).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, Sequence

from pipelines.job.failure_report import LOG_DIR_ENV, report_failure

FAULT_ENV = "FREESCALE_CHECKPOINT_FAULT"
_CHUNK = 4 << 20


# ---------------------------------------------------------------------------------------------- paths
def plain_name(name: object, where: str | Path) -> str:
    """``name`` if it is a plain file name (a ``str`` of one path component); ValueError (one line) otherwise."""
    if type(name) is not str:
        raise ValueError(
            f"{where}: refused: file name {str(name)!r} is a {type(name).__module__}.{type(name).__name__}, not a str "
            "(a path object may lead elsewhere than its text says)"
        )
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(
            f"{where}: refused: file name {name!r} is not a plain name inside the checkpoint (a str without "
            "separators or '..')"
        )
    return name


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def inside(directory: str | Path, name: object) -> Path:
    """The resolved path of file ``name`` of step folder ``directory``: a plain name whose target (links followed)
    is a regular file inside the folder. ValueError (one line) otherwise, FileNotFoundError if it is missing;
    nothing is opened."""
    directory = Path(directory)
    name = plain_name(name, directory)
    folder = Path(os.path.realpath(directory))
    target = Path(os.path.realpath(folder / name))
    if target.parent != folder:
        raise ValueError(f"{directory / name}: refused: it leads to {target}, outside the checkpoint {folder}")
    mode = os.stat(target).st_mode  # stat opens nothing: a FIFO is not waited on here
    if not stat.S_ISREG(mode):
        raise ValueError(f"{directory / name}: refused: {_kind(mode)}, not a regular file (reading it could block)")
    return target


def open_checked(directory: str | Path, name: object) -> BinaryIO:
    """File ``name`` of ``directory`` opened for reading once :func:`inside` accepts it; every read call is timed by
    the watchdog (:func:`watching`)."""
    shown = Path(directory) / str(name)
    target = inside(directory, name)
    with reading(shown):
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the check and the open
            raise ValueError(f"{shown}: refused: {_kind(mode)}, not a regular file (reading it could block)")
        os.set_blocking(fd, True)
        return io.BufferedReader(_Timed(io.FileIO(fd, "rb"), shown), buffer_size=1 << 20)
    except BaseException:
        os.close(fd)
        raise


def read_checked(directory: str | Path, name: object) -> bytes:
    with open_checked(directory, name) as f:
        return f.read()


class _Timed(io.RawIOBase):
    """A raw file whose every read is one the watchdog times."""

    def __init__(self, raw: io.FileIO, shown: Path) -> None:
        self.raw, self.shown = raw, shown

    def readinto(self, buffer) -> int:
        with reading(self.shown):
            return self.raw.readinto(buffer)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


# ---------------------------------------------------------------------------------------------- sums
@dataclass(frozen=True)
class ItemSum:
    """One DCP item of a data file: its metadata key (``fqn``, the chunk's ``offset``), bytes and crc32."""

    fqn: str
    offset: Optional[tuple[int, ...]]
    start: int
    length: int
    crc32: int

    def name(self) -> str:
        return item_name(self.fqn, self.offset, self.start, self.length)


def item_name(fqn: str, offset: Optional[Sequence[int]], start: int, length: int) -> str:
    """How a line names a DCP item of a data file: its metadata key, its chunk where not at the origin, its bytes."""
    chunk = f" (chunk at {list(offset)})" if offset and any(offset) else ""
    return f"item {fqn!r}{chunk}, bytes {start}..{start + length}"


@dataclass(frozen=True)
class FileSum:
    """A file's size and sha256, and for a DCP data file its items' sums."""

    size: int
    sha256: str
    items: tuple[ItemSum, ...] = field(default=())


def digest(f: BinaryIO, ranges: Sequence[tuple[int, int]] = ()) -> tuple[int, str, list[int]]:
    """``(size, sha256, crc32 of each (start, length) range)`` of what ``f`` reads to its end, in one pass. The ranges
    may come in any order and must not overlap (DCP's items of one file do not)."""
    whole = hashlib.sha256()
    crcs = [0] * len(ranges)
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    first, pos = 0, 0
    while chunk := f.read(_CHUNK):
        view, end = memoryview(chunk), pos + len(chunk)
        whole.update(view)
        while first < len(order) and sum(ranges[order[first]]) <= pos:  # items already read whole
            first += 1
        for i in order[first:]:
            start, length = ranges[i]
            if start >= end:
                break
            lo, hi = max(start, pos), min(start + length, end)
            if lo < hi:
                crcs[i] = zlib.crc32(view[lo - pos : hi - pos], crcs[i])
        pos = end
    return pos, whole.hexdigest(), crcs


def sum_file(path: str | Path, items: Sequence[tuple[str, Optional[tuple[int, ...]], int, int]] = ()) -> FileSum:
    """The sums of a file this process has just written (``items``: ``(fqn, offset, start, length)``)."""
    with open(path, "rb") as f:
        size, sha, crcs = digest(f, [(start, length) for _, _, start, length in items])
    return FileSum(size, sha, tuple(ItemSum(fqn, off, s, n, c) for (fqn, off, s, n), c in zip(items, crcs)))


def sum_bytes(data: bytes) -> FileSum:
    return FileSum(len(data), hashlib.sha256(data).hexdigest())


_CHANGED = "its bytes changed after the save (damaged, or written over by another job)"


def check_bytes(path: Path, data: bytes, expect: FileSum) -> None:
    """ValueError (one line) unless ``data``, read from ``path``, is what the save recorded."""
    if len(data) != expect.size:
        raise ValueError(f"{path}: {len(data)} bytes, COMPLETE records {expect.size} (cut short, or written over?)")
    if hashlib.sha256(data).hexdigest() != expect.sha256:
        raise ValueError(f"{path}: sha256 differs from the one COMPLETE records: {_CHANGED}")


def verify_file(directory: Path, name: str, expect: FileSum) -> None:
    """Reads file ``name`` of ``directory`` whole and compares it with ``expect``; ValueError (one line) naming the
    file, and the first item whose bytes differ."""
    path = directory / name
    with open_checked(directory, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size != expect.size:
            raise ValueError(f"{path}: {size} bytes, COMPLETE records {expect.size} (cut short, or written over?)")
        size, sha, crcs = digest(f, [(i.start, i.length) for i in expect.items])
    if sha == expect.sha256 and size == expect.size:
        return
    bad = next((item for item, crc in zip(expect.items, crcs) if crc != item.crc32), None)
    where = f"{bad.name()} differs from its checksum in COMPLETE" if bad is not None else "sha256 differs from COMPLETE"
    raise ValueError(f"{path}: {where}: {_CHANGED}")


# ---------------------------------------------------------------------------------------------- stalls
class CheckpointStalled(TimeoutError):
    """A checkpoint read did not return within the watchdog's bound."""


class Watchdog:
    """Ends this rank when one of its read calls has not returned within ``limit_s`` (see the module docstring)."""

    def __init__(self, limit_s: float, rank: int, timeout_s: float) -> None:
        self.limit_s, self.rank, self.timeout_s = limit_s, rank, timeout_s
        self._reads: dict[int, tuple[Path, float]] = {}  # thread id -> (file, when its read call began)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freescale-checkpoint-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def reading(self, path: Path) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            outer = self._reads.get(me)
            self._reads[me] = (path, time.monotonic())
        try:
            if os.environ.get(FAULT_ENV) == f"stall:{self.rank}":
                time.sleep(10 * self.timeout_s + 60)  # as a read of a hung mount: it never returns in time
            yield
        finally:
            with self._lock:
                if outer is None:
                    self._reads.pop(me, None)
                else:  # the open inside a read: the outer read goes on, timed anew
                    self._reads[me] = (outer[0], time.monotonic())

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.limit_s / 10)):
            now = time.monotonic()
            with self._lock:
                stalled = [(path, now - began) for path, began in self._reads.values() if now - began > self.limit_s]
            if stalled:
                self._end_rank(*stalled[0])

    def _end_rank(self, path: Path, waited: float) -> None:
        stalled = CheckpointStalled(
            f"{path}: a read has not returned after {waited:.0f} s (the bound: half of --comm-timeout-s "
            f"{self.timeout_s:g}): its file system stopped answering (a hung network mount?); this rank ends here"
        )
        line = report_failure(stalled, self.rank, verbose=False, log_dir=None)
        if not os.environ.get(LOG_DIR_ENV):  # not a rank of `freescale train`: no launcher prints it
            print(f"freescale train: error: {line}", file=sys.stderr, flush=True)
        os._exit(1)  # the stuck thread cannot be interrupted; its peers see the connection close

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


_watchdogs: list[Watchdog] = []


@contextlib.contextmanager
def watching(timeout_s: float, rank: int) -> Iterator[Watchdog]:
    """Every checkpoint read of this process inside the block is bounded by half of ``timeout_s``."""
    dog = Watchdog(timeout_s / 2, rank, timeout_s)
    _watchdogs.append(dog)
    try:
        yield dog
    finally:
        _watchdogs.remove(dog)
        dog.close()


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """One read call on ``path``, timed by the innermost watchdog (none outside :func:`watching`)."""
    if not _watchdogs:
        yield
        return
    with _watchdogs[-1].reading(path):
        yield
