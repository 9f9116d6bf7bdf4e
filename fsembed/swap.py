"""Module swap: the user's embedding modules, found by name or by type, replaced by views of one sharded collection.

    swapped = swap_embeddings(model, ["item_emb", "user_emb"], source=wrap, schedule="prioritized")  # by name
    swapped = swap_embeddings(model, types=["EmbeddingCollection"], source=wrap)                # or by type

``source`` is what the views ask for their rows (:class:`RowSource`): the embedding wrap
(pipelines.api.wrap.EmbeddingWrap), the one object between the model and the collection. Per forward it runs
``swapped.collection(ids, next_ids)`` once, for every table, and holds the result as :class:`ForwardRows`, from
which each view's call takes its rows; ``pipelines.api.step.wrap_model`` and ``TrainStep`` do all this, and connect
the loader's ID prefetch: a user's loop need not.

The modules may be ``nn.Embedding`` (one table, its feature is the module's name) or torchrec's
``EmbeddingCollection`` (its tables and feature names as configured; a table may serve several features).
All tables go into one ShardingPlan, which groups tables of the same dtype and dim (all row-wise, torchrec's
split unless ``row_boundaries`` gives another), so one set of AllToAlls serves every module of a group however
many the model has. Pooled modules (``nn.EmbeddingBag``, torchrec's ``EmbeddingBagCollection``) are refused:
prioritized updates split each looked-up row's gradient by whether the next batch uses the row again, which needs
the gradient of every row of every id, not of a pooled sum.

The replaced module's ``forward`` returns the rows prepared for its ids, held for one forward (the ids and rows of
this step, nowhere else) and checked equal to what it is called with, so a mismatch between the features function
and the model fails loudly. A module called more than once per step is prepared with the ids of every call, in
call order (a list per feature, or one concatenated tensor): each call takes the next ids' rows; a module called
again with all of its ids gets the same rows again.
The collection is registered in the model as ``fsembed_collection``: its tables, optimizer state and, for
prioritized updates, the exchange in flight ride in ``model.state_dict()``.

The user's own modules are kept (``swapped.modules``) with their parameters moved to the meta device (shapes and
dtypes kept, storage released: the tables live in the collection, and a second whole copy on every rank is what
sharding avoids). :func:`unswap_embeddings` puts them back, filled with the trained tables gathered to one rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import nn

from fsdata.batch import kjt_split
from fsembed.plan import ShardingPlan, TableConfig
from fsembed.prioritized import PrioritizedEmbeddingCollection
from fsembed.schedules import get_schedule
from fsembed.sharded import ShardedEmbeddingCollection

COLLECTION_NAME = "fsembed_collection"
SWAPPABLE_TYPES = ("Embedding", "EmbeddingCollection")
POOLED_TYPES = ("EmbeddingBag", "EmbeddingBagCollection")
CALLS_HINT = (
    "A module called more than once per step must be prepared with the ids of every call: return them from "
    "features(batch) as a list in call order, {feature: [ids_of_call_1, ids_of_call_2]}, or concatenated"
)


class RowSource(Protocol):
    """What the swapped modules ask their rows of: the embedding wrap (pipelines.api.wrap.EmbeddingWrap), which
    looks every feature up once per forward (:class:`ForwardRows`)."""

    def rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SwappedModule:
    """A user's embedding module replaced by a view: the module itself, its parameters on the meta
    device, and where each of its tables goes back."""

    module: nn.Module
    tables: dict[str, tuple[str, torch.device]]  # table -> (its parameter's path in the module, the weight's device)


@dataclass
class Swapped:
    """What :func:`swap_embeddings` did to a model: the one collection its views read, and the user's modules they
    replaced (path in the model -> :class:`SwappedModule`), for :func:`unswap_embeddings`."""

    collection: ShardedEmbeddingCollection
    modules: dict[str, SwappedModule] = field(default_factory=dict)


class ForwardRows:
    """One forward's lookup: the ids prepared per feature, their rows, and what the swapped modules' calls took of
    them; each call gets the rows of the next ids, checked equal to the ids it is called with.

    Shapes are compared at once. Values are compared at once on the CPU; on a GPU reading the comparison back
    would synchronise the device in the middle of the forward (the GPU drains, then idles while the host queues
    the rest), so the comparison is queued and read back by :meth:`verify` (the wrap calls it at its next lookup or
    flush, when the step has synchronised anyway): a mismatch still raises, one step later at most."""

    def __init__(self, ids: Mapping[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> None:
        self.ids, self.rows = ids, rows
        self.taken = {k: 0 for k in ids}
        self._unchecked: list[tuple[str, torch.Tensor]] = []  # (feature, device flag: ids differed)

    def take(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``feature`` for this call; ``ids`` must be the next ids of those prepared for it (a module
        called again with all of its prepared ids gets the same rows again; called with the prepared tensor
        itself, nothing is compared)."""
        if feature not in self.rows:
            raise ValueError(
                f"fsembed swap: feature {feature!r} was not looked up this step (prepared: {sorted(self.rows)})"
            )
        every = self.ids[feature]
        flat = ids if ids.dim() == 1 else ids.reshape(-1)
        if flat.dtype != every.dtype:  # a KJT may hold int32 ids
            flat = flat.to(every.dtype)
        start = self.taken[feature] % max(every.numel(), 1)
        if start + flat.numel() > every.numel():
            raise ValueError(
                f"fsembed swap: module of feature {feature!r} was called with other ids than its step's lookup "
                f"prepared: this call asks for ids [{start}, {start + flat.numel()}) of the {every.numel()} "
                f"prepared. {CALLS_HINT}"
            )
        self.taken[feature] = start + flat.numel()
        prepared = every if flat.numel() == every.numel() else every[start : start + flat.numel()]
        if flat.shape != prepared.shape:
            raise mismatch([feature])
        if flat is not prepared:
            if flat.device.type == "cpu" and prepared.device.type == "cpu":
                if not torch.equal(flat, prepared):
                    raise mismatch([feature])
            else:
                self._unchecked.append((feature, (flat.to(prepared.device, non_blocking=True) != prepared).any()))
        out = self.rows[feature]
        return out if flat.numel() == every.numel() else out[start : start + flat.numel()]

    def finish(self) -> None:
        """Raises if a swapped module took only part of the ids prepared for it (the forward has returned)."""
        partial = {k: (c, self.ids[k].numel()) for k, c in self.taken.items() if c % max(self.ids[k].numel(), 1)}
        if partial:
            raise ValueError(
                f"fsembed swap: the model looked up only part of the ids prepared for {partial} (taken, "
                "prepared): features(batch) must give exactly the ids of every call of the module, in call order"
            )

    def verify(self) -> None:
        """Raises if a swapped module was called with other ids than prepared (the checks queued on the device)."""
        unchecked, self._unchecked = self._unchecked, []
        bad = [feature for feature, differs in unchecked if bool(differs)]
        if bad:
            raise mismatch(bad)


