"""Resharding row-wise tables and their optimizer state between world sizes is exact."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsembed.plan import ShardingPlan, TableConfig
from fsembed.reshard import reshard_tables_state, shard_tables_state


def _plan(world_size: int, rows: tuple[int, int, int]) -> ShardingPlan:
    return ShardingPlan(
        [
            TableConfig("items", rows[0], 4, ("uih",)),
            TableConfig("tags", rows[1], 4, ("tag",)),  # same dim: stacked with items in one group
            TableConfig("users", rows[2], 3, ("user",)),
        ],
        world_size,
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.tuples(st.integers(1, 23), st.integers(1, 9), st.integers(1, 7)))
def test_reshard_equals_sharding_the_whole_tables(old_world, new_world, rows):
    gen = torch.Generator().manual_seed(sum(rows) * 31 + old_world)
    full = {
        "weight": {t.name: torch.randn(t.num_rows, t.dim, generator=gen) for t in _plan(1, rows).tables},
        "sum": {t.name: torch.rand(t.num_rows, generator=gen) for t in _plan(1, rows).tables},  # row-wise Adagrad
    }
    old, new = _plan(old_world, rows), _plan(new_world, rows)
    old_states = [shard_tables_state(full, old, r) for r in range(old_world)]
    for r in range(new_world):
        got = reshard_tables_state(old_states, new, r)
        expected = shard_tables_state(full, new, r)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)
