"""fsembed: row-wise sharded embedding tables, sparse optimizers, synchronous and prioritized updates."""

from fsembed.id_prefetch import PrefetchedIds, ShardedIds, id_prefetch_stages
from fsembed.optim import SGD, Adam, RowWiseAdagrad, RowWiseOptimizer, get_optimizer
from fsembed.plan import GroupLayout, ShardingPlan, TableConfig, row_wise_boundaries
from fsembed.prioritized import PrioritizedEmbeddingCollection
from fsembed.sharded import EMB_A2A, GRAD_A2A, IDS_A2A, ShardedEmbeddingCollection
from fsembed.swap import find_embeddings, swap_embeddings
from fsembed.transports import EmbeddingTransports, embedding_transports

__all__ = [
    "PrefetchedIds",
    "ShardedIds",
    "id_prefetch_stages",
    "EmbeddingTransports",
    "embedding_transports",
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
