"""Checkpoints: the dense model and optimizer, the sharded tables, each rank's loader state and the step.

    <dir>/step_000040/__0_0.distcp ... .metadata   torch.distributed.checkpoint (DCP): every tensor (dcp.py:
                                                    tables as row-wise chunks of whole tables, even for uneven
                                                    row_boundaries; the replicated dense state once)
    <dir>/step_000040/rank0.pt ... rank{W-1}.pt     each rank's own file: loader and balancer state, data cursor,
                                                    step, the non-tensor rest of model and optimizer state
    <dir>/step_000040/COMPLETE                      every file's size and sha256, each DCP item's crc32
                                                    (pipelines.job.checkpoint.manifest); written last, by rank 0, once
                                                    DCP's coordinator has written .metadata (after every rank's data)
                                                    and every rank its file
    <dir>/.freescale-*.lock                         one job per folder (pipelines.job.checkpoint.lock)

Every file is written under a temporary name and renamed (DCP's .metadata too), so a crash or a full disk never
leaves a step that looks whole: without its COMPLETE marker a step is never resumed. Rewriting a step (a job rerun
past an earlier resume) removes the old one first, its marker first. A failed write ends in one line naming the
step, and for a full disk this rank's payload and the bytes free there (statvfs); the temporary file is removed.

``--async-checkpoint``: the tensors are copied to the host and DCP's ``async_save`` writes them while training
goes on; the next save, and the end of training, first wait for it (``wait``). The marker is written when DCP's
write completes. The save runs on a process group of its own (a background thread must not issue collectives
on a group the training thread uses).

Each rank stores its own loader state (torchtitan's habit): the prefetcher's snapshot and balancer state in
flight are per rank by nature. The same world size restores every rank's loader exactly; another world size
restores what is world-size independent (model, optimizer, tables resharded, the global data cursor: no sample
lost or repeated) and starts the loader's balancer state afresh.

Resume. ``--resume latest`` takes the newest step that every rank can load: newest first, each rank checks a step
(the marker, every file's size, the DCP metadata, the rank file it would read, its share of the step's bytes
against COMPLETE's sums, and each DCP item of its share decoded as the load would: sums that match, COMPLETE
rewritten, do not make bytes that load), the ranks gather their answers, and all load the first step no rank found
a fault in; a step whose load still fails, for any reason, is passed over too (the next load replaces all it left).
The steps skipped and why (the file, and in a DCP data file the item) are returned for the job to print; steps
without COMPLETE (:func:`incomplete_steps`) are never tried. Loading ends in an agreement too: no rank reports a
resume before every rank has loaded. Every file is opened only once pipelines.job.checkpoint.reading has checked it (a
regular file inside the step folder), and a read that does not return within half the communication timeout ends
the rank in one line. Decoding an item holds it in memory twice (its bytes and its tensor), one item at a time.

Loading is safe: rank files are read with ``torch.load(weights_only=True)`` (tensors, numbers, strings, plain
containers), DCP's metadata with an unpickler that knows only DCP's metadata classes, and a DCP item that is not a
tensor is refused (dcp.py): a checkpoint from elsewhere cannot run code. The earlier format (``rankN.pt``
holding everything, marker "W") still loads, resharded by fsembed.reshard on another world size; so does a DCP
step whose marker predates the sums ("W dcp"), unverified, which ``Restored.unverified`` says.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from pipelines.job.checkpoint import dcp, dcp_state, reading
from pipelines.job.checkpoint import lock as checkpoint_lock
from pipelines.job.checkpoint import manifest as checkpoint_manifest
from pipelines.job.checkpoint.manifest import METADATA, Manifest
from pipelines.job.checkpoint.reading import FileSum

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
LOADER_KEY = "loader"
STEP_KEY = "step"
WORLD_SIZE_KEY = "world_size"
CURSOR_KEY = "cursor"  # {epoch, cursor} of the global reader: the world-size independent position
FORMAT_KEY = "format"
STATE_KEY = (
    "state"  # a DCP rank file's skeleton of model and optimizer state (pipelines.job.checkpoint.dcp_state.snapshot)
)
DCP_FORMAT = "dcp"
COMPLETE_MARKER = checkpoint_manifest.MARKER
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint could not be written or loaded. ``root``: this rank's own fault (False: another rank's)."""

    def __init__(self, message: str, root: bool = True) -> None:
        super().__init__(message)
        self.root = root


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_steps(root: str | Path) -> list[Path]:
    """Step directories under ``root`` with a COMPLETE marker, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / COMPLETE_MARKER).exists()
    ]
    return [p for _, p in sorted(steps, reverse=True)]


def incomplete_steps(root: str | Path, newer_than: Optional[Path] = None) -> list[str]:
    """Step directories under ``root`` without a COMPLETE marker (a save interrupted before its end), newest first;
    only those newer than ``newer_than`` when given: the ones ``--resume latest`` passed over."""
    root = Path(root)
    if not root.is_dir():
        return []
    floor = int(_STEP_DIR.match(newer_than.name).group(1)) if newer_than is not None else -1
    steps = [
        (int(m.group(1)), p.name)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and int(m.group(1)) > floor and not (p / COMPLETE_MARKER).exists()
    ]
    return [name for _, name in sorted(steps, reverse=True)]


def latest(root: str | Path) -> Optional[Path]:
    """The newest step with a COMPLETE marker (None if there is none); ``Checkpointer.restore`` checks it too."""
    steps = complete_steps(root)
    return steps[0] if steps else None


def _size(directory: Path, name: str) -> Optional[int]:
    """The size of file ``name`` of ``directory`` (None: missing), once reading.py accepts its path."""
    try:
        return reading.inside(directory, name).stat().st_size
    except FileNotFoundError:
        return None


def checked(directory: str | Path) -> tuple[Manifest, Optional[Metadata]]:
    """The step's marker and (DCP) its checked metadata; ValueError (one line) if the step is missing or incomplete,
    a file differs in size from what COMPLETE records, or the metadata is unsafe or names files that are missing,
    cut short or not listed in COMPLETE. Reads only the marker and the metadata (their bytes verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint {directory} does not exist (give a step directory, or --resume latest)")
    manifest = checkpoint_manifest.read(directory)
    world = manifest.world_size
    missing = [f"rank{r}.pt" for r in range(world) if _size(directory, f"rank{r}.pt") is None]
    if missing:
        raise ValueError(
            f"checkpoint {directory} is incomplete: it lacks {', '.join(missing)} (written by {world} ranks)"
        )
    for name, expect in sorted((manifest.files or {}).items()):
        size = _size(directory, name)
        if size is None:
            raise ValueError(f"checkpoint {directory} is incomplete: it lacks {name} (COMPLETE lists it)")
        if size != expect.size:
            raise ValueError(
                f"{directory / name}: {size} bytes, COMPLETE records {expect.size} (cut short, or written over?)"
            )
    if manifest.format != DCP_FORMAT:
        return manifest, None
    if not manifest.verified:
        return manifest, dcp.check_metadata(directory)
    metadata = dcp.check_metadata(directory, manifest.files[METADATA])
    unlisted = sorted(set(dcp.data_files(metadata)) - set(manifest.files))
    if unlisted:
        raise ValueError(
            f"{directory / METADATA}: names {', '.join(unlisted)}, which COMPLETE does not list (a file of another "
            "save?)"
        )
    return manifest, metadata


def check_complete(directory: str | Path) -> int:
    """The world size of the checkpoint in ``directory``; ValueError (one line) as :func:`checked` says."""
    return checked(directory)[0].world_size


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    return text.split(". ")[0].rstrip(".")


def read_file(path: str | Path, manifest: Optional[Manifest] = None) -> dict[str, Any]:
    """One rank's file, its bytes checked against the step's COMPLETE (read when ``manifest`` is not given), loaded
    with ``weights_only=True``: anything but weights and plain data is refused."""
    path = Path(path)
    manifest = manifest if manifest is not None else checkpoint_manifest.read(path.parent)
    try:
        data = reading.read_checked(path.parent, path.name)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    if manifest.verified:
        if path.name not in manifest.files:
            raise ValueError(f"{path}: not listed in {path.parent / COMPLETE_MARKER}")
        reading.check_bytes(path, data, manifest.files[path.name])
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: refused: it holds objects other than tensors and plain data, which loading would "
            f"run as code ({dcp.load_cause(e)})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(
            f"{path}: not a readable checkpoint file (truncated or corrupt?): {_first_sentence(str(e))} "
            f"({len(data)} bytes)"
        ) from None
    if not isinstance(payload, dict) or WORLD_SIZE_KEY not in payload:
        raise ValueError(f"{path}: not a FreeScale checkpoint (no {WORLD_SIZE_KEY!r} entry)")
    return payload


