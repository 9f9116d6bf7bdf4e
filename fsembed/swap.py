"""Module swap: the user's embedding modules, found by name, replaced by views of one sharded collection.

    hub = swap_embeddings(model, ["item_emb", "user_emb"], mode="prioritized")    # or an EmbeddingCollection's name
    for batch, next_batch in ...:
        hub.prepare(features_of(batch), features_of(next_batch))   # the exchanges of every table, once
        loss = model(batch)                                        # model code unchanged: item_emb(ids) works
        loss.backward()

The named modules may be ``nn.Embedding`` (one table, its feature is the module's name) or torchrec's
``EmbeddingCollection`` (its tables and feature names as configured). All tables go into one ShardingPlan,
which groups tables of the same dtype and dim (all row-wise), so one set of AllToAlls serves every module of a
group however many the model has. The replaced module's ``forward`` returns the rows prepared for its ids
(checked equal to what it is called with, so a mismatch between the extractor and the model fails loudly).
The collection is registered in the model as ``fsembed_collection``: its tables, optimizer state and, for
prioritized updates, the exchange in flight ride in ``model.state_dict()``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from fsembed.plan import ShardingPlan, TableConfig
from fsembed.prioritized import PrioritizedEmbeddingCollection
from fsembed.sharded import ShardedEmbeddingCollection

COLLECTION_NAME = "fsembed_collection"


class EmbeddingHub:
    """Runs the collection once per step and hands each swapped module its rows."""

    def __init__(self, collection: ShardedEmbeddingCollection):
        self.collection = collection
        self._ids: dict[str, torch.Tensor] = {}
        self._out: dict[str, torch.Tensor] = {}
        self._unchecked: list[tuple[str, torch.Tensor]] = []  # (feature, device flag: ids differed), see rows()

    def prepare(self, features: Mapping[str, torch.Tensor], next_features=None, *, prefetched=None) -> None:
        """Looks up every feature of this step (``next_features``: the next step's, for prioritized updates;
        ``prefetched``: this step's ID exchange started earlier by ``collection.exchange_ids(features)``)."""
        self.verify()
        self._ids = {k: v.reshape(-1) for k, v in features.items()}
        self._out = self.collection(prefetched if prefetched is not None else features, next_features)

    def rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """The prepared rows of ``feature``; ``ids`` must be the ids ``prepare`` received.

        Shapes are compared at once. Values are compared at once on the CPU; on a GPU reading the comparison back
        would synchronise the device in the middle of the forward (the GPU drains, then idles while the host
        queues the rest), so the comparison is queued and read back at the next ``prepare`` (or ``verify()``),
        when the step has synchronised anyway: a mismatch still raises, one step later at most."""
        if feature not in self._out:
            raise ValueError(f"fsembed swap: feature {feature!r} was not prepared this step (call hub.prepare(features) before the model)")
        flat, prepared = ids.reshape(-1), self._ids[feature]
        if flat.shape != prepared.shape:
            raise self._mismatch([feature])
        if flat is not prepared:
            if flat.device.type == "cpu" and prepared.device.type == "cpu":
                if not torch.equal(flat, prepared):
                    raise self._mismatch([feature])
            else:
                self._unchecked.append((feature, (flat.to(prepared.device, non_blocking=True) != prepared).any()))
        return self._out[feature]

    def verify(self) -> None:
        """Raises if a swapped module was called with other ids than ``prepare`` received (the checks ``rows``
        queued on the device)."""
        unchecked, self._unchecked = self._unchecked, []
        bad = [feature for feature, differs in unchecked if bool(differs)]
        if bad:
            raise self._mismatch(bad)

    @staticmethod
    def _mismatch(features: list[str]) -> ValueError:
        return ValueError(f"fsembed swap: module of feature(s) {features} was called with other ids than hub.prepare received")


class ShardedEmbeddingView(nn.Module):
    """Stands in for an ``nn.Embedding``: ``forward(ids) -> Tensor[*ids.shape, dim]``."""

    def __init__(self, hub: EmbeddingHub, feature: str, dim: int):
        super().__init__()
        self._hub, self.feature, self.dim = hub, feature, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._hub.rows(self.feature, ids).reshape(*ids.shape, self.dim)


class ShardedCollectionView(nn.Module):
    """Stands in for a torchrec ``EmbeddingCollection``: ``forward(kjt) -> {feature: JaggedTensor}``."""

    def __init__(self, hub: EmbeddingHub, features: Sequence[str]):
        super().__init__()
        self._hub, self.features = hub, list(features)

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jts = kjt.to_dict()
        return {f: JaggedTensor(values=self._hub.rows(f, jts[f].values()), lengths=jts[f].lengths()) for f in self.features if f in jts}


def _tables_of(name: str, module: nn.Module) -> list[tuple[TableConfig, torch.Tensor]]:
    if isinstance(module, nn.Embedding):
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError(f"fsembed swap: module {name!r}: padding_idx, max_norm and sparse=True are not supported")
        w = module.weight.detach()
        return [(TableConfig(name.replace(".", "_"), w.shape[0], w.shape[1], (name,), w.dtype), w)]
    if type(module).__name__ == "EmbeddingCollection" and hasattr(module, "embedding_configs"):
        out = []
        for cfg in module.embedding_configs():
            w = module.embeddings[cfg.name].weight.detach()
            out.append((TableConfig(cfg.name, cfg.num_embeddings, cfg.embedding_dim, tuple(cfg.feature_names), w.dtype), w))
        return out
    raise ValueError(f"fsembed swap: module {name!r} is a {type(module).__name__}, expected nn.Embedding or torchrec EmbeddingCollection")


def swap_embeddings(
    model: nn.Module,
    names: Sequence[str],
    *,
    mode: str = "sync",
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    **collection_kwargs,
) -> EmbeddingHub:
    """Replaces the modules ``names`` of ``model`` (paths as in ``named_modules()``) in place; returns the hub.

    Initial values are the modules' own weights (identical on every rank, as after a seeded construction).
    ``collection_kwargs`` go to the collection (optimizer, transport, grad_scale, device, timer).
    """
    import torch.distributed as dist

    if mode not in ("sync", "prioritized"):
        raise ValueError(f"fsembed swap: mode must be 'sync' or 'prioritized', got {mode!r}")
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules or n == ""]
    if missing:
        raise ValueError(f"fsembed swap: no module named {missing} in {type(model).__name__} (named_modules() has {sorted(modules)[:20]}...)")
    found = {n: _tables_of(n, modules[n]) for n in names}
    tables = [t for pairs in found.values() for t, _ in pairs]
    init = {t.name: w for pairs in found.values() for t, w in pairs}
    plan = ShardingPlan(tables, world_size if world_size is not None else dist.get_world_size())
    cls = PrioritizedEmbeddingCollection if mode == "prioritized" else ShardedEmbeddingCollection
    collection = cls(plan, rank, init_tables=init, **collection_kwargs)
    hub = EmbeddingHub(collection)
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(modules[n], nn.Embedding):
            view: nn.Module = ShardedEmbeddingView(hub, n, modules[n].embedding_dim)
        else:
            view = ShardedCollectionView(hub, [f for t, _ in found[n] for f in t.features])
        setattr(parent, child, view)
    model.add_module(COLLECTION_NAME, collection)
    return hub
