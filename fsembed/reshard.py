"""Resharding row-wise tables onto another world size, from the per-rank states a checkpoint holds.

A rank's ``tables_state()`` holds, per group, its local rows of every table of the group stacked (the weight)
and the optimizer's per-row state laid out the same way. The old plan says where each table's rows sit in every
old rank's block, so the whole tables (and their per-row state) are rebuilt by concatenation and sliced again
by the new plan: exact, with no collective, so a job stopped on W ranks resumes on W' ranks.

The prioritized collection's exchange in flight is not carried over: the checkpoint flushed every deferred
update, so the resumed job's first step looks its rows up synchronously and gets the same values.

The job's checkpoint (pipelines.job.checkpoint.dcp) does not concatenate: it stores each rank's rows of a table as one
row-wise chunk (``split_rank_state``: rows ``[b[r], b[r+1])`` of the table, at that row offset) and reads back
only the rows the new plan gives a rank, restacked by ``stack_rank_state``. This module's whole-table path serves
the per-rank files of the earlier format.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from fsembed.plan import ShardingPlan


def _group_keys(states: Sequence[Mapping[str, torch.Tensor]], group: str) -> list[str]:
    keys = sorted(k for k in states[0] if k.startswith(f"{group}."))
    if f"{group}.weight" not in keys:
        raise ValueError(f"reshard: the saved table state has no weight for group {group!r} (keys {sorted(states[0])})")
    return keys


def split_rank_state(
    state: Mapping[str, torch.Tensor], plan: ShardingPlan, rank: int
) -> dict[str, dict[str, torch.Tensor]]:
    """One rank's ``tables_state()`` -> ``{suffix: {table: its local rows}}`` (views, no copy): the row range
    ``plan.row_boundaries[table][rank:rank+2]`` of each table, cut out of the group's stacked block."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g in plan.groups:
        for key in _group_keys([state], g.name):
            suffix = key[len(g.name) + 1 :]
            if state[key].shape[0] != g.local_rows(rank):
                raise ValueError(
                    f"reshard: rank {rank}'s {key} has {state[key].shape[0]} rows, the plan gives it "
                    f"{g.local_rows(rank)}"
                )
            for name in g.tables:
                rb = plan.row_boundaries[name]
                start = int(g.table_base[name][rank] - g.boundaries[rank])
                out.setdefault(suffix, {})[name] = state[key][start : start + int(rb[rank + 1] - rb[rank])]
    return out


def stack_rank_state(local: Mapping[str, Mapping[str, torch.Tensor]], plan: ShardingPlan) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_rank_state`: ``{suffix: {table: local rows}}`` -> the ``tables_state()`` layout
    (a suffix is kept for a group only when every table of the group has it)."""
    out = {}
    for g in plan.groups:
        for suffix, tables in local.items():
            if all(name in tables for name in g.tables):
                out[f"{g.name}.{suffix}"] = torch.cat([tables[name] for name in g.tables])
    return out


def full_tables_state(
    states: Sequence[Mapping[str, torch.Tensor]], old_plan: ShardingPlan
) -> dict[str, dict[str, torch.Tensor]]:
    """``states[r]``: old rank r's ``tables_state()``. Returns ``{suffix: {table: whole tensor}}`` for the weight
    (suffix ``"weight"``) and every per-row optimizer state."""
    if len(states) != old_plan.world_size:
        raise ValueError(f"reshard: {len(states)} rank states for a plan of {old_plan.world_size} ranks")
    parts = [split_rank_state(state, old_plan, r) for r, state in enumerate(states)]
    return {
        suffix: {name: torch.cat([p[suffix][name] for p in parts]) for name in tables}
        for suffix, tables in parts[0].items()
    }


def shard_tables_state(
    full: Mapping[str, Mapping[str, torch.Tensor]], new_plan: ShardingPlan, rank: int
) -> dict[str, torch.Tensor]:
    """The ``tables_state()`` layout of ``rank`` under ``new_plan``, sliced from whole tables."""
    local = {
        suffix: {
            name: t[int(new_plan.row_boundaries[name][rank]) : int(new_plan.row_boundaries[name][rank + 1])]
            for name, t in tables.items()
        }
        for suffix, tables in full.items()
    }
    return stack_rank_state(local, new_plan)


def reshard_tables_state(
    states: Sequence[Mapping[str, torch.Tensor]],
    new_plan: ShardingPlan,
    rank: int,
    old_row_boundaries: Optional[Mapping[str, torch.Tensor]] = None,
) -> dict[str, torch.Tensor]:
    """Old ranks' table states (one per old rank, in rank order) -> this rank's state under ``new_plan``.
    ``old_row_boundaries``: the old plan's split where it was not torchrec's (the earlier per-rank files do not
    record it: a mismatch is refused by the row counts)."""
    old_plan = ShardingPlan(list(new_plan.tables), len(states), row_boundaries=dict(old_row_boundaries or {}))
    return shard_tables_state(full_tables_state(states, old_plan), new_plan, rank)
