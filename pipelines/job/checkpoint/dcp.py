"""torch.distributed.checkpoint (DCP) for FreeScale: row-wise shards as chunks of whole tensors, and reading that
runs no code.

Uneven shards. A rank's rows of a table are the range ``[b[r], b[r+1])`` of the plan's ``row_boundaries`` (torchrec's
even split or any sorted split the user gave, ranks with no rows included). Each rank writes its range as a
chunk of the whole table: ``ChunkStorageMetadata(offsets=(b[r], 0), sizes=(b[r+1] - b[r], dim))``, the same chunk
metadata DCP records for a ShardedTensor's shards, so ``.metadata`` describes the whole table and any DCP tool reads
it whole. On load each rank asks for its new range ``[b'[r], b'[r+1])`` under the new plan (another world size,
other boundaries) and DCP reads the overlapping parts of the saved chunks: resharding without gathering a table.
The shards are plain tensors in the state dict; the planners below know their row offsets (``RowShard``), since
DTensor's Shard(0) cannot express arbitrary boundaries and ShardedTensor's operations warn that they are deprecated.

Reading is safe. DCP's stock reader unpickles ``.metadata`` with ``pickle.load``; :func:`read_metadata` uses an
unpickler that resolves only DCP's metadata classes, torch dtypes/layouts/sizes and paths, and refuses any other
name before anything is constructed. The stock load planner would ``torch.load(weights_only=False)`` a non-tensor
item; FreeScale writes none (dcp_state.py keeps them in each rank's own file), so :func:`check_metadata`
refuses a checkpoint that declares one, and the planner refuses one again should it be asked to read it. Tensor
data is read by DCP with ``weights_only=True``.

Opening is safe. The metadata names the data files: only plain names are accepted (a ``str`` without separators;
a ``pathlib`` object, which the metadata may otherwise carry, is refused whatever its text says), and every file is
opened through reading.py, which resolves it and accepts only a regular file inside the step folder,
before opening it, and times every read (a rank stuck on a hung mount ends in one line).

Sums. The writer reads back each data file right after writing it, for its size and sha256 and each item's crc32,
and the coordinator adds the ``.metadata`` it wrote: ``save(..., sums=)`` gets them for the step's COMPLETE marker
(pipelines.job.checkpoint.manifest).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from pipelines.job.checkpoint import reading
from pipelines.job.checkpoint.reading import FileSum, ItemSum

METADATA_FILE = ".metadata"

# What DCP's .metadata may name (torch 2.11 .. 2.13 write these); anything else is refused unread.
_METADATA = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    (_METADATA, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("builtins", "set"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_metadata(path: str | Path, expect: Optional[FileSum] = None) -> Metadata:
    """``<dir>/.metadata`` (or the file itself), unpickled with DCP's metadata classes only, once its bytes match
    ``expect`` (the sums COMPLETE records, when given); ValueError (one line) for a file that names anything else,
    is not DCP metadata or is not a regular file inside its folder."""
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    try:
        data = reading.read_checked(path.parent, path.name)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (a DCP checkpoint's index, written last by DCP's coordinator)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read: {e.strerror}") from None
    if expect is not None:
        reading.check_bytes(path, data, expect)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: refused: {e}, which loading would run as code (DCP metadata holds only "
            "torch.distributed.checkpoint.metadata classes)"
        ) from None
    except (EOFError, OSError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise ValueError(
            f"{path}: not readable DCP metadata (truncated or corrupt?): {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: not DCP metadata (it holds a {type(metadata).__name__})")
    check_storage(path, metadata)
    return metadata


def check_storage(path: Path, metadata: Metadata) -> None:
    """Every storage entry of ``metadata`` (read from ``path``) as DCP writes it: a plain file name, a byte range,
    no stream transforms. ValueError (one line) otherwise."""
    for index, info in (metadata.storage_data or {}).items():
        item = getattr(index, "fqn", index)
        if type(info) is not _StorageInfo:
            raise ValueError(
                f"{path}: refused: item {item!r} has storage {type(info).__name__}, not DCP's _StorageInfo"
            )
        reading.plain_name(info.relative_path, f"{path}: item {item!r}")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise ValueError(f"{path}: refused: item {item!r} has byte range {info.offset!r}+{info.length!r}")
        if info.transform_descriptors:  # FreeScale writes none; a transform would run code of DCP's extensions
            raise ValueError(f"{path}: refused: item {item!r} asks for stream transforms {info.transform_descriptors}")


def check_metadata(directory: str | Path, expect: Optional[FileSum] = None) -> Metadata:
    """The metadata of a FreeScale DCP checkpoint, checked before anything is read: every item a tensor, every data
    file a plain name of a regular file inside ``directory`` and at least as long as the items it holds.
    ``expect``: the sums COMPLETE records for ``.metadata``. ValueError (one line)."""
    directory = Path(directory)
    metadata = read_metadata(directory, expect)
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(
                f"{directory / METADATA_FILE}: refused: item {key!r} is a pickled object, not a tensor "
                "(FreeScale keeps non-tensor state out of DCP; loading it would run it as code)"
            )
    for name, end in sorted(data_files(metadata).items()):
        try:
            size = reading.inside(directory, name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"checkpoint {directory} is incomplete: it lacks {name} (a DCP data file)") from None
        if size < end:
            raise ValueError(f"{directory / name}: cut short: {size} bytes, its items end at byte {end} (truncated)")
    return metadata


def check_items(directory: str | Path, name: str, metadata: Metadata) -> None:
    """Reads every item of data file ``name`` as DCP's load would (``torch.load(weights_only=True)`` of its byte
    range) and checks it is a tensor of the chunk's shape and dtype that the metadata records: bytes that match
    their sums yet do not load (an item written over with a resealed COMPLETE) are named here, by file and item,
    before a load begins. ValueError (one line)."""
    directory = Path(directory)
    chunks = {
        MetadataIndex(fqn, chunk.offsets): (tuple(chunk.sizes), md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        for chunk in md.chunks
    }
    items = sorted(
        ((index, info) for index, info in (metadata.storage_data or {}).items() if info.relative_path == name),
        key=lambda pair: pair[1].offset,
    )
    with reading.open_checked(directory, name) as f:
        for index, info in items:
            offset = tuple(index.offset) if index.offset is not None else None
            where = f"{directory / name}: {reading.item_name(index.fqn, offset, info.offset, info.length)}"
            f.seek(info.offset)
            data = f.read(info.length)
            try:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # what DCP's read would raise mid-load, on every rank: named here instead
                raise ValueError(f"{where}: does not load: {type(e).__name__}: {load_cause(e)}") from None
            expect = chunks.get(MetadataIndex(index.fqn, index.offset))
            if not isinstance(tensor, torch.Tensor) or expect is None:
                what = "a tensor .metadata does not list" if expect is None else f"a {type(tensor).__name__}"
                raise ValueError(f"{where}: does not load: it holds {what}")
            if (tuple(tensor.shape), tensor.dtype) != expect:
                raise ValueError(
                    f"{where}: does not load: a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, .metadata "
                    f"records {expect[1]} of shape {expect[0]}"
                )


def load_cause(error: BaseException) -> str:
    """What a failed ``torch.load`` says in one line: the global it refused where it names one, else its first
    sentence."""
    text = str(error)
    cause = next((line.strip() for line in text.splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
    return cause or " ".join(text.split()).split(". ")[0].rstrip(".")


def data_files(metadata: Metadata) -> dict[str, int]:
    """``{data file: the byte where its last item ends}`` of metadata that :func:`check_storage` accepted."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


