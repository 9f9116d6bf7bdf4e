"""Resharding row-wise tables onto another world size, from the per-rank states a checkpoint holds.

A rank's ``tables_state()`` holds, per group, its local rows of every table of the group stacked (the weight)
and the optimizer's per-row state laid out the same way. The old plan says where each table's rows sit in every
old rank's block, so the whole tables (and their per-row state) are rebuilt by concatenation and sliced again
by the new plan: exact, with no collective, so a job stopped on W ranks resumes on W' ranks.

The prioritized collection's exchange in flight is not carried over: the checkpoint flushed every deferred
update, so the resumed job's first step looks its rows up synchronously and gets the same values.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from fsembed.plan import ShardingPlan


def _group_keys(states: Sequence[Mapping[str, torch.Tensor]], group: str) -> list[str]:
    keys = sorted(k for k in states[0] if k.startswith(f"{group}."))
    if f"{group}.weight" not in keys:
        raise ValueError(f"reshard: the saved table state has no weight for group {group!r} (keys {sorted(states[0])})")
    return keys


def full_tables_state(states: Sequence[Mapping[str, torch.Tensor]], old_plan: ShardingPlan) -> dict[str, dict[str, torch.Tensor]]:
    """``states[r]``: old rank r's ``tables_state()``. Returns ``{suffix: {table: whole tensor}}`` for the weight
    (suffix ``"weight"``) and every per-row optimizer state."""
    if len(states) != old_plan.world_size:
        raise ValueError(f"reshard: {len(states)} rank states for a plan of {old_plan.world_size} ranks")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g in old_plan.groups:
        for key in _group_keys(states, g.name):
            suffix = key[len(g.name) + 1 :]
            for name in g.tables:
                rb = old_plan.row_boundaries[name]
                parts = []
                for r, state in enumerate(states):
                    if state[key].shape[0] != g.local_rows(r):
                        raise ValueError(
                            f"reshard: rank {r}'s {key} has {state[key].shape[0]} rows, the plan gives it {g.local_rows(r)}"
                        )
                    start = int(g.table_base[name][r] - g.boundaries[r])
                    parts.append(state[key][start : start + int(rb[r + 1] - rb[r])])
                out.setdefault(suffix, {})[name] = torch.cat(parts)
    return out


def shard_tables_state(full: Mapping[str, Mapping[str, torch.Tensor]], new_plan: ShardingPlan, rank: int) -> dict[str, torch.Tensor]:
    """The ``tables_state()`` layout of ``rank`` under ``new_plan``, sliced from whole tables."""
    out = {}
    for g in new_plan.groups:
        for suffix, tables in full.items():
            if not all(name in tables for name in g.tables):
                continue
            out[f"{g.name}.{suffix}"] = torch.cat(
                [tables[name][int(new_plan.row_boundaries[name][rank]) : int(new_plan.row_boundaries[name][rank + 1])] for name in g.tables]
            )
    return out


def reshard_tables_state(
    states: Sequence[Mapping[str, torch.Tensor]], new_plan: ShardingPlan, rank: int
) -> dict[str, torch.Tensor]:
    """Old ranks' table states (one per old rank, in rank order) -> this rank's state under ``new_plan``."""
    old_plan = ShardingPlan(list(new_plan.tables), len(states))
    return shard_tables_state(full_tables_state(states, old_plan), new_plan, rank)