def load_all(directory: str | Path) -> list[dict[str, Any]]:
    """Every old rank's file, in rank order (the earlier format's resharding needs all their shards)."""
    manifest, _ = checked(directory)
    return [read_file(Path(directory) / f"rank{r}.pt", manifest) for r in range(manifest.world_size)]


def load(directory: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], bool]:
    """The file this rank reads and whether the checkpoint was written by the same world size. On another world
    size rank ``r`` reads old rank ``r % old_world_size``'s (only its world-size independent parts are used)."""
    directory = Path(directory)
    manifest, _ = checked(directory)
    saved_world = manifest.world_size
    path = directory / f"rank{rank % saved_world}.pt"
    payload = read_file(path, manifest)
    if int(payload[WORLD_SIZE_KEY]) != saved_world:
        raise ValueError(f"{path}: written by world size {payload[WORLD_SIZE_KEY]}, marker says {saved_world}")
    if manifest.format == DCP_FORMAT and (payload.get(FORMAT_KEY) != DCP_FORMAT or STATE_KEY not in payload):
        raise ValueError(f"{path}: not a rank file of a DCP checkpoint")
    if manifest.format != DCP_FORMAT and payload.get(FORMAT_KEY) == DCP_FORMAT:
        raise ValueError(
            f"{directory / COMPLETE_MARKER}: says one file per rank (the earliest format), but {path.name} is a DCP "
            "checkpoint's rank file: the marker is damaged (cut short?)"
        )
    if manifest.format != DCP_FORMAT and MODEL_KEY not in payload:
        raise ValueError(f"{path}: not a checkpoint of one file per rank (no {MODEL_KEY!r} entry)")
    return payload, saved_world == world_size


