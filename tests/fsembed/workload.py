"""Shared workload of the fsembed tests: a small plan, per-step Zipf ids with a collision knob, a loss.

Every rank draws its own ids from a generator seeded by (seed, step, rank), so both training modes (and a
resumed run) see exactly the same inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from fsembed.plan import ShardingPlan, TableConfig

FEATURES = ("uih", "cand", "user")


def small_plan(world_size: int, user_dim: int = 4, item_dtype: torch.dtype = torch.float32) -> ShardingPlan:
    """Two tables; with the default dims they form two groups (two sets of exchanges)."""
    return ShardingPlan(
        [
            TableConfig("item_table", num_rows=61, dim=8, features=("uih", "cand"), dtype=item_dtype),
            TableConfig("user_table", num_rows=13, dim=user_dim, features=("user",)),
        ],
        world_size,
    )


def step_features(
    plan: ShardingPlan, step: int, rank: int, collision: str, seed: int = 0, empty_rank: int = -1
) -> dict[str, torch.Tensor]:
    """ids of one rank at one step. ``collision``: "none" (consecutive steps use disjoint rows: even steps the
    lower half of each table, odd steps the upper half, so step i+1 reuses rows of step i-1), "zipf" (typical:
    heavy-tailed ids over the whole table, duplicates within a batch), "all" (the same rows every step).
    ``empty_rank`` gets an empty local batch on odd steps."""
    rng = np.random.default_rng([seed, step, rank])
    out = {}
    for f in FEATURES:
        t = plan.table_of(f)
        n = 0 if (rank == empty_rank and step % 2 == 1) else int(rng.integers(3, 12))
        if collision == "zipf":
            ids = (rng.zipf(1.3, n) - 1) % t.num_rows
        elif collision == "none":
            half = t.num_rows // 2
            ids = rng.integers(0, half, n) + (half if step % 2 else 0)
        elif collision == "all":
            ids = np.arange(n) % min(4, t.num_rows)
        else:
            raise ValueError(collision)
        out[f] = torch.from_numpy(ids.astype(np.int64))
    return out


def loss_of(emb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Depends on the embedding values non-linearly, so a stale row changes the gradients and the loss."""
    total = torch.zeros((), device=emb[FEATURES[0]].device)
    for k, f in enumerate(FEATURES):
        e = emb[f].float()
        total = total + (torch.tanh(e * (k + 1)) ** 2).sum() + e.sum() * 0.1
    return total
