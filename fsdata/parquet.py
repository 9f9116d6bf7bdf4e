"""A Parquet sample source: random access by global index, streaming one row group at a time.

The global index runs over every row of every file, files in sorted path order, so it is the same whatever
the world size; a rank asking for ``[start, stop)`` reads (and decodes) only the row groups that overlap that
range, and the last decoded row groups stay in a small cache because consecutive reads of one rank usually
fall in the same row group. Counts come from the footers, so ``num_samples`` costs no data reads.

Decoding is columnar: list offsets and values buffers become tensors without a per-sample Python loop, and
the value buffers are shared with arrow (zero-copy) unless a UIH had to be cut.

Bad input (see docs/schema.md):
* missing path, unreadable/corrupt/truncated file, wrong schema: ValueError / FileNotFoundError naming the
  file (and the column); files of the schema that hold no row at all: ValueError naming the path, "no samples";
* negative ids, empty UIH, inconsistent list lengths, nulls (a null cell, or a null inside a list): ValueError
  naming file, row group and sample id (a null ``sample_id`` itself: the row);
* non-finite ``dense`` values or labels, labels outside [0, 1]: ValueError naming file, row group, sample id
  and column; with ``drop_bad_samples=True`` such samples are left out of the batches instead (a local batch
  gets shorter, as at an epoch's end) and counted in ``stats()['dropped_bad_samples']``;
* UIH timestamps that go backwards inside a sample, or are negative: ``unordered_timestamps`` says what happens
  (``TIMESTAMP_POLICIES``): ``count`` (the default) serves them and counts them in
  ``stats()['unordered_timestamps']`` (distinct samples: one served again in a later epoch counts once); for a
  model that reads time gaps, ``error`` (a ValueError naming file, row group and sample id), ``sort`` (each such
  history sorted oldest first before the cut to the cap, and counted; a negative time is still an error: sorting
  cannot mend it) or ``drop`` (left out and counted as the bad values are). ``require_ordered_timestamps=True``
  is ``error`` (``drop`` with ``drop_bad_samples``);
* UIH longer than ``uih_cap``: not an error. The most recent ``uih_cap`` events are kept (the history is
  stored oldest first, so the tail) and the sample is counted in ``stats()['truncated_uih']``.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fsdata.batch import Batch
from fsdata.schema import (
    CANDIDATE_CONTENT_IDS,
    CANDIDATE_LABELS,
    COLUMNS,
    DENSE,
    SAMPLE_ID,
    UIH_ACTION_TYPES,
    UIH_ITEM_IDS,
    UIH_TIMESTAMPS,
    USER_ID,
    Columns,
    bad_values,
    metadata_dims,
    metadata_id_overflow,
    negative_timestamps,
    segment_of,
    unordered_timestamps,
    validate_columns,
    validate_schema,
)
from fsdata.synthetic import segment_arange

PathLike = Union[str, os.PathLike]
TIMESTAMP_POLICIES = ("count", "error", "sort", "drop")  # what a history out of time order or before 0 gets


def expand_paths(paths: Union[PathLike, Sequence[PathLike]]) -> list[str]:
    """Files and directories (all ``*.parquet`` inside, not recursive) -> sorted list of files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.glob("*.parquet"))
            if not found:
                raise ValueError(f"{path}: directory holds no *.parquet files")
            out.extend(found)
        elif path.exists():
            out.append(str(path))
        else:
            raise FileNotFoundError(f"{path}: no such Parquet file or directory")
    if not out:
        raise ValueError("ParquetSource needs at least one file")
    return sorted(out)