def mismatch(features: list[str]) -> ValueError:
    return ValueError(
        f"fsembed swap: module of feature(s) {features} was called with other ids than its step's lookup "
        f"prepared. {CALLS_HINT}"
    )


class ShardedEmbeddingView(nn.Module):
    """Stands in for an ``nn.Embedding``: ``forward(ids) -> Tensor[*ids.shape, dim]``."""

    def __init__(self, source: RowSource, feature: str, dim: int):
        super().__init__()
        self.source, self.feature, self.dim = source, feature, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(self.feature, ids).reshape(*ids.shape, self.dim)


class ShardedCollectionView(nn.Module):
    """Stands in for a torchrec ``EmbeddingCollection``: ``forward(kjt) -> {feature: JaggedTensor}``."""

    def __init__(self, source: RowSource, features: Sequence[str]):
        super().__init__()
        self.source, self.features = source, list(features)

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jts = kjt_split(kjt)
        return {
            f: JaggedTensor(values=self.source.rows(f, jts[f][0]), lengths=jts[f][1]) for f in self.features if f in jts
        }


def quiet_torchrec_notes() -> None:
    """torchrec's KeyedJaggedTensor ops call torch.fx's ``is_fx_tracing()``, which logs, once per process and rank,
    a deprecation note addressed to torchrec's authors: nothing a user of FreeScale can act on, so it is silenced
    (that one logger, errors still shown) wherever FreeScale takes torchrec types."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def kjt_ids(kjt) -> dict[str, torch.Tensor]:
    """The ids of every key of a KeyedJaggedTensor: what an EmbeddingCollection called once with it looks up."""
    return {k: v.to(torch.int64) for k, (v, _) in kjt_split(kjt).items()}


def _pooled_refusal(name: str, module: nn.Module) -> ValueError:
    return ValueError(
        f"fsembed swap: module {name!r} is a {type(module).__name__}, whose lookups are pooled: prioritized updates "
        "split each looked-up row's gradient by whether the next batch uses that row again, so they need one "
        "embedding per id (unpooled). Use nn.Embedding or torchrec's EmbeddingCollection (same tables and feature "
        "names) and pool its output in your model, e.g. torch.segment_reduce(jt.values(), 'sum', lengths=jt.lengths())"
    )


def _tables_of(name: str, module: nn.Module) -> list[tuple[TableConfig, torch.Tensor]]:
    if type(module).__name__ in POOLED_TYPES:
        raise _pooled_refusal(name, module)
    if isinstance(module, nn.Embedding):
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError(f"fsembed swap: module {name!r}: padding_idx, max_norm and sparse=True are not supported")
        w = module.weight.detach()
        return [(TableConfig(name.replace(".", "_"), w.shape[0], w.shape[1], (name,), w.dtype), w)]
    if type(module).__name__ == "EmbeddingCollection" and hasattr(module, "embedding_configs"):
        out = []
        for cfg in module.embedding_configs():
            w = module.embeddings[cfg.name].weight.detach()
            out.append(
                (TableConfig(cfg.name, cfg.num_embeddings, cfg.embedding_dim, tuple(cfg.feature_names), w.dtype), w)
            )
        return out
    raise ValueError(
        f"fsembed swap: module {name!r} is a {type(module).__name__}, expected nn.Embedding or torchrec "
        "EmbeddingCollection"
    )


def _table_params(name: str, module: nn.Module) -> dict[str, str]:
    """table -> the path of its weight in ``module`` (the names :func:`_tables_of` gives the tables)."""
    if isinstance(module, nn.Embedding):
        return {name.replace(".", "_"): "weight"}
    return {cfg.name: f"embeddings.{cfg.name}.weight" for cfg in module.embedding_configs()}


def _set_param(module: nn.Module, path: str, value: torch.Tensor, requires_grad: bool) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    owner._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)


def _keep(name: str, module: nn.Module) -> SwappedModule:
    """The module, its tables' weights replaced by meta parameters of the same shape and dtype. New parameter
    objects, not the old ones emptied: a weight the user also holds elsewhere (tied to an output layer) keeps
    its values there."""
    tables = {}
    for table, path in _table_params(name, module).items():
        weight = module.get_parameter(path)
        tables[table] = (path, weight.device)
        _set_param(module, path, weight.detach().to("meta"), weight.requires_grad)
    return SwappedModule(module, tables)


def unswap_embeddings(model: nn.Module, swapped: Swapped, dst: Optional[int] = 0) -> None:
    """The inverse of :func:`swap_embeddings`: puts the user's own modules back in ``model`` in place, and removes
    the collection. On rank ``dst`` their weights are the trained tables (gathered there one at a time); on the
    other ranks they stay on the meta device (same keys, shapes and dtypes; no values), or with ``dst=None`` every
    rank gets the tables. Collective: every rank calls it, after the collection's ``flush()``."""
    if model._modules.get(COLLECTION_NAME) is not swapped.collection:
        raise ValueError(
            f"fsembed unswap: {type(model).__name__} holds no collection of this swap (never swapped, or "
            "already unswapped)"
        )
    for name, kept in swapped.modules.items():  # the same order on every rank: the gathers pair up
        for table, (path, device) in kept.tables.items():
            full = swapped.collection.gather_table(table, dst)
            if full is not None:
                _set_param(kept.module, path, full.to(device), kept.module.get_parameter(path).requires_grad)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, kept.module)
    del model._modules[COLLECTION_NAME]
    swapped.modules = {}