class _CheckedFiles(FileSystem):
    """DCP's file system for reading, where a stream is a file of the step folder opened by
    pipelines.job.checkpoint.reading (checked first, every read timed) and nothing else."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        path = Path(path)
        if mode != "rb" or path.parent != self.folder:
            raise ValueError(f"{self.folder}: refused: DCP asked to open {path} ({mode!r}) outside the checkpoint")
        with reading.open_checked(self.folder, path.name) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``, and files opened only once checked.
    ``metadata``: what :func:`check_metadata` returned, used as is (the bytes it verified), instead of a new read."""

    def __init__(self, path: str | Path, metadata: Optional[Metadata] = None) -> None:
        super().__init__(path)
        self.fs = _CheckedFiles(Path(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata if self._metadata is not None else read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_storage(Path(self.path) / METADATA_FILE, metadata)  # what every rank reads, after the broadcast too
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Summed:
    """A write result's storage info with its item's crc32 and its file's sums, read back right after the write;
    the coordinator's ``finish`` gets every rank's and hands DCP the plain storage info."""

    info: _StorageInfo
    crc32: int
    file_size: int
    file_sha256: str


class _Writer(FileSystemWriter):
    """The state handed to it is already this rank's own CPU copy (see ``snapshot``): torch's ``stage`` (the copy
    an async save makes first) hands it on as it is. ``sums``: filled on the coordinator with every file's sums."""

    def __init__(self, path: str, sums: Optional[dict[str, FileSum]], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.sums = sums

    def stage(self, state_dict):  # torch's name (AsyncStager): no second copy
        return state_dict

    def write_data(self, plan, planner) -> torch.futures.Future:
        results = super().write_data(plan, planner).wait()  # the file writer is done when it returns
        by_file: dict[str, list[WriteResult]] = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        out = []
        for name, written in by_file.items():  # read back right after the write: the bytes are in the page cache
            items = [(*_key(r), r.storage_data.offset, r.storage_data.length) for r in written]
            summed = reading.sum_file(Path(self.path) / name, items)
            out += [
                dataclasses.replace(r, storage_data=_Summed(r.storage_data, item.crc32, summed.size, summed.sha256))
                for r, item in zip(written, summed.items)
            ]
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(out)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = [[dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank] for rank in results]
        super().finish(metadata, plain)
        if self.sums is None:
            return
        items: dict[str, list[ItemSum]] = {}
        for r in (r for rank in results for r in rank):
            s = r.storage_data
            items.setdefault(s.info.relative_path, []).append(ItemSum(*_key(r), s.info.offset, s.info.length, s.crc32))
            self.sums[s.info.relative_path] = FileSum(s.file_size, s.file_sha256)
        for name, listed in items.items():
            self.sums[name] = dataclasses.replace(self.sums[name], items=tuple(sorted(listed, key=lambda i: i.start)))
        self.sums[METADATA_FILE] = reading.sum_file(Path(self.path) / METADATA_FILE)


def _key(result: WriteResult) -> tuple[str, Optional[tuple[int, ...]]]:
    offset = result.index.offset
    return result.index.fqn, None if offset is None else tuple(int(o) for o in offset)


@dataclasses.dataclass(frozen=True)
class RowShard:
    """A rank's rows ``[row_offset, row_offset + rows)`` of a tensor of ``num_rows`` rows."""

    row_offset: int
    num_rows: int

    def chunk(self, local: torch.Tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.row_offset, *[0] * (local.dim() - 1)]), sizes=local.size())


class _RowShards:
    """What both planners share: the row-sharded tensors set aside (``local``) from the rest, which torch's default
    planner handles. Each planner keeps its own ``set_up_planner`` signature: torch reads its parameters' names."""

    def __init__(self, shards: Mapping[str, RowShard]) -> None:
        super().__init__()
        self.shards = dict(shards)

    def _set_aside(self, state_dict) -> dict:
        self.local = {k: v for k, v in state_dict.items() if k in self.shards}
        return {k: v for k, v in state_dict.items() if k not in self.shards}


class _SavePlanner(_RowShards, DefaultSavePlanner):
    """The default planner, with each row shard written as a chunk of its whole tensor."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(self._set_aside(state_dict), storage_meta, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, local in self.local.items():
            if local.shape[0] == 0:  # a rank without rows of this table writes no chunk
                continue
            shard = self.shards[key]
            chunk = shard.chunk(local)
            items.append(
                WriteItem(
                    index=MetadataIndex(key, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties.create_from_tensor(local),
                        size=torch.Size([shard.num_rows, *local.shape[1:]]),
                    ),
                )
            )
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        local = self.local.get(index.fqn)
        return local if local is not None else super().lookup_object(index)


class _LoadPlanner(_RowShards, DefaultLoadPlanner):
    """The default planner, with row shards read from the saved chunks that overlap them, and no unpickling."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(self._set_aside(state_dict), metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, local in self.local.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key!r} (another model or embedding optimizer?)")
            shard = self.shards[key]
            if tuple(md.size) != (shard.num_rows, *local.shape[1:]):
                raise ValueError(
                    f"checkpoint tensor {key!r} has shape {tuple(md.size)}, this job's is "
                    f"{(shard.num_rows, *local.shape[1:])}"
                )
            if local.shape[0]:
                items += create_read_items_for_chunk_list(key, md, [shard.chunk(local)])
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        local = self.local.get(index.fqn)
        return local if local is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(
            f"refused: checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor "
            "(loading it would run it as code)"
        )


