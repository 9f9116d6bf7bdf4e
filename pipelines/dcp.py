"""The job's state in ``torch.distributed.checkpoint`` (DCP): what goes in, how row-wise shards map onto it, and
how it is read back without unpickling code.

What DCP holds (tensors only, flat keys):

    model.<state_dict key>        the dense model (replicated: DCP writes one copy, whichever rank its planner picks)
    optimizer.<path>              the dense optimizer's tensors (``optimizer.state.0.exp_avg``), replicated too
    tables.<module>.<table>.<s>   a sharded table's weight (``s`` = ``weight``) and each per-row optimizer state
                                  (``sum`` for row-wise Adagrad, ``m``/``v``/``step`` for Adam): ONE logical tensor
                                  of the table's full shape [num_rows, ...], written as one chunk per rank

Uneven shards. A rank's rows of a table are the range ``[b[r], b[r+1])`` of the plan's ``row_boundaries`` (torchrec's
even split or any sorted split the user gave, ranks with no rows included). Each rank writes its range as a
chunk of the whole table: ``ChunkStorageMetadata(offsets=(b[r], 0), sizes=(b[r+1] - b[r], dim))``, the same chunk
metadata DCP records for a ShardedTensor's shards, so ``.metadata`` describes the whole table and any DCP tool reads
it whole. On load each rank asks for its new range ``[b'[r], b'[r+1])`` under the new plan (another world size,
other boundaries) and DCP reads the overlapping parts of the saved chunks: resharding without gathering a table.
The shards are plain tensors in the state dict; the planners below know their row offsets (DTensor's Shard(0)
cannot express arbitrary boundaries, and ShardedTensor's operations warn that they are deprecated).

What stays out: everything that is not a tensor (param groups, the loader's and balancer's state, the step) and
what only one rank can use (the prioritized collection's exchange in flight) go to the rank's own file
(pipelines.checkpoint), whose skeleton names each tensor leaf by its DCP key (``{REF: key}``).

Reading is safe. DCP's stock reader unpickles ``.metadata`` with ``pickle.load``; :func:`read_metadata` uses an
unpickler that resolves only DCP's metadata classes, torch dtypes/layouts/sizes and paths, and refuses any other
name before anything is constructed. The stock load planner would ``torch.load(weights_only=False)`` a non-tensor
item; FreeScale writes none, so :func:`check_metadata` refuses a checkpoint that declares one, and the planner
refuses one again should it be asked to read it. Tensor data is read by DCP with ``weights_only=True``.
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
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
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

REF = "__dcp__"  # a skeleton's tensor leaf: {REF: its DCP key}
METADATA_FILE = ".metadata"

# What DCP's .metadata may name (torch 2.11 .. 2.13 write these); anything else is refused unread.
_METADATA = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    (_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("builtins", "object"), ("builtins", "set"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_metadata(path: str | Path) -> Metadata:
    """``<dir>/.metadata`` (or the file itself), unpickled with DCP's metadata classes only; ValueError (one line)
    for a file that names anything else or is not DCP metadata."""
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refused: {e}, which loading would run as code (DCP metadata holds only "
                         "torch.distributed.checkpoint.metadata classes)") from None
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (a DCP checkpoint's index, written last by DCP's coordinator)") from None
    except (EOFError, OSError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: not readable DCP metadata (truncated or corrupt?): {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


def check_metadata(directory: str | Path) -> Metadata:
    """The metadata of a FreeScale DCP checkpoint, checked before anything is read: every item a tensor, every data
    file a plain name inside ``directory`` and at least as long as the items it holds. ValueError (one line)."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{directory / METADATA_FILE}: refused: item {key!r} is a pickled object, not a tensor "
                             "(FreeScale keeps non-tensor state out of DCP; loading it would run it as code)")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{directory / METADATA_FILE}: refused: data file {name!r} lies outside the checkpoint")
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            raise ValueError(f"checkpoint {directory} is incomplete: it lacks {name} (a DCP data file)")
        if size < end:
            raise ValueError(f"{path}: cut short: {size} bytes, its items end at byte {end} (truncated)")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Writer(FileSystemWriter):
    """The state handed to it is already this rank's own CPU copy (see ``snapshot``): staging it again for an async
    save would only copy it a second time."""

    def stage(self, state_dict):
        return state_dict


@dataclasses.dataclass(frozen=True)
class RowShard:
    """A rank's rows ``[row_offset, row_offset + rows)`` of a tensor of ``num_rows`` rows."""

    row_offset: int
    num_rows: int

    def chunk(self, local: torch.Tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.row_offset, *[0] * (local.dim() - 1)]), sizes=local.size())