@dataclass
class _RowGroup:
    """One decoded row group as tensors (offsets zero-based); sliced into batches by views."""

    sample_ids: torch.Tensor
    user_ids: torch.Tensor
    uih_offsets: torch.Tensor
    uih_item_ids: torch.Tensor
    uih_action_types: Optional[torch.Tensor]
    uih_timestamps: Optional[torch.Tensor]
    candidate_offsets: torch.Tensor
    candidate_labels: torch.Tensor
    content_offsets: torch.Tensor
    content_ids: torch.Tensor
    dense: torch.Tensor
    truncated: torch.Tensor  # bool [n]: UIH was cut to the cap
    bad: Optional[np.ndarray] = None  # bool [n], drop_bad_samples only: samples with unsound values
    unordered: Optional[np.ndarray] = None  # bool [n]: UIH timestamps went backwards or are negative (None: none)

    def slice(self, a: int, b: int) -> Batch:
        uo = self.uih_offsets[a : b + 1]
        co = self.candidate_offsets[a : b + 1]
        c0, c1 = int(co[0]), int(co[-1])
        xo = self.content_offsets[c0 : c1 + 1]
        u0, u1 = int(uo[0]), int(uo[-1])

        def side(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[u0:u1]

        return Batch(
            sample_ids=self.sample_ids[a:b],
            user_ids=self.user_ids[a:b],
            uih_offsets=uo - u0,
            uih_item_ids=self.uih_item_ids[u0:u1],
            candidate_offsets=co - c0,
            candidate_labels=self.candidate_labels[c0:c1],
            content_offsets=xo - int(xo[0]),
            content_ids=self.content_ids[int(xo[0]) : int(xo[-1])],
            dense=self.dense[a:b],
            uih_action_types=side(self.uih_action_types),
            uih_timestamps=side(self.uih_timestamps),
        )


def _tensor(a: np.ndarray) -> torch.Tensor:
    # Arrow buffers are read-only; torch shares them anyway (nothing downstream writes into a batch in place).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


class ParquetSource:
    """Random access over the rows of Parquet files of the FreeScale schema (fsdata.schema).

    ``epoch`` does not change the order (shuffling is a later stage's job); every epoch has the same samples.
    """

    def __init__(
        self,
        paths: Union[PathLike, Sequence[PathLike]],
        uih_cap: int = 21_000,
        cache_row_groups: int = 2,
        drop_bad_samples: bool = False,
        require_ordered_timestamps: bool = False,
        unordered_timestamps: Optional[str] = None,
    ):
        if unordered_timestamps is None:
            unordered_timestamps = ("drop" if drop_bad_samples else "error") if require_ordered_timestamps else "count"
        if unordered_timestamps not in TIMESTAMP_POLICIES:
            raise ValueError(
                f"unordered_timestamps must be one of {', '.join(TIMESTAMP_POLICIES)}, got {unordered_timestamps!r}"
            )
        if uih_cap < 1:
            raise ValueError(f"uih_cap must be >= 1, got {uih_cap}")
        if cache_row_groups < 1:
            raise ValueError(f"cache_row_groups must be >= 1, got {cache_row_groups}")
        self.paths = expand_paths(paths)
        self.uih_cap = uih_cap
        self.drop_bad_samples = drop_bad_samples
        self.unordered_timestamps = unordered_timestamps
        # Per row group with such samples, which of its rows this source served: the count is of distinct samples,
        # bounded by the data, not by how often an epoch comes round.
        self._unordered_served: dict[int, np.ndarray] = {}
        # How ids beyond the model's item table map to rows, when the dataset declares it (fsdata.id_overflow).
        self.id_overflow: Optional[str] = None
        self._cache_size = cache_row_groups
        self._cache: OrderedDict[int, _RowGroup] = OrderedDict()
        self._files: dict[int, pq.ParquetFile] = {}
        self.side_features: Optional[tuple[str, ...]] = None
        self.num_labels: Optional[int] = None
        self.dense_dim: Optional[int] = None
        rg_file, rg_local, rg_rows = [], [], []
        for f, path in enumerate(self.paths):
            pf = self._open(f)
            side = validate_schema(pf.schema_arrow, path)
            if self.side_features is None:
                self.side_features = side
            elif side != self.side_features:
                raise ValueError(
                    f"{path}: side-feature columns {list(side)} differ from {self.paths[0]}'s "
                    f"{list(self.side_features)} (present in every file or in none)"
                )
            self._agree(path, *metadata_dims(pf.schema_arrow))
            overflow = metadata_id_overflow(pf.schema_arrow, path)
            if f > 0 and overflow != self.id_overflow:
                raise ValueError(
                    f"{path}: declares id_overflow {overflow!r} but {self.paths[0]} declares {self.id_overflow!r}"
                )
            self.id_overflow = overflow
            md = pf.metadata
            for i in range(md.num_row_groups):
                rg_file.append(f), rg_local.append(i), rg_rows.append(md.row_group(i).num_rows)
        if sum(rg_rows) == 0:  # else every rank would end its first epoch before its first batch, each on its own
            where = ", ".join(str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths))
            files = f"{len(self.paths)} file{'s' if len(self.paths) > 1 else ''}"
            raise ValueError(f"{where}: no samples ({files} with the schema but 0 rows)")
        self._rg_file = np.asarray(rg_file, dtype=np.int64)
        self._rg_local = np.asarray(rg_local, dtype=np.int64)
        self._rg_start = np.zeros(len(rg_rows) + 1, dtype=np.int64)
        np.cumsum(np.asarray(rg_rows, dtype=np.int64), out=self._rg_start[1:])
        self._columns = [c for c in COLUMNS if c not in (UIH_ACTION_TYPES, UIH_TIMESTAMPS) or c in self.side_features]
        self._stats = {
            "samples_read": 0,
            "truncated_uih": 0,
            "row_groups_decoded": 0,
            "cache_hits": 0,
            "dropped_bad_samples": 0,
        }

    # ------------------------------------------------------------------ protocol
    def num_samples(self, epoch: int) -> int:
        return int(self._rg_start[-1])

    def describe(self) -> str:
        return (
            f"parquet({len(self.paths)} files, {self.num_samples(0)} samples, {len(self._rg_file)} row groups, "
            f"side features {list(self.side_features or ())}, uih_cap={self.uih_cap})"
        )

    def stats(self) -> dict[str, int]:
        """Counters since construction; ``truncated_uih`` counts served samples whose UIH was cut to the cap,
        ``unordered_timestamps`` the distinct samples served whose UIH timestamps go backwards or are negative
        (sorted and dropped ones included)."""
        return {**self._stats, "unordered_timestamps": int(sum(int(m.sum()) for m in self._unordered_served.values()))}

    def unordered_samples(self) -> np.ndarray:
        """The global indices of the samples ``stats()['unordered_timestamps']`` counts, sorted: several ranks'
        union is the job's distinct count (a sample may reach another rank in a later epoch)."""
        found = [self._rg_start[g] + np.flatnonzero(m) for g, m in sorted(self._unordered_served.items())]
        return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)

    def set_timestamp_policy(self, policy: str) -> None:
        """Sets ``unordered_timestamps`` (see the module doc) once the job knows its model; row groups decoded
        before are decoded again under it."""
        if policy not in TIMESTAMP_POLICIES:
            raise ValueError(f"unordered_timestamps must be one of {', '.join(TIMESTAMP_POLICIES)}, got {policy!r}")
        self.unordered_timestamps = policy
        self._cache.clear()

    def read(self, epoch: int, start: int, stop: int) -> Batch:
        total = self.num_samples(epoch)
        if not (0 <= start <= stop <= total):
            raise ValueError(f"parquet source: range [{start}, {stop}) outside [0, {total}) ({self.paths[0]} ...)")
        if start == stop:
            return self._empty()
        first = int(np.searchsorted(self._rg_start, start, side="right") - 1)
        last = int(np.searchsorted(self._rg_start, stop - 1, side="right") - 1)
        parts = []
        for g in range(first, last + 1):
            rg = self._row_group(g)
            lo, hi = (
                max(start, self._rg_start[g]) - self._rg_start[g],
                min(stop, self._rg_start[g + 1]) - self._rg_start[g],
            )
            part = rg.slice(int(lo), int(hi))
            self._stats["truncated_uih"] += int(rg.truncated[lo:hi].sum())
            if rg.unordered is not None and rg.unordered[lo:hi].any():
                served = self._unordered_served.setdefault(g, np.zeros(len(rg.unordered), dtype=bool))
                served[lo:hi] |= rg.unordered[lo:hi]
            if rg.bad is not None and rg.bad[lo:hi].any():
                keep = ~rg.bad[lo:hi]
                self._stats["dropped_bad_samples"] += int((~keep).sum())
                part = keep_rows(part, keep)
            parts.append(part)
        self._stats["samples_read"] += stop - start
        return parts[0] if len(parts) == 1 else Batch.concat(parts)

    def first_kept_sample(self) -> Optional[int]:
        """The global index of the first sample a read keeps (with ``drop_bad_samples``, the first one with sound
        values), or None when every sample would be left out. Decodes row groups in order until it finds one, so
        it costs one row group when the data is sound, and a pass over the data when none is."""
        for g in range(len(self._rg_file)):
            rg = self._row_group(g)
            n = int(self._rg_start[g + 1] - self._rg_start[g])
            kept = np.arange(n) if rg.bad is None else np.flatnonzero(~rg.bad)
            if len(kept):
                return int(self._rg_start[g] + kept[0])
        return None

    def __getstate__(self) -> dict:
        # Open file handles and decoded row groups stay behind when the source is sent to another process.
        state = dict(self.__dict__)
        state["_files"], state["_cache"] = {}, OrderedDict()
        return state

    # ------------------------------------------------------------------ internals
    def _agree(self, where: str, num_labels: Optional[int], dense_dim: Optional[int]) -> None:
        """Label count T and dense width D must be the same in every file (a Batch has one of each)."""
        for name, value in (("num_labels", num_labels), ("dense_dim", dense_dim)):
            if value is None:
                continue
            seen = getattr(self, name)
            if seen is None:
                setattr(self, name, value)
            elif seen != value:
                raise ValueError(f"{where}: {name} is {value} but earlier files have {seen}")

    def _open(self, f: int) -> pq.ParquetFile:
        if f not in self._files:
            path = self.paths[f]
            try:  # one open handle at a time: thousands of files would exhaust file descriptors
                self._files = {f: pq.ParquetFile(path)}
            except FileNotFoundError:
                raise FileNotFoundError(f"{path}: no such Parquet file") from None
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{path}: not a readable Parquet file (corrupt or truncated?): {e}") from e
        return self._files[f]

    def _empty(self) -> Batch:
        t, d = self.num_labels or 1, self.dense_dim or 0
        z = torch.zeros(0, dtype=torch.int64)
        o = torch.zeros(1, dtype=torch.int64)
        side = {c: (z.clone() if c in (self.side_features or ()) else None) for c in (UIH_ACTION_TYPES, UIH_TIMESTAMPS)}
        return Batch(
            sample_ids=z,
            user_ids=z.clone(),
            uih_offsets=o,
            uih_item_ids=z.clone(),
            candidate_offsets=o.clone(),
            candidate_labels=torch.zeros(0, t),
            content_offsets=o.clone(),
            content_ids=z.clone(),
            dense=torch.zeros(0, d),
            **side,
        )

    def _row_group(self, g: int) -> _RowGroup:
        if g in self._cache:
            self._cache.move_to_end(g)
            self._stats["cache_hits"] += 1
            return self._cache[g]
        f, i = int(self._rg_file[g]), int(self._rg_local[g])
        path = self.paths[f]
        where = f"{path} row group {i}"
        try:
            table = self._open(f).read_row_group(i, columns=self._columns)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{where}: cannot be read (corrupt file?): {e}") from e
        rg = self._decode(table, where)
        self._stats["row_groups_decoded"] += 1
        self._cache[g] = rg
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return rg

    def _decode(self, table: pa.Table, where: str) -> _RowGroup:
        cols = _columns_of(table, where, self._columns)
        num_labels, dense_dim = validate_columns(
            cols, where, self.num_labels, self.dense_dim, check_values=not self.drop_bad_samples
        )
        bad = bad_values(cols)[0] if self.drop_bad_samples else None
        if len(cols.label_offsets) > 1:
            self._agree(where, num_labels, None)
        if len(cols.dense_offsets) > 1:
            self._agree(where, None, dense_dim)
        n = len(cols.sample_ids)
        uih_len = np.diff(cols.uih_offsets)
        truncated = uih_len > self.uih_cap
        uih_off_t = torch.from_numpy(cols.uih_offsets)
        uih_t, act_t, ts_t = (
            None if a is None else _tensor(a) for a in (cols.uih_item_ids, cols.uih_action_types, cols.uih_timestamps)
        )
        resorted = None
        if self.unordered_timestamps == "sort" and ts_t is not None:  # before the cut: it keeps the newest events
            resorted, _ = unordered_timestamps(cols.uih_offsets, cols.uih_timestamps)
            if resorted.any():
                order = torch.from_numpy(np.lexsort((cols.uih_timestamps, np.repeat(np.arange(n), uih_len))))
                uih_t, act_t, ts_t = (None if x is None else x[order] for x in (uih_t, act_t, ts_t))
        if truncated.any():  # keep the most recent uih_cap events (the tail: histories are stored oldest first)
            kept = np.minimum(uih_len, self.uih_cap)
            index = torch.from_numpy(segment_arange(cols.uih_offsets[1:] - kept, kept))
            uih_t, act_t, ts_t = (None if x is None else x[index] for x in (uih_t, act_t, ts_t))
            uih_off_t = torch.from_numpy(np.concatenate([[0], np.cumsum(kept)]).astype(np.int64))
        unordered = self._timestamp_order(cols, uih_off_t, ts_t, where)
        if unordered is not None and self.unordered_timestamps == "drop":  # the read leaves them out
            bad = unordered if bad is None else bad | unordered
        if resorted is not None and resorted.any():
            unordered = resorted if unordered is None else unordered | resorted
        t = self.num_labels or 1
        return _RowGroup(
            sample_ids=_tensor(cols.sample_ids),
            user_ids=_tensor(cols.user_ids),
            uih_offsets=uih_off_t,
            uih_item_ids=uih_t,
            uih_action_types=act_t,
            uih_timestamps=ts_t,
            candidate_offsets=torch.from_numpy(cols.candidate_offsets),
            candidate_labels=_tensor(cols.labels).reshape(-1, t),
            content_offsets=torch.from_numpy(cols.content_offsets),
            content_ids=_tensor(cols.content_ids),
            dense=_tensor(cols.dense).reshape(n, self.dense_dim or 0),
            truncated=torch.from_numpy(truncated),
            bad=bad if bad is not None and bad.any() else None,
            unordered=unordered,
        )

    def _timestamp_order(
        self, cols: Columns, uih_offsets: torch.Tensor, timestamps: Optional[torch.Tensor], where: str
    ) -> Optional[np.ndarray]:
        """Which samples' served timestamps (after the cut to the cap) go backwards or are negative, None when none
        do; under the ``error`` policy (and ``sort``, for a negative time) an error naming the first."""
        if timestamps is None:
            return None
        offsets, values = uih_offsets.numpy(), timestamps.numpy()
        backwards, order_fault = unordered_timestamps(offsets, values)
        negative, sign_fault = negative_timestamps(offsets, values)
        if order_fault is None and sign_fault is None:
            return None
        fault = {"error": min(f for f in (order_fault, sign_fault) if f is not None), "sort": sign_fault}.get(
            self.unordered_timestamps
        )
        if fault is not None:
            row, what = fault
            mend = "drop" if self.unordered_timestamps == "sort" else "sort|drop"
            raise ValueError(
                f"{where}: sample_id {int(cols.sample_ids[row])} (row {row}): {what}; the model reads time gaps, "
                f"which needs every history oldest first and no negative time (--unordered-timestamps {mend})"
            )
        return backwards | negative


