"""fsembed: row-wise sharded embedding tables, sparse optimizers, synchronous and prioritized updates."""

from typing import Any

from fscomm.renamed import warn_renamed
from fsembed.id_prefetch import PrefetchedIds, ShardedIds, id_prefetch_stages
from fsembed.optim import SGD, Adam, RowWiseAdagrad, RowWiseOptimizer, get_optimizer
from fsembed.plan import GroupLayout, ShardingPlan, TableConfig, row_wise_boundaries
from fsembed.prioritized import PrioritizedEmbeddingCollection
from fsembed.sharded import EMB_A2A, GRAD_A2A, IDS_A2A, ShardedEmbeddingCollection
from fsembed.swap import EmbeddingHub, find_embeddings, swap_embeddings
from fsembed.transports import EmbeddingTransports, embedding_transports

__all__ = [
    "PrefetchedIds",
    "ShardedIds",
    "id_prefetch_stages",
    "EmbeddingTransports",
    "embedding_transports",
    "EmbeddingHub",
    "swap_embeddings",
    "find_embeddings",
    "SGD",
    "Adam",
    "RowWiseAdagrad",
    "RowWiseOptimizer",
    "get_optimizer",
    "GroupLayout",
    "ShardingPlan",
    "TableConfig",
    "row_wise_boundaries",
    "PrioritizedEmbeddingCollection",
    "ShardedEmbeddingCollection",
    "IDS_A2A",
    "EMB_A2A",
    "GRAD_A2A",
]

# Old names, answered for one release with a DeprecationWarning: old name -> new name.
_RENAMED = {"StageTransports": "EmbeddingTransports", "stage_transports": "embedding_transports"}


def __getattr__(name: str) -> Any:
    if name not in _RENAMED:
        raise AttributeError(f"module 'fsembed' has no attribute {name!r}")
    warn_renamed("fsembed", name, _RENAMED[name])
    return globals()[_RENAMED[name]]
