"""Ids beyond the item table: an error unless the job says how they map to rows.

A model's item table has ``num_rows`` rows. A dataset whose ids reach past it (a catalogue larger than the
table, or a corrupt id near 2^62) would otherwise be folded onto rows silently, several items sharing one row.
So a source is wrapped in :class:`IdRangeSource`, which checks every batch it serves:

    error   (the default) ValueError naming the first such sample and its largest id
    modulo  id -> id % num_rows (the fold the softmax model has always applied), counted
    hash    id -> a 64-bit mix of the id, % num_rows: neighbouring large ids spread over the table, counted

The policy comes from the job (``--id-overflow``), else from the dataset (Parquet metadata
``freescale.id_overflow``, a synthetic preset's ``id_overflow``). ``stats()['folded_ids']`` counts the ids that
were beyond the table (UIH items and candidate content ids) in the batches this source served.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from fsdata.batch import Batch
from fsdata.schema import CANDIDATE_CONTENT_IDS, ID_OVERFLOW_CHOICES, UIH_ITEM_IDS
from fsdata.source import SampleSource

_MIX_A = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's constants as signed int64 (torch has no uint64 arithmetic)
_MIX_B = 0xBF58476D1CE4E5B9 - 2**64
_MIX_C = 0x94D049BB133111EB - 2**64


def declared_overflow(source: SampleSource) -> Optional[str]:
    """What the dataset itself declares (Parquet metadata, a synthetic preset), or None."""
    declared = getattr(source, "id_overflow", None)
    if declared is None:
        declared = getattr(getattr(source, "config", None), "id_overflow", None)
    return declared


def hash_ids(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; shifts made logical by masking), then % num_rows."""
    x = ids + _MIX_A
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX_B
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX_C
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return torch.remainder(x, num_rows)


class IdRangeSource:
    """A :class:`fsdata.source.SampleSource` whose batches hold only ids in ``[0, num_rows)`` (see module doc)."""

    def __init__(self, source: SampleSource, num_rows: int, overflow: Optional[str] = None) -> None:
        if num_rows < 1:
            raise ValueError(f"id range: num_rows must be >= 1, got {num_rows}")
        overflow = overflow or declared_overflow(source) or "error"
        if overflow not in ID_OVERFLOW_CHOICES:
            raise ValueError(f"id_overflow must be one of {', '.join(ID_OVERFLOW_CHOICES)}, got {overflow!r}")
        self.source, self.num_rows, self.overflow = source, num_rows, overflow
        self._folded = 0

    def __getattr__(self, name: str):  # num_labels, dense_dim, side_features, paths... of the wrapped source
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    def num_samples(self, epoch: int) -> int:
        return self.source.num_samples(epoch)

    def describe(self) -> str:
        return f"{self.source.describe()}; ids beyond {self.num_rows} rows: {self.overflow}"

    def stats(self) -> dict[str, int]:
        inner = self.source.stats() if hasattr(self.source, "stats") else {}
        return {**inner, "folded_ids": self._folded}

    def read(self, epoch: int, start: int, stop: int) -> Batch:
        batch = self.source.read(epoch, start, stop)
        over_uih = batch.uih_item_ids >= self.num_rows
        over_content = batch.content_ids >= self.num_rows
        count = int(over_uih.sum()) + int(over_content.sum())
        if count == 0:
            return batch
        if self.overflow == "error":
            raise ValueError(self._message(batch, over_uih, over_content, count))
        self._folded += count
        fold = (
            (lambda t: torch.remainder(t, self.num_rows))
            if self.overflow == "modulo"
            else (lambda t: hash_ids(t, self.num_rows))
        )
        return replace(batch, uih_item_ids=fold(batch.uih_item_ids), content_ids=fold(batch.content_ids))

    def _message(self, batch: Batch, over_uih: torch.Tensor, over_content: torch.Tensor, count: int) -> str:
        """The first sample with an id beyond the table, named with its own largest id (not another sample's)."""
        if over_uih.any():
            column, value_index = UIH_ITEM_IDS, int(torch.nonzero(over_uih)[0])
            row = int(torch.searchsorted(batch.uih_offsets, value_index, right=True)) - 1
        else:
            column, value_index = CANDIDATE_CONTENT_IDS, int(torch.nonzero(over_content)[0])
            candidate = int(torch.searchsorted(batch.content_offsets, value_index, right=True)) - 1
            row = int(torch.searchsorted(batch.candidate_offsets, candidate, right=True)) - 1
        c0, c1 = (int(c) for c in batch.candidate_offsets[row : row + 2])
        x0, x1 = (int(x) for x in batch.content_offsets[[c0, c1]])
        mine = torch.cat(
            [batch.uih_item_ids[batch.uih_offsets[row] : batch.uih_offsets[row + 1]], batch.content_ids[x0:x1]]
        )
        where = getattr(self.source, "paths", None)
        where = f"{where[0]}{' ...' if len(where) > 1 else ''}: " if where else ""
        return (
            f"{where}sample_id {int(batch.sample_ids[row])}: id in column '{column}' beyond the item table's "
            f"{self.num_rows} rows (its largest id {int(mine.max())}; {count} such ids in this batch); give the model "
            f"more rows (--num-items) or declare how ids map to rows: --id-overflow modulo|hash (or the dataset's "
            f"freescale.id_overflow metadata)"
        )