def _columns_of(table: pa.Table, where: str, names: Sequence[str]) -> Columns:
    """A row group's columns as numpy arrays without copies (offsets rebased to 0); a null anywhere is an error
    naming ``where``, the sample id and the column. The side features are read where ``names`` lists them."""
    ids = _column(table, SAMPLE_ID)
    if ids.null_count:
        raise ValueError(f"{where}: row {_first_null(ids)}: column '{SAMPLE_ID}' is null (every sample needs its id)")
    sample_ids = ids.to_numpy(zero_copy_only=True)

    def null(row: int, what: str) -> ValueError:
        return ValueError(f"{where}: sample_id {int(sample_ids[row])} (row {row}): {what}; nulls are not allowed")

    def array(name: str) -> pa.Array:
        arr = _column(table, name)
        if arr.null_count:
            raise null(_first_null(arr), f"column '{name}' is null")
        return arr

    def leaf_np(name: str, leaf: pa.Array, describe) -> np.ndarray:
        if leaf.null_count:
            row, what = describe(_first_null(leaf))
            raise null(row, f"column '{name}' holds a null {what}")
        return leaf.to_numpy(zero_copy_only=True)

    def level1(name: str) -> tuple[np.ndarray, np.ndarray]:
        arr = array(name)
        off = arr.offsets.to_numpy().astype(np.int64)
        leaf = arr.values.slice(int(off[0]), int(off[-1] - off[0]))
        off -= off[0]

        def describe(v: int) -> tuple[int, str]:
            row, position = _locate(off, v)
            return row, f"at position {position} of its list"

        return off, leaf_np(name, leaf, describe)

    def level2(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arr = array(name)
        off1 = arr.offsets.to_numpy().astype(np.int64)
        inner = arr.values.slice(int(off1[0]), int(off1[-1] - off1[0]))
        off1 -= off1[0]
        if inner.null_count:
            row, candidate = _locate(off1, _first_null(inner))
            raise null(row, f"column '{name}' holds a null list for candidate {candidate}")
        off2 = inner.offsets.to_numpy().astype(np.int64)
        leaf = inner.values.slice(int(off2[0]), int(off2[-1] - off2[0]))
        off2 -= off2[0]

        def describe(v: int) -> tuple[int, str]:
            flat_candidate, position = _locate(off2, v)
            row, candidate = _locate(off1, flat_candidate)
            return row, f"at position {position} of candidate {candidate}'s list"

        return off1, off2, leaf_np(name, leaf, describe)

    uih_off, uih = level1(UIH_ITEM_IDS)
    act_off, act = level1(UIH_ACTION_TYPES) if UIH_ACTION_TYPES in names else (None, None)
    ts_off, ts = level1(UIH_TIMESTAMPS) if UIH_TIMESTAMPS in names else (None, None)
    cand_off, label_off, labels = level2(CANDIDATE_LABELS)
    ccand_off, content_off, content = level2(CANDIDATE_CONTENT_IDS)
    dense_off, dense = level1(DENSE)
    return Columns(
        sample_ids=sample_ids,
        user_ids=array(USER_ID).to_numpy(zero_copy_only=True),
        uih_offsets=uih_off,
        uih_item_ids=uih,
        candidate_offsets=cand_off,
        label_offsets=label_off,
        labels=labels,
        content_candidate_offsets=ccand_off,
        content_offsets=content_off,
        content_ids=content,
        dense_offsets=dense_off,
        dense=dense,
        action_offsets=act_off,
        uih_action_types=act,
        timestamp_offsets=ts_off,
        uih_timestamps=ts,
    )


def keep_rows(batch: Batch, keep: np.ndarray) -> Batch:
    """The samples of ``batch`` where ``keep`` (bool per sample) is true, in order; vectorized."""
    rows = torch.from_numpy(np.flatnonzero(keep))

    def pick(offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(new offsets, indices of the kept values) of the segments ``rows`` of ``offsets``."""
        starts, lengths = offsets[:-1][rows], (offsets[1:] - offsets[:-1])[rows]
        index = torch.from_numpy(segment_arange(starts.numpy(), lengths.numpy()))
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]), index

    uih_off, uih_index = pick(batch.uih_offsets, rows)
    cand_off, cand_index = pick(batch.candidate_offsets, rows)
    content_off, content_index = pick(batch.content_offsets, cand_index)

    def side(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[uih_index]

    return Batch(
        sample_ids=batch.sample_ids[rows],
        user_ids=batch.user_ids[rows],
        uih_offsets=uih_off,
        uih_item_ids=batch.uih_item_ids[uih_index],
        candidate_offsets=cand_off,
        candidate_labels=batch.candidate_labels[cand_index],
        content_offsets=content_off,
        content_ids=batch.content_ids[content_index],
        dense=batch.dense[rows],
        uih_action_types=side(batch.uih_action_types),
        uih_timestamps=side(batch.uih_timestamps),
    )


def _locate(offsets: np.ndarray, value_index: int) -> tuple[int, int]:
    """(segment, position inside it) of value ``value_index`` under zero-based ``offsets``."""
    segment = segment_of(offsets, value_index)
    return segment, value_index - int(offsets[segment])


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _first_null(arr: pa.Array) -> int:
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return int(np.argmin(valid))
