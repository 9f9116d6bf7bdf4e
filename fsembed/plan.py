"""The row-wise sharding plan: which rows of which table live on which rank, as plain data.

Tables are split into contiguous row ranges the way torchrec's row-wise sharding splits them (block size
``ceil(num_rows / world_size)``, the last ranks may hold fewer rows or none), so a row has the same owner in
FreeScale and in torchrec.

Tables of the same dtype and dim form one *group*: a group is exchanged with one ID AllToAll, one embedding
AllToAll and one gradient AllToAll, whatever the number of its tables and features. Inside a group every row
gets a *stacked id*: rank r's rows of all the group's tables are laid end to end, ranks one after another, so
one sorted ``boundaries`` array [W+1] per group says which rank owns a stacked id and the owner finds the
row in its local weight at ``stacked_id - boundaries[r]``. The loader's ID-prefetch stage (fsembed.id_prefetch)
is built with the plan and stacks each batch's ids itself (``stack_ids``): fsdata never sees tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch

#: feature -> its ids, or the ids of each call of its module in one step, in call order
Features = Mapping[str, Union[torch.Tensor, Sequence[torch.Tensor]]]


def flat_features(features: Features) -> dict[str, torch.Tensor]:
    """``{feature: ids}`` with each feature's ids of every call concatenated (call order), flattened: the one form
    the ids take from where they are computed to the swapped modules that are called with them."""
    out = {}
    for k, v in features.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.reshape(-1)
        else:
            parts = [t.reshape(-1) for t in v]
            out[k] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return out


@dataclass(frozen=True)
class TableConfig:
    """One embedding table and the features (id lists of a sample) that look it up."""

    name: str
    num_rows: int
    dim: int
    features: tuple[str, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: num_rows and dim must be positive, got {self.num_rows}, {self.dim}")
        if not self.features:
            raise ValueError(f"table {self.name!r}: needs at least one feature")


def row_wise_boundaries(num_rows: int, world_size: int) -> torch.Tensor:
    """[W+1] int64 row boundaries, torchrec's split: rank r owns rows [b[r], b[r+1])."""
    block = math.ceil(num_rows / world_size)
    return torch.tensor([min(r * block, num_rows) for r in range(world_size + 1)], dtype=torch.int64)


@dataclass
class GroupLayout:
    """Tables of one (dtype, dim) group and their stacked-id layout (see the module docstring)."""

    name: str
    dim: int
    dtype: torch.dtype
    tables: list[str]
    features: list[str]  # batch-major order of the group's ids: feature 0's ids, then feature 1's...
    boundaries: torch.Tensor  # [W+1] int64 over stacked ids
    table_base: dict[str, torch.Tensor]  # table -> [W] stacked id of the table's first row on each rank

    def local_rows(self, rank: int) -> int:
        return int(self.boundaries[rank + 1] - self.boundaries[rank])


