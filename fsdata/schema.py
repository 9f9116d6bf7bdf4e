"""The Parquet schema of a FreeScale dataset: one row per sample, shared by the reader, the writer and the
converters so the three can never disagree.

    column                  arrow type                 notes
    sample_id               int64                      >= 0, globally unique
    user_id                 int64                      >= 0
    uih_item_ids            list<int64>                oldest event first, length >= 1
    uih_action_types        list<int64>   (optional)   same length as uih_item_ids
    uih_timestamps          list<int64>   (optional)   same length as uih_item_ids (seconds)
    candidate_labels        list<list<float32>>        [C][T]: C candidates, T label columns (fixed per file)
    candidate_content_ids   list<list<int64>>          [C][variable >= 1]: first id = the candidate item
    dense                   list<float32>              D values, fixed per file

Extra columns are ignored. ``large_list`` is accepted wherever ``list`` is. The writer records T and D in the
schema metadata (``freescale.num_labels``, ``freescale.dense_dim``) so a reader can check files agree before
reading any data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fsdata.batch import Batch

SAMPLE_ID = "sample_id"
USER_ID = "user_id"
UIH_ITEM_IDS = "uih_item_ids"
UIH_ACTION_TYPES = "uih_action_types"
UIH_TIMESTAMPS = "uih_timestamps"
CANDIDATE_LABELS = "candidate_labels"
CANDIDATE_CONTENT_IDS = "candidate_content_ids"
DENSE = "dense"

SCHEMA_VERSION = "1"
META_VERSION = b"freescale.schema_version"
META_NUM_LABELS = b"freescale.num_labels"
META_DENSE_DIM = b"freescale.dense_dim"
META_ID_OVERFLOW = b"freescale.id_overflow"  # optional: how ids beyond the item table map to rows (fsdata.id_overflow)
ID_OVERFLOW_CHOICES = ("error", "modulo", "hash")

# column -> (required, list nesting depth, leaf type)
COLUMNS: dict[str, tuple[bool, int, pa.DataType]] = {
    SAMPLE_ID: (True, 0, pa.int64()),
    USER_ID: (True, 0, pa.int64()),
    UIH_ITEM_IDS: (True, 1, pa.int64()),
    UIH_ACTION_TYPES: (False, 1, pa.int64()),
    UIH_TIMESTAMPS: (False, 1, pa.int64()),
    CANDIDATE_LABELS: (True, 2, pa.float32()),
    CANDIDATE_CONTENT_IDS: (True, 2, pa.int64()),
    DENSE: (True, 1, pa.float32()),
}
SIDE_FEATURES = (UIH_ACTION_TYPES, UIH_TIMESTAMPS)


def _type_name(depth: int, leaf: pa.DataType) -> str:
    return "list<" * depth + str(leaf) + ">" * depth


def _matches(t: pa.DataType, depth: int, leaf: pa.DataType) -> bool:
    for _ in range(depth):
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        t = t.value_type
    return t == leaf


def validate_schema(schema: pa.Schema, path: str) -> tuple[str, ...]:
    """Checks an arrow schema against the FreeScale schema; returns the side-feature columns present.

    Raises ValueError naming the file and the offending column (missing, or of the wrong type)."""
    for name, (required, depth, leaf) in COLUMNS.items():
        idx = schema.get_field_index(name)
        if idx < 0:
            if required:
                raise ValueError(
                    f"{path}: missing column '{name}' (expected {_type_name(depth, leaf)}); "
                    f"the file has columns {schema.names}"
                )
            continue
        t = schema.field(idx).type
        if not _matches(t, depth, leaf):
            raise ValueError(f"{path}: column '{name}' has type {t}, expected {_type_name(depth, leaf)}")
    return tuple(c for c in SIDE_FEATURES if schema.get_field_index(c) >= 0)


def metadata_dims(schema: pa.Schema) -> tuple[Optional[int], Optional[int]]:
    """(num_labels, dense_dim) recorded by :func:`write_parquet`, or None where the file does not say."""
    meta = schema.metadata or {}

    def get(key: bytes) -> Optional[int]:
        return int(meta[key]) if key in meta else None

    return get(META_NUM_LABELS), get(META_DENSE_DIM)


def metadata_id_overflow(schema: pa.Schema, path: str) -> Optional[str]:
    """The ``freescale.id_overflow`` a dataset declares (None where it does not)."""
    value = (schema.metadata or {}).get(META_ID_OVERFLOW)
    if value is None:
        return None
    value = value.decode(errors="replace")
    if value not in ID_OVERFLOW_CHOICES:
        raise ValueError(
            f"{path}: metadata {META_ID_OVERFLOW.decode()} is {value!r}; expected one of "
            f"{', '.join(ID_OVERFLOW_CHOICES)}"
        )
    return value


def arrow_schema(side_features: Iterable[str] = SIDE_FEATURES, num_labels: int = 1, dense_dim: int = 0) -> pa.Schema:
    """The schema the writer produces (``list``, not ``large_list``), with T and D in the metadata."""
    side = set(side_features)
    fields = []
    for name, (_, depth, leaf) in COLUMNS.items():
        if name in SIDE_FEATURES and name not in side:
            continue
        t = leaf
        for _ in range(depth):
            t = pa.list_(t)
        fields.append(pa.field(name, t, nullable=False))
    meta = {
        META_VERSION: SCHEMA_VERSION.encode(),
        META_NUM_LABELS: str(num_labels).encode(),
        META_DENSE_DIM: str(dense_dim).encode(),
    }
    return pa.schema(fields, metadata=meta)


@dataclass
class Columns:
    """One row group (or one batch) in the schema's layout as numpy arrays, offsets zero-based int64.

    Two-level columns (labels, content ids) share ``candidate_offsets`` once validated."""

    sample_ids: np.ndarray
    user_ids: np.ndarray
    uih_offsets: np.ndarray
    uih_item_ids: np.ndarray
    candidate_offsets: np.ndarray  # [n+1] into candidates, from candidate_labels
    label_offsets: np.ndarray  # [C+1] into labels
    labels: np.ndarray
    content_candidate_offsets: np.ndarray  # [n+1] into candidates, from candidate_content_ids
    content_offsets: np.ndarray  # [C+1] into content ids
    content_ids: np.ndarray
    dense_offsets: np.ndarray
    dense: np.ndarray
    action_offsets: Optional[np.ndarray] = None
    uih_action_types: Optional[np.ndarray] = None
    timestamp_offsets: Optional[np.ndarray] = None
    uih_timestamps: Optional[np.ndarray] = None


def segment_of(offsets: np.ndarray, value_index: int) -> int:
    """Row whose segment holds value ``value_index`` (``offsets`` zero-based)."""
    return int(np.searchsorted(offsets, value_index, side="right") - 1)


def validate_columns(
    cols: Columns,
    where: str,
    num_labels: Optional[int] = None,
    dense_dim: Optional[int] = None,
    check_values: bool = True,
) -> tuple[int, int]:
    """Checks the values of one row group or batch; returns its (num_labels T, dense_dim D).

    ``where`` names the place ("data.parquet row group 3"); every error also names the first offending
    sample id. ``num_labels`` / ``dense_dim``, when given, are what this piece must match (the file's or the
    dataset's). ``check_values``: also refuse the values :func:`bad_values` finds (a reader that drops such
    samples instead checks them itself). Vectorized: a few passes over each column, no per-sample Python loop."""
    sid = cols.sample_ids

    def fail(row: int, what: str) -> None:
        raise ValueError(f"{where}: sample_id {int(sid[row])} (row {row}): {what}")

    def first(mask: np.ndarray) -> int:
        return int(np.argmax(mask))

    for name, arr in ((SAMPLE_ID, sid), (USER_ID, cols.user_ids)):
        if len(arr) and arr.min() < 0:
            fail(first(arr < 0), f"negative {name} {int(arr.min())}")
    uih_len = np.diff(cols.uih_offsets)
    if len(uih_len) and uih_len.min() < 1:
        fail(first(uih_len < 1), "empty UIH (uih_item_ids has no items; every sample needs a history)")
    for name, offs, vals in (
        (UIH_ITEM_IDS, cols.uih_offsets, cols.uih_item_ids),
        (UIH_ACTION_TYPES, cols.action_offsets, cols.uih_action_types),
        (CANDIDATE_CONTENT_IDS, None, cols.content_ids),
    ):
        if vals is None or not len(vals) or vals.min() >= 0:
            continue
        bad = first(vals < 0)
        if offs is None:  # content ids: value -> candidate -> sample
            row = segment_of(cols.content_candidate_offsets, segment_of(cols.content_offsets, bad))
        else:
            row = segment_of(offs, bad)
        fail(row, f"negative id {int(vals[bad])} in {name}")
    for name, offs in ((UIH_ACTION_TYPES, cols.action_offsets), (UIH_TIMESTAMPS, cols.timestamp_offsets)):
        if offs is not None and not np.array_equal(offs, cols.uih_offsets):
            row = first(np.diff(offs) != uih_len)
            fail(row, f"{name} has {int(np.diff(offs)[row])} values but the UIH has {int(uih_len[row])} items")
    if not np.array_equal(cols.candidate_offsets, cols.content_candidate_offsets):
        a, b = np.diff(cols.candidate_offsets), np.diff(cols.content_candidate_offsets)
        row = first(a != b)
        fail(row, f"{CANDIDATE_LABELS} has {int(a[row])} candidates but {CANDIDATE_CONTENT_IDS} has {int(b[row])}")
    label_len = np.diff(cols.label_offsets)
    if len(label_len):
        expect = int(label_len[0]) if num_labels is None else num_labels
        if expect < 1 or (label_len != expect).any():
            bad = first(label_len != expect) if expect >= 1 else 0
            row = segment_of(cols.candidate_offsets, bad)
            fail(row, f"a candidate has {int(label_len[bad])} labels, expected {expect} (T is fixed per dataset, >= 1)")
        num_labels = expect
    content_len = np.diff(cols.content_offsets)
    if len(content_len) and content_len.min() < 1:
        row = segment_of(cols.candidate_offsets, first(content_len < 1))
        fail(row, "a candidate has no content ids (the first content id must be the candidate item)")
    dense_len = np.diff(cols.dense_offsets)
    if len(dense_len):
        expect = int(dense_len[0]) if dense_dim is None else dense_dim
        if (dense_len != expect).any():
            row = first(dense_len != expect)
            fail(row, f"{DENSE} has {int(dense_len[row])} values, expected {expect} (D is fixed per dataset)")
        dense_dim = expect
    if check_values:
        _, fault = bad_values(cols)
        if fault is not None:
            fail(*fault)
    return (num_labels if num_labels is not None else 1), (dense_dim if dense_dim is not None else 0)


def bad_values(cols: Columns) -> tuple[np.ndarray, Optional[tuple[int, str]]]:
    """Samples whose values would train to NaN or to a wrong loss: a non-finite ``dense`` value, a non-finite
    label, or a label outside [0, 1] (every label column is a binary cross-entropy target, a probability).

    Returns a bool mask over the rows and (row, description) of the first such sample, or None when all are
    sound. The layout must already be valid (offsets consistent)."""
    n = len(cols.sample_ids)
    mask = np.zeros(n, dtype=bool)
    faults: list[tuple[int, str]] = []
    dense = cols.dense
    if len(dense):
        bad = ~np.isfinite(dense)
        if bad.any():
            rows = np.searchsorted(cols.dense_offsets, np.flatnonzero(bad), side="right") - 1
            mask[rows] = True
            v = int(np.argmax(bad))
            faults.append((int(rows[0]), f"non-finite value {float(dense[v])} in column '{DENSE}'"))
    labels = cols.labels
    if len(labels):
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(labels) | (labels < 0) | (labels > 1)
        if bad.any():
            where = np.flatnonzero(bad)
            candidates = np.searchsorted(cols.label_offsets, where, side="right") - 1
            rows = np.searchsorted(cols.candidate_offsets, candidates, side="right") - 1
            mask[rows] = True
            v = float(labels[where[0]])
            what = "non-finite label" if not np.isfinite(v) else "label outside [0, 1] (a binary cross-entropy target)"
            faults.append((int(rows[0]), f"{what} {v} in column '{CANDIDATE_LABELS}'"))
    return mask, (min(faults) if faults else None)


def unordered_timestamps(
    offsets: np.ndarray, timestamps: Optional[np.ndarray]
) -> tuple[np.ndarray, Optional[tuple[int, str]]]:
    """Samples whose ``uih_timestamps`` go backwards (an event older than the one before it; equal times are in
    order): the schema stores histories oldest first, and a model that reads time gaps needs them so.

    ``offsets`` [n+1] zero-based into ``timestamps``. Returns a bool mask over the rows and (row, description) of
    the first such sample, or None when every history is in order (or there are no timestamps)."""
    mask = np.zeros(len(offsets) - 1, dtype=bool)
    if timestamps is None or len(timestamps) < 2:
        return mask, None
    backwards = timestamps[1:] < timestamps[:-1]  # [j]: event j+1 is older than event j
    starts = offsets[1:-1]
    backwards[starts[(starts > 0) & (starts < len(timestamps))] - 1] = False  # pairs across two samples
    if not backwards.any():
        return mask, None
    later = np.flatnonzero(backwards) + 1
    rows = np.searchsorted(offsets, later, side="right") - 1
    mask[rows] = True
    v, row = int(later[0]), int(rows[0])
    what = (
        f"{UIH_TIMESTAMPS} go backwards at event {v - int(offsets[row])} ({int(timestamps[v])} after"
        f" {int(timestamps[v - 1])})"
    )
    return mask, (row, what)


def negative_timestamps(
    offsets: np.ndarray, timestamps: Optional[np.ndarray]
) -> tuple[np.ndarray, Optional[tuple[int, str]]]:
    """Samples with a ``uih_timestamps`` value below 0 (seconds since the epoch cannot be; a time gap read from one
    is meaningless), as :func:`unordered_timestamps` answers: a bool mask over the rows and (row, description) of
    the first, or None."""
    mask = np.zeros(len(offsets) - 1, dtype=bool)
    negative = np.flatnonzero(timestamps < 0) if timestamps is not None else np.zeros(0, dtype=np.int64)
    if not len(negative):
        return mask, None
    rows = np.searchsorted(offsets, negative, side="right") - 1
    mask[rows] = True
    v, row = int(negative[0]), int(rows[0])
    return mask, (
        row,
        f"{UIH_TIMESTAMPS} holds a negative time at event {v - int(offsets[row])} ({int(timestamps[v])})",
    )


def batch_columns(batch: Batch) -> Columns:
    """The :class:`Columns` view of a batch (for validation before writing)."""
    b = batch.to("cpu")

    def z(t: torch.Tensor) -> np.ndarray:
        a = _np(t)
        return a - a[0] if len(a) else a

    cand = z(b.candidate_offsets)
    num_c, t, d = b.candidate_labels.shape[0], b.num_labels, int(b.dense.shape[1])
    uih = z(b.uih_offsets)
    return Columns(
        sample_ids=_np(b.sample_ids),
        user_ids=_np(b.user_ids),
        uih_offsets=uih,
        uih_item_ids=_np(b.uih_item_ids),
        candidate_offsets=cand,
        label_offsets=np.arange(num_c + 1, dtype=np.int64) * t,
        labels=_np(b.candidate_labels).reshape(-1),
        content_candidate_offsets=cand,
        content_offsets=z(b.content_offsets),
        content_ids=_np(b.content_ids),
        dense_offsets=np.arange(b.batch_size + 1, dtype=np.int64) * d,
        dense=_np(b.dense).reshape(-1),
        action_offsets=None if b.uih_action_types is None else uih,
        uih_action_types=None if b.uih_action_types is None else _np(b.uih_action_types),
        timestamp_offsets=None if b.uih_timestamps is None else uih,
        uih_timestamps=None if b.uih_timestamps is None else _np(b.uih_timestamps),
    )


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _list_array(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"batch too large for one Parquet list chunk ({offsets[-1]} values); write smaller batches")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def batch_to_table(batch: Batch) -> pa.Table:
    """One batch as an arrow table of the FreeScale schema; vectorized (no per-sample loop)."""
    b = batch.to("cpu")
    uih_off = _np(b.uih_offsets) - int(b.uih_offsets[0])
    cand_off = _np(b.candidate_offsets) - int(b.candidate_offsets[0])
    cont_off = _np(b.content_offsets) - int(b.content_offsets[0])
    num_c, num_labels, dense_dim = b.candidate_labels.shape[0], b.num_labels, int(b.dense.shape[1])
    label_inner = _list_array(
        np.arange(num_c + 1, dtype=np.int64) * num_labels, pa.array(_np(b.candidate_labels).reshape(-1))
    )
    content_inner = _list_array(cont_off, pa.array(_np(b.content_ids)))
    cols = {
        SAMPLE_ID: pa.array(_np(b.sample_ids)),
        USER_ID: pa.array(_np(b.user_ids)),
        UIH_ITEM_IDS: _list_array(uih_off, pa.array(_np(b.uih_item_ids))),
        CANDIDATE_LABELS: _list_array(cand_off, label_inner),
        CANDIDATE_CONTENT_IDS: _list_array(cand_off, content_inner),
        DENSE: _list_array(np.arange(b.batch_size + 1, dtype=np.int64) * dense_dim, pa.array(_np(b.dense).reshape(-1))),
    }
    side = []
    if b.uih_action_types is not None:
        cols[UIH_ACTION_TYPES] = _list_array(uih_off, pa.array(_np(b.uih_action_types)))
        side.append(UIH_ACTION_TYPES)
    if b.uih_timestamps is not None:
        cols[UIH_TIMESTAMPS] = _list_array(uih_off, pa.array(_np(b.uih_timestamps)))
        side.append(UIH_TIMESTAMPS)
    schema = arrow_schema(side, num_labels, dense_dim)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def write_parquet(
    batches: Union[Batch, Iterable[Batch]],
    path: str,
    row_group_size: int = 1024,
    compression: str = "zstd",
) -> int:
    """Writes batches to one Parquet file in row groups of exactly ``row_group_size`` samples (the last may be
    shorter), whatever the batch sizes. Returns the number of samples written. Every batch is checked with
    :func:`validate_columns` first, so the writer never produces a file the reader would reject.

    Fixed-size row groups matter to the reader: a rank reads only the row groups that overlap its range."""
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1, got {row_group_size}")
    if isinstance(batches, Batch):
        batches = [batches]
    writer: Optional[pq.ParquetWriter] = None
    pending: list[pa.Table] = []
    pending_rows = written = 0

    def flush(final: bool) -> None:
        nonlocal pending, pending_rows, written
        table = pa.concat_tables(pending)
        full = len(table) if final else (len(table) // row_group_size) * row_group_size
        for lo in range(0, full, row_group_size):
            writer.write_table(table.slice(lo, min(row_group_size, full - lo)), row_group_size=row_group_size)
        rest = table.slice(full)
        pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        written += full

    dims: tuple[Optional[int], Optional[int]] = (None, None)
    try:
        for i, batch in enumerate(batches):
            dims = validate_columns(batch_columns(batch), f"{path}: batch {i}", *dims)
            table = batch_to_table(batch)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, compression=compression)
            elif table.schema != writer.schema:
                raise ValueError(
                    f"{path}: batch schema differs from the first batch's (side features, label count T or dense "
                    f"dim D changed): {table.schema} vs {writer.schema}"
                )
            pending.append(table)
            pending_rows += len(table)
            if pending_rows >= row_group_size:
                flush(final=False)
        if writer is None:
            raise ValueError(f"{path}: nothing to write (no batches)")
        if pending:
            flush(final=True)
    finally:
        if writer is not None:
            writer.close()
    return written
