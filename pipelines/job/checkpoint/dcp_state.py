"""The job's state as DCP tensors plus a skeleton for each rank's own file (pipelines.job.checkpoint.checkpointer).

What DCP holds (tensors only, flat keys):

    model.<state_dict key>        the dense model (replicated: DCP writes one copy, whichever rank its planner picks)
    optimizer.<path>              the dense optimizer's tensors (``optimizer.state.0.exp_avg``), replicated too
    tables.<module>.<table>.<s>   a sharded table's weight (``s`` = ``weight``) and each per-row optimizer state
                                  (``sum`` for row-wise Adagrad, ``m``/``v``/``step`` for Adam): one logical tensor
                                  of the table's full shape [num_rows, ...], one row-wise chunk per rank
                                  (pipelines.job.checkpoint.dcp)

What stays out: everything that is not a tensor (param groups, other modules' extra state) and what only its rank
can use (the prioritized collection's exchange in flight) go to the skeleton, in which each tensor leaf is
``{REF: its DCP key}``; the rank's file holds it beside the loader state, read with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipelines.job.checkpoint.dcp import RowShard

REF = "__dcp__"  # a skeleton's tensor leaf: {REF: its DCP key}


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
            raise ValueError(
                f"checkpoint {directory}: its rank file names tensor {key!r}, which its DCP metadata lacks"
            )
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return out


def owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that nothing else writes to (the async save writes it while training goes on)."""
    return t.detach().to("cpu", copy=True)


def nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------------------------------------- the job's state
EXTRA_STATE = "._extra_state"


def _collections(model: torch.nn.Module) -> dict[str, Any]:
    """``{state_dict key of its extra state: collection}`` for each sharded embedding collection in ``model``."""
    from fsembed.sharded import ShardedEmbeddingCollection

    return {
        f"{name}{EXTRA_STATE}": m
        for name, m in model.named_modules()
        if name and isinstance(m, ShardedEmbeddingCollection)
    }


def _table_key(extra_key: str, table: str, suffix: str) -> str:
    return f"tables.{extra_key[: -len(EXTRA_STATE)]}.{table}.{suffix}"


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """This rank's part of a checkpoint: ``(tensors for DCP, their row shards, skeleton for the rank's file)``.
    Every tensor is a CPU copy of its own. Call after the wrap's ``flush()`` on every rank."""
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
    metadata: Metadata  # the checked metadata the load reads by (pipelines.job.checkpoint.dcp.load)


def targets(directory: str | Path, skeleton: dict, model: torch.nn.Module, metadata: Metadata) -> Targets:
    """Empty tensors for every tensor of ``skeleton`` (shapes from the checkpoint's checked ``metadata``) and for
    this rank's rows of each sharded table under the model's plan (which may be another world size's, with other
    boundaries)."""
    directory = Path(directory)
    keys = refs(skeleton["model"]) + refs(skeleton["optimizer"])
    out = Targets(empty_targets(keys, metadata, directory), {}, {}, metadata)
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


def apply(
    directory: str | Path,
    loaded: Targets,
    skeleton: dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    same_world: bool,
) -> None:
    """Puts loaded tensors into the model and optimizer: the tables restacked for this rank, the exchange in flight
    only at the same world size. ValueError (one line) when the checkpoint does not fit the model."""
    from fsembed.reshard import stack_rank_state

    model_state = join_tensors(skeleton["model"], loaded.state)
    for key, collection in _collections(model).items():
        saved = skeleton["extra"].get(key, {})
        model_state[key] = {
            "world_size": collection.plan.world_size,
            "rank": collection.rank,
            "tables": stack_rank_state(loaded.local.get(key, {}), collection.plan),
            **({"in_flight": saved.get("in_flight", {})} if same_world else {}),
        }
    try:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(join_tensors(skeleton["optimizer"], loaded.state))
    except (RuntimeError, KeyError, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ValueError(
            f"checkpoint {directory} does not fit this job's model or optimizer: {' '.join(lines[:2])}"
        ) from None