class _SavePlanner(DefaultSavePlanner):
    """The default planner, with each row shard written as a chunk of its whole tensor."""

    def __init__(self, shards: Mapping[str, RowShard]) -> None:
        super().__init__()
        self.shards = dict(shards)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.local = {k: v for k, v in state_dict.items() if k in self.shards}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.shards}, storage_meta, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, local in self.local.items():
            if local.shape[0] == 0:  # a rank without rows of this table writes no chunk
                continue
            shard = self.shards[key]
            chunk = shard.chunk(local)
            items.append(WriteItem(
                index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local),
                                            size=torch.Size([shard.num_rows, *local.shape[1:]])),
            ))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        local = self.local.get(index.fqn)
        return local if local is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """The default planner, with row shards read from the saved chunks that overlap them, and no unpickling."""

    def __init__(self, shards: Mapping[str, RowShard]) -> None:
        super().__init__()
        self.shards = dict(shards)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.local = {k: v for k, v in state_dict.items() if k in self.shards}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.shards}, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, local in self.local.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key!r} (another model or embedding optimizer?)")
            shard = self.shards[key]
            if tuple(md.size) != (shard.num_rows, *local.shape[1:]):
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(md.size)}, this job's is "
                                 f"{(shard.num_rows, *local.shape[1:])}")
            if local.shape[0]:
                items += create_read_items_for_chunk_list(key, md, [shard.chunk(local)])
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        local = self.local.get(index.fqn)
        return local if local is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(f"refused: checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor "
                         "(loading it would run it as code)")


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


def save(directory: str | Path, state: Mapping[str, torch.Tensor], shards: Mapping[str, RowShard], group=None,
         async_save: bool = False) -> Optional[Future]:
    """Writes ``state`` (this rank's tensors; ``shards``: the keys that are row shards) into ``directory``;
    collective over ``group``. ``async_save``: returns the future of DCP's async_save (the state must be this
    rank's own copy: it is written while training goes on)."""
    writer = _Writer(str(directory), sync_files=True)
    kwargs = dict(storage_writer=writer, planner=_SavePlanner(shards), **_dist_kwargs(group))
    with _quiet_single_process():
        if not async_save:
            dcp.save(dict(state), **kwargs)
            return None
        result = dcp.async_save(dict(state), **kwargs)
    return getattr(result, "upload_completion", result)  # newer torch may answer an AsyncSaveResponse


def load(directory: str | Path, state: dict[str, torch.Tensor], shards: Mapping[str, RowShard], group=None) -> None:
    """Fills ``state``'s tensors in place from ``directory`` (row shards: their rows only); collective."""
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeReader(str(directory)), planner=_LoadPlanner(shards), **_dist_kwargs(group))


