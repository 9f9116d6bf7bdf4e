"""fsembed: row-wise sharded embedding tables, sparse optimizers, synchronous and prioritized updates."""
