"""Converters from public interaction logs to the FreeScale Parquet schema (fsdata.schema).

Supported raw formats:

* ``movielens``: ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``, ML-1M/10M) or ``ratings.csv``
  (``userId,movieId,rating,timestamp`` with a header, ML-20M/25M/32M). Label: rating >= 4.
* ``amazon``: reviews as JSON lines, either the 2014/2018 form
  (``reviewerID, asin, overall, unixReviewTime``) or the 2023 form (``user_id, parent_asin, rating,
  timestamp`` in ms). Label: rating >= 4.
* ``kuairand``: KuaiRand log CSVs (``user_id, video_id, time_ms`` or ``date`` + ``hourmin``, ``is_click``,
  ...). Labels: the columns named by ``label_columns`` (default ``is_click``).

Every format reads gzip-compressed files too, by their ``.gz`` suffix (``ratings.dat.gz``, ``ratings.csv.gz``,
``reviews.json.gz``, ``log.csv.gz``).

Known CSV headers are matched whatever their case (``UserID,MovieID,Rating,Timestamp`` is MovieLens's). A
malformed row (wrong number of fields, a field that does not parse as its column's type, an empty field, or a
last line without its line end: a file cut mid-row) is an error naming the file and the line, unless
``bad_rows="skip"``: then such rows are left out and counted (``ConvertReport.skipped_rows``).

Every format becomes one event table (user, item, time, labels, action type); then, per user, events are
ordered by time (ties keep file order) and cut into samples: the last ``candidates`` events are a sample's
candidates and everything before them its UIH; ``samples_per_user`` windows are taken backwards from the
end (0 = all), each UIH at least ``min_history`` long. User and item keys (strings or numbers) are mapped to
dense int ids in order of first appearance; the mappings are written next to the output
(``<out>.user_ids.csv``, ``<out>.item_ids.csv``). Samples are written in the order of their first candidate's
timestamp, as a streaming trainer would see them. The whole event table is held in memory (about 40 bytes an
event: 20M MovieLens ratings need about 1 GB).

Held-out split (``eval_out``, leave-last-out, as sequential recommendation is evaluated): per user, the last
``eval_candidates`` events become that user's one evaluation sample (its UIH: every event before them), written
to ``eval_out``; the user's training samples are cut from the events before them only, so no evaluation
candidate is ever a training candidate or in a training UIH. A user gets an evaluation sample only if the events
left before it still make at least one training sample (more than ``min_history``); other users train on all
their events.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import torch
from tqdm import tqdm

from fsdata.batch import Batch
from fsdata.schema import write_parquet
from fsdata.synthetic import segment_arange

FORMATS = ("movielens", "amazon", "kuairand")
BAD_ROWS = ("error", "skip")
KUAIRAND_ACTIONS = (
    "is_click",
    "is_like",
    "is_follow",
    "is_comment",
    "is_forward",
    "is_hate",
    "long_view",
    "is_profile_enter",
)
_BLOCK = 64 << 20


@dataclass
class Events:
    """An interaction log in columns; ``user`` and ``item`` keep the raw keys (any arrow type)."""

    user: pa.ChunkedArray
    item: pa.ChunkedArray
    time: np.ndarray  # int64 seconds
    labels: np.ndarray  # float32 [N, T]
    action: np.ndarray  # int64 [N], >= 0
    label_names: tuple[str, ...]


# ---------------------------------------------------------------------- raw readers
def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _blocks(path: str, progress: bool, skip_first_line: bool = False) -> Iterator[tuple[bytes, bool]]:
    """The file in blocks of whole lines, with a progress bar over its bytes; the flag is set on a last block
    whose last line had no line end (given one here)."""
    size = os.path.getsize(path)
    with (
        _open(path) as f,
        tqdm(total=size, unit="B", unit_scale=True, desc=f"read {Path(path).name}", disable=not progress) as bar,
    ):
        raw = f.fileobj if hasattr(f, "fileobj") else f  # gzip: count compressed bytes
        if skip_first_line:
            f.readline()
        rest, last = b"", raw.tell()
        while True:
            chunk = f.read(_BLOCK)
            bar.update(raw.tell() - last)
            last = raw.tell()
            if not chunk:
                break
            chunk = rest + chunk
            cut = chunk.rfind(b"\n") + 1
            rest = chunk[cut:]
            if cut:
                yield chunk[:cut], False
            else:
                rest = chunk
        if rest.strip():
            yield rest + b"\n", True


def _first_line(path: str) -> bytes:
    with _open(path) as f:
        return f.readline()


def _concat(tables: list[pa.Table], path: str) -> pa.Table:
    if not tables:
        raise ValueError(f"{path}: no events")
    return pa.concat_tables(tables)


_NUMBER = {
    "int": r"^\s*[-+]?\d+\s*$",
    "float": r"^\s*([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(?i:nan|inf|infinity))\s*$",
}


class _Rows:
    """Counts the rows left out under ``bad_rows="skip"``; raises on the first under ``"error"``."""

    def __init__(self, path: str, bad_rows: str) -> None:
        if bad_rows not in BAD_ROWS:
            raise ValueError(f"bad_rows must be one of {', '.join(BAD_ROWS)}, got {bad_rows!r}")
        self.path, self.skip, self.skipped = path, bad_rows == "skip", 0

    def bad(self, line: int, text: str, why: str) -> None:
        if not self.skip:
            raise ValueError(
                f"{self.path}: line {line}: {why}: {text.strip()[:120]!r} (--bad-rows skip leaves such "
                "rows out, counted)"
            )
        self.skipped += 1


def _parse_block(
    block: bytes, first_line: int, unterminated: bool, rows: _Rows, names: list[str], types: dict, delimiter: str
) -> pa.Table:
    """One block of whole lines as a typed table; malformed rows refused (or left out) with their line number."""
    lines = block.split(b"\n")[:-1]  # physical lines of the block (it ends with a line end)
    wrong_count: dict[int, str] = {}

    cursor = [0]

    def invalid(row) -> str:  # wrong field count; rows come in order (one thread), so find the line from its text
        text = row.text.encode()
        i = cursor[0]
        while i < len(lines) and lines[i].rstrip(b"\r") != text:
            i += 1
        if i < len(lines):
            wrong_count[i], cursor[0] = f"{row.actual_columns} fields, expected {row.expected_columns}", i + 1
        return "skip"

    def any_invalid(row) -> str:
        wrong_count[-1] = ""
        return "skip"

    def read(column_types: dict, exact: bool) -> pa.Table:
        """``exact``: one thread, so the handler sees rows in order (slower: only after a malformed row)."""
        return pacsv.read_csv(
            io.BytesIO(block),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=not exact),
            parse_options=pacsv.ParseOptions(
                delimiter=delimiter, invalid_row_handler=invalid if exact else any_invalid
            ),
            convert_options=pacsv.ConvertOptions(column_types=column_types, include_columns=list(types)),
        )

    def restart() -> None:
        wrong_count.clear()
        cursor[0] = 0

    try:
        table, typed = read(types, exact=False), True
        if wrong_count:
            restart()
            table = read(types, exact=True)
    except pa.ArrowInvalid:  # a field that does not parse: find its line from the text
        restart()
        table, typed = read({name: pa.string() for name in types}, exact=True), False
    if not typed or any(table.column(n).null_count for n in types):
        ok = np.ones(len(table), dtype=bool)
        for name, t in types.items():
            col = table.column(name)
            if typed:
                ok &= col.is_valid().to_numpy(zero_copy_only=False)
            else:
                kind = "int" if pa.types.is_integer(t) else "float" if pa.types.is_floating(t) else None
                valid = pc.match_substring_regex(col, _NUMBER[kind]) if kind else col.is_valid()
                ok &= pc.fill_null(valid, False).to_numpy(zero_copy_only=False)
    else:
        ok = None
    # table row k <-> the k-th non-empty physical line that pyarrow did not drop for its field count
    kept = [i for i, line in enumerate(lines) if line.strip() and i not in wrong_count]
    problems = {i: why for i, why in wrong_count.items()}
    if ok is not None:
        for k in np.flatnonzero(~ok):
            problems[kept[k]] = "a field is empty or does not parse as its column's type"
    if unterminated and kept and kept[-1] not in problems:
        problems[kept[-1]] = "the file ends without a line end after this row (cut short mid-row?)"
    for i in sorted(problems):
        rows.bad(first_line + i, lines[i].decode(errors="replace"), problems[i])
    drop = {k for k, i in enumerate(kept) if i in problems}
    if drop:
        table = table.filter(pa.array([k not in drop for k in range(len(table))]))
    if not typed:
        table = table.cast(pa.schema([(n, types[n]) for n in table.column_names]))
    return table


def _read_delimited(
    path: str,
    names: list[str],
    types: dict,
    delimiter: str,
    header: bool,
    progress: bool,
    replace: Optional[bytes] = None,
    rows: Optional[_Rows] = None,
) -> pa.Table:
    rows = rows if rows is not None else _Rows(path, "error")
    tables, line = [], 2 if header else 1
    for block, unterminated in _blocks(path, progress, skip_first_line=header):
        first_line, line = line, line + block.count(b"\n")
        if replace is not None:
            block = block.replace(replace, delimiter.encode())
        try:
            tables.append(_parse_block(block, first_line, unterminated, rows, names, types, delimiter))
        except pa.ArrowInvalid as e:
            raise ValueError(
                f"{path}: cannot parse as {'header + ' if header else ''}'{delimiter}'-separated columns {names}: {e}"
            ) from e
    return _concat(tables, path)


def _header(path: str) -> list[str]:
    """The first line's column names, lower-cased: known headers match whatever their case."""
    return [c.strip().lower() for c in _first_line(path).decode(errors="replace").strip().split(",")]