def verify_share(directory: Path, manifest: Manifest, metadata: Optional[Metadata], rank: int, world_size: int) -> None:
    """Reads this rank's share of the step's files (every ``world_size``-th, so that the ranks together read each
    file once) and compares them with COMPLETE, then loads each item of its share of the DCP data files as the
    load would (dcp.check_items: sums that match do not make bytes that load); ValueError (one line)
    naming the file and, in a DCP data file, the item. The marker and the metadata are verified wherever they are
    read."""
    names = sorted(set(manifest.files or ()) - {METADATA})
    for name in names[rank::world_size]:
        reading.verify_file(directory, name, manifest.files[name])
    data = sorted(dcp.data_files(metadata)) if metadata is not None else []
    for name in data[rank::world_size]:
        dcp.check_items(directory, name, metadata)


def problem(directory: str | Path, rank: int, world_size: int) -> Optional[str]:
    """What keeps this rank from loading ``directory`` (one line), or None: every file it would read is whole and
    its share of the step's files matches COMPLETE (:func:`verify_share`)."""
    directory = Path(directory)
    try:
        manifest, metadata = checked(directory)
        payload, same = load(directory, rank, world_size)
        if manifest.format == DCP_FORMAT:
            state = payload[STATE_KEY]
            dcp_state.empty_targets(
                dcp_state.refs(state["model"]) + dcp_state.refs(state["optimizer"]), metadata, directory
            )
        elif not same:  # the earlier format reshards from every old rank's file
            load_all(directory)
        verify_share(directory, manifest, metadata, rank, world_size)
    except Exception as e:  # whatever keeps a step from loading skips it under --resume latest
        return _fault(directory, e)
    return None