def find_embeddings(model: nn.Module, types: Sequence[Union[str, type]]) -> list[str]:
    """Paths of the modules of ``model`` whose type is one of ``types`` (classes, or class names such as
    ``"EmbeddingCollection"``, so torchrec need not be imported), outermost first; none inside another found one."""
    wanted = {t if isinstance(t, str) else t.__name__ for t in types}
    unknown = wanted - set(SWAPPABLE_TYPES) - set(POOLED_TYPES)
    if unknown:
        raise ValueError(
            f"fsembed swap: types {sorted(unknown)} cannot be swapped; choose from {list(SWAPPABLE_TYPES)}"
        )
    found: list[str] = []
    for name, module in model.named_modules():
        if name and type(module).__name__ in wanted and not any(name.startswith(f + ".") for f in found):
            if type(module).__name__ in POOLED_TYPES:
                raise _pooled_refusal(name, module)
            found.append(name)
    if not found:
        raise ValueError(f"fsembed swap: {type(model).__name__} has no module of type {sorted(wanted)}")
    return found


def swap_embeddings(
    model: nn.Module,
    names: Optional[Sequence[str]] = None,
    *,
    source: RowSource,
    types: Optional[Sequence[Union[str, type]]] = None,
    schedule: str = "sync",
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    row_boundaries: Optional[Mapping[str, torch.Tensor]] = None,
    **collection_kwargs,
) -> Swapped:
    """Replaces the modules ``names`` of ``model`` (paths as in ``named_modules()``), or every module of one of
    ``types`` (:func:`find_embeddings`), in place, by views that take their rows from ``source``; returns what it
    did (:class:`Swapped`).

    Initial values are the modules' own weights (identical on every rank, as after a seeded construction); the
    modules themselves are kept in ``swapped.modules``, their parameters on the meta device, for
    :func:`unswap_embeddings`.
    ``row_boundaries``: the sharding plan, ``{table: [W+1] int64 row boundaries}`` for the tables that do not take
    torchrec's row-wise split. ``schedule`` (fsembed.schedules) picks the collection: the prioritized one for the
    schedules that prefetch rows, else the synchronous one. ``collection_kwargs`` go to the collection (optimizer,
    transport, grad_scale, device, timer).
    """
    import torch.distributed as dist

    prioritized = get_schedule(schedule).prioritized_collection
    if (names is None) == (types is None):
        raise ValueError("fsembed swap: give the modules to swap by names or by types (one of the two)")
    if names is None:
        names = find_embeddings(model, types)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules or n == ""]
    if missing:
        raise ValueError(
            f"fsembed swap: no module named {missing} in {type(model).__name__} (named_modules() has "
            f"{sorted(modules)[:20]}...)"
        )
    found = {n: _tables_of(n, modules[n]) for n in names}
    tables = [t for pairs in found.values() for t, _ in pairs]
    init = {t.name: w for pairs in found.values() for t, w in pairs}
    plan = ShardingPlan(
        tables,
        world_size if world_size is not None else dist.get_world_size(),
        row_boundaries=dict(row_boundaries or {}),
    )
    cls = PrioritizedEmbeddingCollection if prioritized else ShardedEmbeddingCollection
    collection = cls(plan, rank, init_tables=init, **collection_kwargs)
    swapped = Swapped(collection)
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(modules[n], nn.Embedding):
            view: nn.Module = ShardedEmbeddingView(source, n, modules[n].embedding_dim)
        else:
            view = ShardedCollectionView(source, [f for t, _ in found[n] for f in t.features])
        setattr(parent, child, view)
        swapped.modules[n] = _keep(n, modules[n])
    model.add_module(COLLECTION_NAME, collection)
    return swapped