def read_movielens(
    paths: Sequence[str], progress: bool = True, skipped: Optional[list] = None, bad_rows: str = "error"
) -> Events:
    """``skipped``: a list to which the count of rows left out (``bad_rows="skip"``) of each file is appended."""
    tables = []
    types = {"user": pa.int64(), "item": pa.int64(), "rating": pa.float64(), "timestamp": pa.int64()}
    for path in paths:
        rows = _Rows(path, bad_rows)
        if path.removesuffix(".gz").endswith(".csv"):
            header = _header(path)
            if header[:4] != ["userid", "movieid", "rating", "timestamp"]:
                raise ValueError(
                    f"{path}: expected the header userId,movieId,rating,timestamp (any case), got {header}"
                )
            tables.append(
                _read_delimited(
                    path, ["user", "item", "rating", "timestamp"] + header[4:], types, ",", True, progress, rows=rows
                )
            )
        else:  # ratings.dat: '::' is not a single-character delimiter, so swap it for a tab first
            tables.append(
                _read_delimited(
                    path,
                    ["user", "item", "rating", "timestamp"],
                    types,
                    "\t",
                    False,
                    progress,
                    replace=b"::",
                    rows=rows,
                )
            )
        if skipped is not None:
            skipped.append(rows.skipped)
    t = pa.concat_tables(tables)
    rating = t.column("rating").to_numpy()
    return Events(
        user=t.column("user"),
        item=t.column("item"),
        time=t.column("timestamp").to_numpy(),
        labels=(rating >= 4).astype(np.float32)[:, None],
        action=np.rint(rating * 2).astype(np.int64),  # half stars: 0.5 -> 1 ... 5 -> 10
        label_names=("rating>=4",),
    )