def _fault(directory: Path, exc: Exception) -> str:
    """A reading fault's line: the checkers' own, an OS error (a permission, an I/O error) with the step, or any
    other failure with the step and its first sentence."""
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, OSError):
        where = getattr(exc, "filename", None) or directory
        return f"{where}: cannot be read: {type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
    return f"checkpoint {directory}: {type(exc).__name__}: {_first_sentence(str(exc))}"


# ---------------------------------------------------------------------------------------------- faults
def free_bytes(directory: str | Path) -> Optional[int]:
    """Bytes free to this user on the file system of ``directory`` (or its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _causes(exc: BaseException) -> list[BaseException]:
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in getattr(e, "failures", {}).values()]  # DCP's CheckpointException
    return out


def _no_space(exc: BaseException, payload: int, free: Optional[int]) -> bool:
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e).lower()
        # torch.save into a full disk says only "unexpected pos": a short write
        if "no space left" in text or ("unexpected pos" in text and free is not None and free < payload):
            return True
    return False


def write_fault(directory: Path, exc: BaseException, payload: int) -> str:
    """One line for a failed write: a full disk says so, with this rank's payload and the bytes free there."""
    free = free_bytes(directory)
    if _no_space(exc, payload, free):
        return (
            f"checkpoint {directory}: no space left on device: this rank writes {payload:,} bytes, "
            f"{'an unknown number of' if free is None else f'{free:,}'} bytes are free there (statvfs); "
            "free some space or give another --checkpoint-dir"
        )
    inner = next((e for e in reversed(_causes(exc)) if not getattr(e, "failures", None)), exc)
    return f"checkpoint {directory}: writing failed: {type(inner).__name__}: {_first_sentence(str(inner))}"


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` under a temporary name, synced, then renamed; the temporary file never stays."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------- the job's saves
@dataclass
class Restored:
    """What a resume restored: where the job continues, and the loader state (None on another world size)."""

    directory: Path
    step: int
    epoch: int
    cursor: int
    saved_world: int
    loader_state: Optional[dict]
    skipped: list[str] = field(default_factory=list)  # newer steps --resume latest left, each with why
    unverified: Optional[str] = None  # a step whose marker predates checksums: what was not checked, for the job


class Checkpointer:
    """Saves and restores a job's checkpoints under ``root`` (every rank makes one, collectively, at set-up).

    ``save`` and ``restore`` are collective over a process group of their own; ``wait`` completes an async save.
    Rank 0 holds ``root``'s lock (pipelines.job.checkpoint.lock) from here until its process ends.
    """

    def __init__(self, root: Optional[str | Path], rank: int, world_size: int, async_save: bool = False) -> None:
        self.root = Path(root) if root else None
        self.rank, self.world_size, self.async_save = rank, world_size, async_save
        self.group = None
        if dist.is_available() and dist.is_initialized():
            from fscomm.groups import new_thread_group

            # Its collectives wait at most the job's communication timeout, like every other exchange: a save's
            # last collective waits for the slowest rank's write (a larger checkpoint needs a larger
            # --comm-timeout-s), and a rank that stopped mid-save ends the others' waits in an error.
            self.group = new_thread_group("checkpoint")
        self._pending: Optional[tuple[Future, Path, int]] = None
        self._marker_error: Optional[BaseException] = None
        error = None
        if self.root is not None and rank == 0:
            try:
                checkpoint_lock.hold(self.root, "rank 0")
            except ValueError as e:
                error = str(e)
        self._agree(error, f"--checkpoint-dir {self.root}")

    # ------------------------------------------------------------------ collectives
    def _gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _agree(self, error: Optional[str], what: str, value: Any = None) -> list[Any]:
        """Every rank raises if any rank failed: its own line where the fault is its own, the first failed rank's
        elsewhere, so no rank goes on into a collective the failed one never reaches. Returns every rank's
        ``value`` otherwise."""
        answers = self._gather((error, value))
        if error is not None:
            raise CheckpointError(error)
        failed = [(r, e) for r, (e, _) in enumerate(answers) if e is not None]
        if failed:
            r, line = failed[0]
            raise CheckpointError(f"{what}: rank {r} failed ({line})", root=False)
        return [v for _, v in answers]

    def _raise_dcp(self, exc: BaseException, directory: Path, payload: Optional[int]) -> None:
        """DCP's CheckpointException (every rank gets every failed rank's exception) as one line per rank."""
        failures = getattr(exc, "failures", None) or {self.rank: (exc, None)}
        mine = failures.get(self.rank)
        if mine is not None:
            if payload is not None:
                raise CheckpointError(write_fault(directory, mine[0], payload)) from None
            raise CheckpointError(f"checkpoint {directory}: {_first_sentence(str(mine[0]))}") from None
        r = min(failures)
        raise CheckpointError(
            f"checkpoint {directory}: rank {r} failed ({type(failures[r][0]).__name__}: "
            f"{_first_sentence(str(failures[r][0]))})",
            root=False,
        ) from None

    # ------------------------------------------------------------------ save
    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, cursor: dict
    ) -> Path:
        """Every rank calls this at the same step, after the wrap's ``flush()``."""
        if self.root is None:
            raise ValueError("checkpoint: no checkpoint directory (--checkpoint-dir)")
        self.wait()
        directory = step_dir(self.root, step)
        tensors, shards, skeleton = dcp_state.snapshot(model, optimizer)
        buffer = io.BytesIO()
        torch.save(
            {
                FORMAT_KEY: DCP_FORMAT,
                WORLD_SIZE_KEY: self.world_size,
                "rank": self.rank,
                STEP_KEY: step,
                CURSOR_KEY: cursor,
                LOADER_KEY: loader_state,
                STATE_KEY: skeleton,
            },
            buffer,
        )
        payload = buffer.getbuffer().nbytes + dcp_state.nbytes(tensors)
        error = None
        try:
            if self.rank == 0:  # an older save of this step goes first, its marker first
                if directory.exists():
                    (directory / COMPLETE_MARKER).unlink(missing_ok=True)
                    shutil.rmtree(directory)
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            error = write_fault(directory, e, payload)
        self._agree(error, f"checkpoint {directory}")
        name, data = f"rank{self.rank}.pt", buffer.getvalue()
        try:
            _write_atomic(directory / name, data)
        except OSError as e:
            error = write_fault(directory / name, e, payload)
        # the rank files' sums, from the bytes written, for rank 0's marker; DCP's writer adds its files' sums
        sums = dict(self._agree(error, f"checkpoint {directory}", (name, reading.sum_bytes(data))))
        try:
            future = dcp.save(directory, tensors, shards, self.group, async_save=self.async_save, sums=sums)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self._raise_dcp(e, directory, payload)
        if future is None:
            self._mark(directory, sums)
        else:
            self._pending = (future, directory, payload)
            if self.rank == 0:  # the marker as soon as DCP's write completes, even if no later wait comes
                future.add_done_callback(lambda f: self._mark_when_done(f, directory, sums))
        return directory

    def _mark(self, directory: Path, sums: dict[str, FileSum]) -> None:
        if self.rank != 0:
            return
        marker = checkpoint_manifest.encode(self.world_size, DCP_FORMAT, sums)
        try:
            _write_atomic(directory / COMPLETE_MARKER, marker)
        except OSError as e:
            raise CheckpointError(write_fault(directory / COMPLETE_MARKER, e, len(marker))) from None

    def _mark_when_done(self, future: Future, directory: Path, sums: dict[str, FileSum]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        try:
            self._mark(directory, sums)
        except CheckpointError as e:
            self._marker_error = e

    def wait(self) -> None:
        """Completes the async save in flight, if any (before the next save and at the end of training)."""
        if self._pending is None:
            return
        future, directory, payload = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self._raise_dcp(e, directory, payload)
        if self._marker_error is not None:
            error, self._marker_error = self._marker_error, None
            raise error

    # ------------------------------------------------------------------ restore
    def _loadable(self, directory: Path, present: bool) -> list[str]:
        """Every rank's fault with ``directory`` (``present``: this rank sees the step), gathered: [] when every
        rank can load it."""
        mine = problem(directory, self.rank, self.world_size) if present else "not there"
        return [f"rank {r}: {m}" for r, m in enumerate(self._gather(mine)) if m is not None]

    def _latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Optional[Restored]:
        """The newest step that every rank checks (its share of the bytes, every item decoded) and then loads; a
        step that fails either way, for any reason, is skipped with its line, and the next older one tried."""
        seen = self._gather([p.name for p in complete_steps(self.root)])
        skipped, mine_failed = [], False
        for name in sorted({n for names in seen for n in names}, reverse=True):
            directory = self.root / name
            faults = self._loadable(directory, name in seen[self.rank])
            if not faults:
                try:
                    restored = self._load(directory, model, optimizer)
                except CheckpointError as e:  # a load every rank failed alike (it ends in an agreement)
                    faults = [str(e)]
                    mine_failed |= e.root
                else:
                    restored.skipped = skipped
                    return restored
            mine_failed |= any(f.startswith(f"rank {self.rank}: ") for f in faults)
            skipped.append(f"{name} ({'; '.join(faults)})")
        if skipped:
            raise CheckpointError(
                f"--resume latest: no step under {self.root} that every rank can load: " + "; ".join(skipped),
                root=mine_failed,
            )
        return None

    def restore(self, resume: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Optional[Restored]:
        """Loads ``resume`` (a step directory, or "latest": the newest step every rank can load) into model and
        optimizer; None when "latest" finds no checkpoint. Collective: returns on every rank once all have loaded.
        Every read is bounded by half the communication timeout (pipelines.job.checkpoint.reading.watching)."""
        from fscomm.groups import comm_timeout_s

        with reading.watching(comm_timeout_s(), self.rank):
            if resume == "latest":
                return self._latest(model, optimizer)
            directory = Path(resume)
            self._agree(problem(directory, self.rank, self.world_size), f"checkpoint {directory}")
            return self._load(directory, model, optimizer)

    def _load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Restored:
        payload: dict = {}
        manifest, targets, error = None, None, None
        try:
            manifest, metadata = checked(directory)
            payload, same = load(directory, self.rank, self.world_size)
            if manifest.format == DCP_FORMAT:
                targets = dcp_state.targets(directory, payload[STATE_KEY], model, metadata)
            else:
                _restore_files(directory, payload, model, optimizer, same)
        except Exception as e:  # one rank's fault reaches every rank through the agreement below
            error = _fault(directory, e)
        self._agree(error, f"checkpoint {directory}")
        same = manifest.world_size == self.world_size
        if targets is not None:
            try:
                dcp.load(directory, targets.state, targets.shards, self.group, targets.metadata)
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                self._raise_dcp(e, directory, None)
            try:
                dcp_state.apply(directory, targets, payload[STATE_KEY], model, optimizer, same)
            except ValueError as e:
                error = str(e)
            self._agree(error, f"checkpoint {directory}")
        position = payload[CURSOR_KEY]
        return Restored(
            directory,
            int(payload[STEP_KEY]),
            int(position["epoch"]),
            int(position["cursor"]),
            manifest.world_size,
            payload[LOADER_KEY] if same else None,
            unverified=None if manifest.verified else _UNVERIFIED.format(directory=directory),
        )


_UNVERIFIED = (
    "{directory}: its COMPLETE marker predates checksums (an older FreeScale's): its files' sizes and metadata were "
    "checked, their bytes were not"
)


def _restore_files(
    directory: Path, payload: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, same_world: bool
) -> None:
    """The earlier format: this rank's file; on another world size the tables resharded from every old rank's."""
    from fsembed.reshard import reshard_tables_state

    model_state = dict(payload[MODEL_KEY])
    if not same_world:
        files = None
        for key, collection in dcp_state._collections(model).items():
            files = files or load_all(directory)
            tables = reshard_tables_state(
                [p[MODEL_KEY][key]["tables"] for p in files], collection.plan, collection.rank
            )
            model_state[key] = {"world_size": collection.plan.world_size, "rank": collection.rank, "tables": tables}
    try:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(payload[OPTIMIZER_KEY])
    except (RuntimeError, KeyError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ValueError(
            f"checkpoint {directory} does not fit this job's model or optimizer: {' '.join(lines[:2])}"
        ) from None