@dataclass
class ShardingPlan:
    """Row-wise sharding of several tables over ``world_size`` ranks (plain data: picklable, no process group)."""

    tables: list[TableConfig]
    world_size: int
    row_boundaries: dict[str, torch.Tensor] = field(default_factory=dict)  # table -> [W+1] int64 rows
    groups: list[GroupLayout] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError(f"ShardingPlan: world_size must be positive, got {self.world_size}")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"ShardingPlan: duplicate table names in {names}")
        seen: dict[str, str] = {}
        for t in self.tables:
            for f in t.features:
                if f in seen:
                    raise ValueError(f"ShardingPlan: feature {f!r} used by tables {seen[f]!r} and {t.name!r}")
                seen[f] = t.name
        self._feature_table = seen
        for t in self.tables:
            b = self.row_boundaries.get(t.name)
            if b is None:
                self.row_boundaries[t.name] = row_wise_boundaries(t.num_rows, self.world_size)
            elif (
                b.shape != (self.world_size + 1,)
                or int(b[0]) != 0
                or int(b[-1]) != t.num_rows
                or bool((b[1:] < b[:-1]).any())
            ):
                raise ValueError(
                    f"ShardingPlan: table {t.name!r}: boundaries {b.tolist()} are not a sorted [W+1] split of "
                    f"{t.num_rows} rows"
                )
        if not self.groups:
            self.groups = self._build_groups()

    def _build_groups(self) -> list[GroupLayout]:
        by_key: dict[tuple[torch.dtype, int], list[TableConfig]] = {}
        for t in self.tables:
            by_key.setdefault((t.dtype, t.dim), []).append(t)
        groups = []
        for (dtype, dim), tables in by_key.items():
            W = self.world_size
            local = torch.stack(
                [self.row_boundaries[t.name][1:] - self.row_boundaries[t.name][:-1] for t in tables]
            )  # [T, W]
            per_rank = local.sum(0)
            bounds = torch.zeros(W + 1, dtype=torch.int64)
            torch.cumsum(per_rank, 0, out=bounds[1:])
            within = torch.cumsum(local, 0) - local  # [T, W]: offset of table t inside rank r's block
            base = {t.name: bounds[:-1] + within[k] for k, t in enumerate(tables)}
            groups.append(
                GroupLayout(
                    name=f"{str(dtype).removeprefix('torch.')}_d{dim}",
                    dim=dim,
                    dtype=dtype,
                    tables=[t.name for t in tables],
                    features=[f for t in tables for f in t.features],
                    boundaries=bounds,
                    table_base=base,
                )
            )
        return groups

    # ------------------------------------------------------------------ lookups
    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise ValueError(f"ShardingPlan: no table {name!r} (tables: {[t.name for t in self.tables]})")

    def table_of(self, feature: str) -> TableConfig:
        if feature not in self._feature_table:
            raise ValueError(
                f"ShardingPlan: feature {feature!r} is not in any table (features: {sorted(self._feature_table)})"
            )
        return self.table(self._feature_table[feature])

    @property
    def group_boundaries(self) -> dict[str, torch.Tensor]:
        """Group name -> [W+1] stacked-id boundaries: what the loader's ID-prefetch stage is built with."""
        return {g.name: g.boundaries for g in self.groups}

    # ------------------------------------------------------------------ ids
    def stack_ids(self, features: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, list[int]]]:
        """Feature ids (row numbers of their table, batch-major) -> per group (stacked ids, per-feature counts).

        Every feature of the plan must be present (an empty tensor for none); ids are validated here, once,
        because a wrong id would otherwise silently read another table's row.
        """
        out = {}
        for g in self.groups:
            parts, counts = [], []
            for f in g.features:
                if f not in features:
                    raise ValueError(f"ShardingPlan.stack_ids: feature {f!r} missing (got {sorted(features)})")
                ids = features[f].reshape(-1)
                if ids.dtype != torch.int64:
                    raise ValueError(f"feature {f!r}: ids must be int64, got {ids.dtype}")
                t = self.table_of(f)
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.num_rows):
                    raise ValueError(
                        f"feature {f!r}: ids must lie in [0, {t.num_rows}) of table {t.name!r}, "
                        f"got min {int(ids.min())} max {int(ids.max())}"
                    )
                rb = self.row_boundaries[t.name].to(ids.device)
                owner = torch.bucketize(ids, rb[1:], right=True)
                parts.append(ids - rb[owner] + g.table_base[t.name].to(ids.device)[owner])
                counts.append(int(ids.numel()))
            dev = next(iter(features.values())).device if features else torch.device("cpu")
            out[g.name] = (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev), counts)
        return out

    def unstack(
        self, group: str, stacked_local: torch.Tensor, rank: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Rank-local stacked rows of a group -> {table: (mask, row ids)} (tests, state_dict and checks)."""
        g = next(x for x in self.groups if x.name == group)
        out = {}
        for name in g.tables:
            base = int(g.table_base[name][rank] - g.boundaries[rank])
            rb = self.row_boundaries[name]
            n = int(rb[rank + 1] - rb[rank])
            mask = (stacked_local >= base) & (stacked_local < base + n)
            out[name] = (mask, stacked_local[mask] - base + rb[rank])
        return out

    def describe(self) -> str:
        return "; ".join(
            f"{g.name}: tables {g.tables}, rows per rank {(g.boundaries[1:] - g.boundaries[:-1]).tolist()}"
            for g in self.groups
        )