def _dist_kwargs(group) -> dict:
    if dist.is_available() and dist.is_initialized():
        return {"process_group": group}
    return {"no_dist": True}  # one process, no process group (tests, a single-process script)


@contextlib.contextmanager
def _quiet_single_process():
    # Without a process group DCP warns on every call that it assumes one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(
    directory: str | Path,
    state: Mapping[str, torch.Tensor],
    shards: Mapping[str, RowShard],
    group=None,
    async_save: bool = False,
    sums: Optional[dict[str, FileSum]] = None,
) -> Optional[Future]:
    """Writes ``state`` (this rank's tensors; ``shards``: the keys that are row shards) into ``directory``;
    collective over ``group``. ``async_save``: returns the future of DCP's async_save (the state must be this
    rank's own copy: it is written while training goes on). ``sums``: on the coordinator, filled with each data
    file's and ``.metadata``'s sums once the write completes."""
    writer = _Writer(str(directory), sums, sync_files=True)
    kwargs = dict(storage_writer=writer, planner=_SavePlanner(shards), **_dist_kwargs(group))
    with _quiet_single_process():
        if not async_save:
            dcp.save(dict(state), **kwargs)
            return None
        result = dcp.async_save(dict(state), **kwargs)
    return getattr(result, "upload_completion", result)  # newer torch may answer an AsyncSaveResponse


def load(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    shards: Mapping[str, RowShard],
    group=None,
    metadata: Optional[Metadata] = None,
) -> None:
    """Fills ``state``'s tensors in place from ``directory`` (row shards: their rows only); collective.
    ``metadata``: the checked metadata (:func:`check_metadata`), read anew when not given."""
    reader = SafeReader(directory, metadata)
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(shards), **_dist_kwargs(group))