_AMAZON_FORMS = {
    # key fields -> (user, item, rating, time, time divisor)
    "2018": ("reviewerID", "asin", "overall", "unixReviewTime", 1),
    "2023": ("user_id", "parent_asin", "rating", "timestamp", 1000),
}


def read_amazon(paths: Sequence[str], progress: bool = True) -> Events:
    users, items, ratings, times = [], [], [], []
    for path in paths:
        try:
            keys = set(json.loads(_first_line(path)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{path}: the first line is not a JSON object ({e}); expected Amazon reviews as JSON lines"
            ) from e
        form = next((f for f, cols in _AMAZON_FORMS.items() if set(cols[:4]) <= keys), None)
        if form is None:
            raise ValueError(
                f"{path}: JSON lines without the Amazon review fields; expected {_AMAZON_FORMS['2018'][:4]} or "
                f"{_AMAZON_FORMS['2023'][:4]}, got {sorted(keys)}"
            )
        u, i, r, ts, div = _AMAZON_FORMS[form]
        schema = pa.schema([(u, pa.string()), (i, pa.string()), (r, pa.float64()), (ts, pa.int64())])
        opts = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        tables = []
        for block, _ in _blocks(path, progress):
            try:
                tables.append(pajson.read_json(io.BytesIO(block), parse_options=opts))
            except pa.ArrowInvalid as e:
                raise ValueError(f"{path}: cannot parse JSON lines: {e}") from e
        t = _concat(tables, path)
        for name in (u, i, r, ts):
            if t.column(name).null_count:
                raise ValueError(f"{path}: {t.column(name).null_count} reviews lack '{name}'")
        users.append(t.column(u)), items.append(t.column(i))
        ratings.append(t.column(r).to_numpy()), times.append(t.column(ts).to_numpy() // div)
    rating = np.concatenate(ratings)
    return Events(
        user=pa.chunked_array([c for a in users for c in a.chunks], pa.string()),
        item=pa.chunked_array([c for a in items for c in a.chunks], pa.string()),
        time=np.concatenate(times),
        labels=(rating >= 4).astype(np.float32)[:, None],
        action=np.clip(np.rint(rating), 0, None).astype(np.int64),
        label_names=("rating>=4",),
    )


def read_kuairand(
    paths: Sequence[str],
    label_columns: Sequence[str] = ("is_click",),
    progress: bool = True,
    skipped: Optional[list] = None,
    bad_rows: str = "error",
) -> Events:
    tables = []
    label_columns = [c.lower() for c in label_columns]
    for path in paths:
        rows = _Rows(path, bad_rows)
        header = _header(path)
        need = {"user_id", "video_id", *label_columns}
        missing = need - set(header)
        has_time = "time_ms" in header or {"date", "hourmin"} <= set(header)
        if missing or not has_time:
            raise ValueError(
                f"{path}: KuaiRand log lacks columns "
                f"{sorted(missing) + ([] if has_time else ['time_ms or date+hourmin'])}; "
                f"header is {header}"
            )
        types = {"user_id": pa.int64(), "video_id": pa.int64()}
        types.update({c: pa.float64() for c in {*label_columns, *KUAIRAND_ACTIONS} & set(header)})
        types.update({c: pa.int64() for c in ("time_ms", "date", "hourmin") if c in header})
        t = _read_delimited(path, header, types, ",", True, progress, rows=rows)
        if skipped is not None:
            skipped.append(rows.skipped)
        if "time_ms" in header:
            seconds = t.column("time_ms").to_numpy() // 1000
        else:
            day = (
                pc.strptime(pc.cast(t.column("date"), pa.string()), format="%Y%m%d", unit="s")
                .cast(pa.int64())
                .to_numpy()
            )
            hm = t.column("hourmin").to_numpy()
            seconds = day + (hm // 100) * 3600 + (hm % 100) * 60
        action = np.zeros(len(t), dtype=np.int64)
        for bit, name in enumerate(KUAIRAND_ACTIONS):
            if name in t.column_names:
                action |= (np.nan_to_num(t.column(name).to_numpy(zero_copy_only=False)) > 0).astype(np.int64) << bit
        labels = np.stack(
            [np.nan_to_num(t.column(c).to_numpy(zero_copy_only=False)) > 0 for c in label_columns], axis=1
        )
        tables.append(
            pa.table(
                {
                    "user": t.column("user_id"),
                    "item": t.column("video_id"),
                    "time": seconds,
                    "action": action,
                    **{f"label{j}": labels[:, j].astype(np.float32) for j in range(len(label_columns))},
                }
            )
        )
    t = pa.concat_tables(tables)
    return Events(
        user=t.column("user"),
        item=t.column("item"),
        time=t.column("time").to_numpy(),
        labels=np.stack([t.column(f"label{j}").to_numpy() for j in range(len(label_columns))], axis=1),
        action=t.column("action").to_numpy(),
        label_names=tuple(label_columns),
    )


# ---------------------------------------------------------------------- events -> samples
def _encode(keys: pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """Dense ids in order of first appearance, and the key of every id."""
    enc = keys.combine_chunks().dictionary_encode() if keys.num_chunks != 1 else keys.chunk(0).dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary


def _write_mapping(path: Path, dictionary: pa.Array) -> None:
    pacsv.write_csv(pa.table({"id": np.arange(len(dictionary), dtype=np.int64), "original": dictionary}), str(path))


@dataclass
class ConvertReport:
    events: int
    users: int
    items: int
    samples: int
    skipped_users: int
    """Users with at most ``min_history`` events (no sample)."""
    positive_rate: list[float]
    """Per label column, the mean label of the training samples' candidates (what a model trains on; events that
    are only in a UIH, or in no sample, do not count)."""
    outputs: list[str]
    skipped_rows: int = 0
    """Malformed input rows left out (``bad_rows="skip"``)."""
    eval_samples: int = 0
    """Held-out samples written (``eval_out``), one per eligible user."""
    eval_positive_rate: Optional[list[float]] = None
    """``positive_rate`` of the held-out samples' candidates (None without ``eval_out``)."""


def _positive_rate(labels: np.ndarray, cand_start, cand_end, base) -> list[float]:
    """Per label column, the mean label over the candidates of the samples given as :func:`_write_samples` takes
    them."""
    rows = labels[segment_arange(base + cand_start, cand_end - cand_start)]
    return [float(x) for x in rows.mean(axis=0, dtype=np.float64)]


def _write_samples(
    out: str,
    s_user,
    cand_start,
    cand_end,
    uih_start,
    base,
    item,
    labels,
    action,
    time,
    row_group_size: int,
    progress: bool,
) -> int:
    """Writes one sample per entry (user, its candidates' and UIH's event ranges within the user's events from
    ``base``), in the order given; returns the samples written."""
    num = len(s_user)

    def batches() -> Iterator[Batch]:
        with tqdm(total=num, unit="sample", desc=f"write {Path(out).name}", disable=not progress) as bar:
            for lo in range(0, num, row_group_size):
                sl = slice(lo, min(num, lo + row_group_size))
                uih_len, n_cand = cand_start[sl] - uih_start[sl], cand_end[sl] - cand_start[sl]
                uih_idx = segment_arange(base[sl] + uih_start[sl], uih_len)
                cand_idx = segment_arange(base[sl] + cand_start[sl], n_cand)
                t = torch.from_numpy
                yield Batch(
                    sample_ids=torch.arange(sl.start, sl.stop, dtype=torch.int64),
                    user_ids=t(s_user[sl].copy()),
                    uih_offsets=t(np.concatenate([[0], np.cumsum(uih_len)]).astype(np.int64)),
                    uih_item_ids=t(item[uih_idx]),
                    candidate_offsets=t(np.concatenate([[0], np.cumsum(n_cand)]).astype(np.int64)),
                    candidate_labels=t(np.ascontiguousarray(labels[cand_idx], dtype=np.float32)),
                    content_offsets=torch.arange(len(cand_idx) + 1, dtype=torch.int64),
                    content_ids=t(item[cand_idx]),
                    dense=t(np.log1p(uih_len).astype(np.float32)[:, None]),
                    uih_action_types=t(action[uih_idx]),
                    uih_timestamps=t(time[uih_idx].astype(np.int64)),
                )
                bar.update(sl.stop - sl.start)

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return write_parquet(batches(), out, row_group_size=row_group_size)


def _held_out_ranges(
    users: np.ndarray, counts: np.ndarray, first: np.ndarray, time: np.ndarray, held: int, max_uih: Optional[int]
) -> tuple[np.ndarray, ...]:
    """Each user's held-out sample: its last ``held`` events as candidates, the events before them (at most
    ``max_uih``) as its UIH; in the order of their first candidate's time. (user, cand_start, cand_end, uih_start,
    base) as :func:`_write_samples` takes them."""
    start, end = counts[users] - held, counts[users]
    uih = np.zeros_like(start) if max_uih is None else np.maximum(0, start - max_uih)
    order = np.lexsort((users, time[first[users] + start]))
    users, start, end, uih = (a[order] for a in (users, start, end, uih))
    return users, start, end, uih, first[users]


def _training_ranges(
    train_counts: np.ndarray,
    first: np.ndarray,
    time: np.ndarray,
    candidates: int,
    samples_per_user: int,
    min_history: int,
    max_uih: Optional[int],
) -> tuple[np.ndarray, ...]:
    """Windows per user, then per training sample (in time order of its first candidate): user, candidate start
    and end, UIH start (all within the user's events) and the user's first event. A user's windows of
    ``candidates`` events are counted back from the end of its training events, each after ``min_history``."""
    windows = np.where(train_counts > min_history, -(-(train_counts - min_history) // candidates), 0)
    if samples_per_user:
        windows = np.minimum(windows, samples_per_user)
    s_user = np.repeat(np.arange(len(train_counts)), windows)
    j = segment_arange(np.zeros(len(windows), dtype=np.int64), windows)  # window j counted back from the end
    cand_end = train_counts[s_user] - j * candidates
    cand_start = np.maximum(min_history, cand_end - candidates)
    uih_start = np.zeros_like(cand_start) if max_uih is None else np.maximum(0, cand_start - max_uih)
    base = first[s_user]
    order = np.lexsort((cand_start, s_user, time[base + cand_start]))
    return windows, *(a[order] for a in (s_user, cand_start, cand_end, uih_start, base))


def events_to_parquet(
    events: Events,
    out: str,
    candidates: int = 10,
    samples_per_user: int = 1,
    min_history: int = 1,
    max_uih: Optional[int] = None,
    row_group_size: int = 1024,
    progress: bool = True,
    eval_out: Optional[str] = None,
    eval_candidates: Optional[int] = None,
) -> ConvertReport:
    """Cuts the per-user, time-ordered event sequences into samples and writes them (see the module docstring);
    with ``eval_out``, each eligible user's last ``eval_candidates`` (default: ``candidates``) events become its
    held-out sample there."""
    if candidates < 1 or min_history < 1 or samples_per_user < 0 or (max_uih is not None and max_uih < 1):
        raise ValueError(
            f"need candidates >= 1, min_history >= 1, samples_per_user >= 0, max_uih >= 1 (got {candidates}, "
            f"{min_history}, {samples_per_user}, {max_uih})"
        )
    held = 0 if eval_out is None else (candidates if eval_candidates is None else eval_candidates)
    if eval_out is not None and held < 1:
        raise ValueError(f"eval_candidates must be >= 1, got {eval_candidates}")
    if eval_out is not None and Path(eval_out).resolve() == Path(out).resolve():
        raise ValueError(f"{eval_out}: the held-out split needs a file of its own, not the training output")
    n = len(events.time)
    if n == 0:
        raise ValueError("no events to convert")
    if events.action.min() < 0:
        raise ValueError(f"negative action type {int(events.action.min())} in the events")
    user, user_keys = _encode(events.user)
    item, item_keys = _encode(events.item)
    order = np.lexsort((np.arange(n), events.time, user))
    user, item, time = user[order], item[order], events.time[order]
    labels, action = events.labels[order], events.action[order]

    counts = np.bincount(user, minlength=len(user_keys))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # A user's held-out events are its last `held`, if the events before them still make a training sample.
    in_eval = counts - held > min_history if held else np.zeros(len(counts), dtype=bool)
    train_counts = np.where(in_eval, counts - held, counts)
    windows, *ranges = _training_ranges(train_counts, first, time, candidates, samples_per_user, min_history, max_uih)
    s_user = ranges[0]
    if len(s_user) == 0:
        raise ValueError(f"no user has more than min_history={min_history} events: nothing to write")
    written = _write_samples(out, *ranges, item, labels, action, time, row_group_size, progress)
    positive_rate = _positive_rate(labels, ranges[1], ranges[2], ranges[4])
    outputs = [str(out)]
    eval_written, eval_positive_rate = 0, None
    if held:
        if not in_eval.any():
            raise ValueError(
                f"no user has more than min_history + eval_candidates = {min_history + held} events: "
                f"no held-out sample for {eval_out}"
            )
        ranges = _held_out_ranges(np.flatnonzero(in_eval), counts, first, time, held, max_uih)
        eval_written = _write_samples(eval_out, *ranges, item, labels, action, time, row_group_size, progress)
        eval_positive_rate = _positive_rate(labels, ranges[1], ranges[2], ranges[4])
        outputs.append(str(eval_out))
    stem = str(out)[: -len(".parquet")] if str(out).endswith(".parquet") else str(out)
    user_map, item_map = Path(stem + ".user_ids.csv"), Path(stem + ".item_ids.csv")
    _write_mapping(user_map, user_keys)
    _write_mapping(item_map, item_keys)
    return ConvertReport(
        events=n,
        users=len(user_keys),
        items=len(item_keys),
        samples=written,
        skipped_users=int((windows == 0).sum()),
        positive_rate=positive_rate,
        outputs=[*outputs, str(user_map), str(item_map)],
        eval_samples=eval_written,
        eval_positive_rate=eval_positive_rate,
    )


def convert(
    fmt: str,
    inputs: Sequence[str],
    out: str,
    label_columns: Sequence[str] = ("is_click",),
    progress: bool = True,
    bad_rows: str = "error",
    **options,
) -> ConvertReport:
    """Reads raw files of format ``fmt`` and writes the Parquet dataset; ``options`` go to :func:`events_to_parquet`.
    ``bad_rows``: "error" (a malformed row is an error naming its line) or "skip" (left out, counted; CSV formats)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    if bad_rows not in BAD_ROWS:
        raise ValueError(f"bad_rows must be one of {', '.join(BAD_ROWS)}, got {bad_rows!r}")
    inputs = [str(p) for p in inputs]
    for p in inputs:
        if not Path(p).is_file():
            raise FileNotFoundError(f"{p}: no such input file")
    skipped: list[int] = []
    if fmt == "movielens":
        events = read_movielens(inputs, progress, skipped, bad_rows)
    elif fmt == "amazon":
        events = read_amazon(inputs, progress)
    else:
        events = read_kuairand(inputs, label_columns, progress, skipped, bad_rows)
    report = events_to_parquet(events, out, progress=progress, **options)
    report.skipped_rows = sum(skipped)
    return report