# ---------------------------------------------------------------------------------------------- skeletons
def split_tensors(tree: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    """``tree`` with every tensor leaf replaced by ``{REF: key}`` (the tensor goes to ``out[key]``)."""
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
        return {REF: prefix}
    if isinstance(tree, Mapping):
        return {k: split_tensors(v, f"{prefix}.{k}", out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(split_tensors(v, f"{prefix}.{i}", out) for i, v in enumerate(tree))
    return tree


def _is_ref(tree: Any) -> bool:
    return isinstance(tree, dict) and len(tree) == 1 and REF in tree


def refs(tree: Any) -> list[str]:
    if _is_ref(tree):
        return [tree[REF]]
    if isinstance(tree, Mapping):
        return [k for v in tree.values() for k in refs(v)]
    if isinstance(tree, (list, tuple)):
        return [k for v in tree for k in refs(v)]
    return []


def join_tensors(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    if _is_ref(tree):
        return tensors[tree[REF]]
    if isinstance(tree, Mapping):
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(join_tensors(v, tensors) for v in tree)
    return tree


def empty_targets(keys: list[str], metadata: Metadata, directory: Path) -> dict[str, torch.Tensor]:
    """CPU tensors of each key's saved shape and dtype, for DCP to fill."""
    out = {}
    for key in keys:
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"checkpoint {directory}: its rank file names tensor {key!r}, which its DCP metadata lacks")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return out


def owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that nothing else writes to (the async save writes it while training goes on)."""
    return t.detach().to("cpu", copy=True)


def nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


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


# ---------------------------------------------------------------------------------------------- the job's state
EXTRA_STATE = "._extra_state"


def _collections(model: torch.nn.Module) -> dict[str, Any]:
    """``{state_dict key of its extra state: collection}`` for each sharded embedding collection in ``model``."""
    from fsembed.sharded import ShardedEmbeddingCollection

    return {f"{name}{EXTRA_STATE}": m for name, m in model.named_modules()
            if name and isinstance(m, ShardedEmbeddingCollection)}


def _table_key(extra_key: str, table: str, suffix: str) -> str:
    return f"tables.{extra_key[: -len(EXTRA_STATE)]}.{table}.{suffix}"


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """This rank's part of a checkpoint: ``(tensors for DCP, their row shards, skeleton for the rank's file)``.
    Every tensor is a CPU copy of its own. Call after the pipeline's ``flush()`` on every rank."""
    from fsembed.reshard import split_rank_state

    model_state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, RowShard] = {}
    extra: dict[str, dict] = {}
    for key, collection in _collections(model).items():
        ext = model_state.pop(key)
        plan, rank = collection.plan, collection.rank
        # tables_state() gave clones: their row slices are owned already (on a GPU they are copied to the host)
        for suffix, tables in split_rank_state(ext["tables"], plan, rank).items():
            for table, rows in tables.items():
                k = _table_key(key, table, suffix)
                tensors[k] = rows.detach().cpu()
                shards[k] = RowShard(int(plan.row_boundaries[table][rank]), plan.table(table).num_rows)
        extra[key] = {name: _to_cpu(v) for name, v in ext.items() if name != "tables"}
        extra[key]["row_boundaries"] = {t: b.tolist() for t, b in plan.row_boundaries.items()}
    dense: dict[str, torch.Tensor] = {}
    skeleton = {
        "model": split_tensors(model_state, "model", dense),
        "optimizer": split_tensors(optimizer.state_dict(), "optimizer", dense),
        "extra": extra,
    }
    tensors.update({k: owned_cpu(v) for k, v in dense.items()})
    return tensors, shards, skeleton


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


@dataclasses.dataclass
class Targets:
    """What a load fills: DCP's tensors (``state``), which of them are row shards, and per collection the rows
    this rank gets under its plan (``{suffix: {table: tensor}}``, views of ``state``)."""

    state: dict[str, torch.Tensor]
    shards: dict[str, RowShard]
    local: dict[str, dict[str, dict[str, torch.Tensor]]]


def targets(directory: str | Path, skeleton: dict, model: torch.nn.Module) -> Targets:
    """Empty tensors for every tensor of ``skeleton`` (shapes from the checkpoint's metadata) and for this rank's
    rows of each sharded table under the model's plan (which may be another world size's, with other boundaries)."""
    directory = Path(directory)
    metadata = check_metadata(directory)
    out = Targets(empty_targets(refs(skeleton["model"]) + refs(skeleton["optimizer"]), metadata, directory), {}, {})
    for key, collection in _collections(model).items():
        plan, rank = collection.plan, collection.rank
        for layout in plan.groups:
            shard = collection.shards[layout.name]
            for suffix, like in {"weight": shard.weight, **shard.state}.items():
                for table in layout.tables:
                    rb = plan.row_boundaries[table]
                    k = _table_key(key, table, suffix)
                    out.state[k] = torch.empty((int(rb[rank + 1] - rb[rank]), *like.shape[1:]), dtype=like.dtype)
                    out.shards[k] = RowShard(int(rb[rank]), plan.table(table).num_rows)
                    out.local.setdefault(key, {}).setdefault(suffix, {})[table] = out.state[k]
    return out


def apply(directory: str | Path, loaded: Targets, skeleton: dict, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer, same_world: bool) -> None:
    """Puts loaded tensors into the model and optimizer: the tables restacked for this rank, the exchange in flight
    only at the same world size. ValueError (one line) when the checkpoint does not fit the model."""
    from fsembed.reshard import stack_rank_state

    model_state = join_tensors(skeleton["model"], loaded.state)
    for key, collection in _collections(model).items():
        saved = skeleton["extra"].get(key, {})
        model_state[key] = {"world_size": collection.plan.world_size, "rank": collection.rank,
                            "tables": stack_rank_state(loaded.local.get(key, {}), collection.plan),
                            **({"in_flight": saved.get("in_flight", {})} if same_world else {})}
    try:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(join_tensors(skeleton["optimizer"], loaded.state))
    except (RuntimeError, KeyError, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ValueError(f"checkpoint {directory} does not fit this job's model or optimizer: {' '.join(lines[:2])}") from None
