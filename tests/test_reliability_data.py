"""Damaged files and extreme histories at the reader and the converters (docs/reliability.md)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fsdata.batch import Batch, Sample
from fsdata.convert import convert
from fsdata.parquet import ParquetSource
from fsdata.schema import write_parquet
from fsdata.synthetic import SyntheticConfig, SyntheticSource

ROWS = "1,10,5.0,300\n1,11,3.0,100\n2,10,4.0,50\n1,12,4.5,200\n2,15,5.0,60\n"


def ml(tmp_path, text, name="ratings.csv", header="userId,movieId,rating,timestamp"):
    path = tmp_path / name
    path.write_text(f"{header}\n{text}")
    return str(path)


def run(tmp_path, path, **kw):
    return convert("movielens", [path], str(tmp_path / "out.parquet"), candidates=1, progress=False, **kw)


def test_known_headers_match_whatever_their_case(tmp_path):
    a = run(tmp_path, ml(tmp_path, ROWS, header="UserID,MovieID,Rating,Timestamp"))
    assert a.events == 5 and a.skipped_rows == 0


@pytest.mark.parametrize(
    "bad, line, why",
    [
        ("1,13,4.0\n", 4, "3 fields, expected 4"),  # a row cut mid-line, inside the file
        ("1,13,4.0,abc\n", 4, "does not parse as its column's type"),
        ("1,,4.0,500\n", 4, "a field is empty"),
        ("1,13,4.0,500,7\n", 4, "5 fields, expected 4"),
    ],
)
def test_malformed_rows_are_refused_with_their_line_or_skipped_and_counted(tmp_path, bad, line, why):
    rows = ROWS.splitlines(keepends=True)
    path = ml(tmp_path, "".join(rows[:2]) + bad + "".join(rows[2:]))
    with pytest.raises(ValueError, match=f"ratings.csv: line {line}: .*{why}"):
        run(tmp_path, path)
    report = run(tmp_path, path, bad_rows="skip")
    assert report.skipped_rows == 1 and report.events == 5


def test_a_file_cut_mid_row_is_refused(tmp_path):
    path = ml(tmp_path, ROWS + "84,1219,4.0,85")  # the last row cut inside its timestamp: no line end
    with pytest.raises(ValueError, match=r"line 7: the file ends without a line end after this row .*'84,1219,4.0,85'"):
        run(tmp_path, path)
    assert run(tmp_path, path, bad_rows="skip").skipped_rows == 1


def test_kuairand_header_case_and_bad_rows(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("User_ID,Video_ID,Time_MS,Is_Click\n1,5,1000,1\n1,6,2000,0\n1,7,x,1\n2,5,1500,1\n2,6,2500,0\n")
    with pytest.raises(ValueError, match="log.csv: line 4: "):
        convert("kuairand", [str(path)], str(tmp_path / "k.parquet"), candidates=1, progress=False)
    report = convert(
        "kuairand", [str(path)], str(tmp_path / "k.parquet"), candidates=1, progress=False, bad_rows="skip"
    )
    assert report.events == 4 and report.skipped_rows == 1


def test_a_missing_input_is_one_line_at_the_cli(tmp_path, capsys):
    from pipelines.cli import main

    assert (
        main(
            [
                "data",
                "convert",
                "--format",
                "movielens",
                str(tmp_path / "nope.csv"),
                "--out",
                str(tmp_path / "o.parquet"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.strip() == f"freescale data convert: error: {tmp_path / 'nope.csv'}: no such input file"


def _synth(n=64):
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n)).read(0, 0, n)


def test_a_file_corrupt_inside_a_row_group_names_the_row_group(tmp_path):
    path = tmp_path / "a.parquet"
    write_parquet(_synth(), str(path), row_group_size=16, compression="none")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(2)  # uih_item_ids of row group 2: overwrite its data pages, keep the footer
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    source = ParquetSource(path)
    source.read(0, 0, 32)  # row groups 0 and 1 are sound
    with pytest.raises(ValueError, match=r"a.parquet row group 2: cannot be read \(corrupt file\?\)"):
        source.read(0, 32, 40)


def test_a_file_cut_mid_row_group_and_a_directory_with_one_corrupt_file(tmp_path):
    good = tmp_path / "d" / "a.parquet"
    good.parent.mkdir()
    write_parquet(_synth(), str(good), row_group_size=16)
    data = good.read_bytes()
    cut = pq.ParquetFile(good).metadata.row_group(1).column(0).data_page_offset + 5
    (tmp_path / "d" / "b.parquet").write_bytes(data[:cut])  # cut inside row group 1: no footer
    with pytest.raises(ValueError, match=r"b.parquet: not a readable Parquet file \(corrupt or truncated\?\)"):
        ParquetSource(tmp_path / "d")
    assert ParquetSource(good).num_samples(0) == 64


def _one_sample(uih_len: int) -> Batch:
    uih = np.arange(uih_len, dtype=np.int64) % 5000
    return Batch.from_samples(
        [
            Sample(
                sample_id=0,
                user_id=1,
                uih_item_ids=uih,
                candidate_labels=np.ones((1, 1), dtype=np.float32),
                content_ids=[np.asarray([3], dtype=np.int64)],
                dense=np.zeros(2, dtype=np.float32),
            )
        ],
        num_labels=1,
        dense_dim=2,
    )


@pytest.mark.parametrize("uih_len", [1, 10**6])
def test_a_history_of_one_event_and_of_a_million_events_at_the_reader(tmp_path, uih_len):
    path = tmp_path / "u.parquet"
    write_parquet(_one_sample(uih_len), str(path))
    source = ParquetSource(path, uih_cap=21_000)
    batch = source.read(0, 0, 1)
    kept = min(uih_len, 21_000)
    assert batch.uih_offsets.tolist() == [0, kept]
    expect = torch.arange(uih_len - kept, uih_len) % 5000  # the most recent events are kept
    assert torch.equal(batch.uih_item_ids, expect)
    assert source.stats()["truncated_uih"] == (1 if uih_len > 21_000 else 0)


@pytest.mark.parametrize("uih_len", [1, 10**6])
def test_a_history_of_one_event_and_of_a_million_events_at_the_converter(tmp_path, uih_len):
    path = tmp_path / "ratings.csv"
    times = np.arange(uih_len + 1)
    with open(path, "w") as f:  # one user: uih_len events of history, then the candidate
        f.write("userId,movieId,rating,timestamp\n")
        f.write("".join(f"7,{i % 977},4.0,{t}\n" for i, t in enumerate(times)))
    report = convert("movielens", [str(path)], str(tmp_path / "o.parquet"), candidates=1, progress=False)
    assert report.samples == 1 and report.events == uih_len + 1
    batch = ParquetSource(tmp_path / "o.parquet", uih_cap=2 * 10**6).read(0, 0, 1)
    assert batch.uih_offsets.tolist() == [0, uih_len] and int(batch.content_ids[0]) == uih_len % 977


def _empty_files(tmp_path, *names):
    """Files of the schema with no row (a filter upstream that kept nothing, an export that failed quietly)."""
    import pyarrow.parquet as pq

    from fsdata.schema import batch_to_table

    table = batch_to_table(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=4)).read(0, 0, 4))
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(0, 0), tmp_path / name)


def _freescale(tmp_path, capsys, *argv):
    """`freescale ...` in this process: these errors come before any rank starts."""
    import os

    from pipelines.cli import main

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(list(argv))
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    return code, lines


@pytest.mark.parametrize(
    "data, files",
    [
        ("empty.parquet", ["empty.parquet"]),
        ("dir", ["dir/a.parquet", "dir/b.parquet"]),
    ],
)
def test_an_empty_source_is_one_line_naming_the_path_before_any_rank_starts(tmp_path, capsys, data, files):
    _empty_files(tmp_path, *files)
    with pytest.raises(ValueError, match=f"{data}: no samples"):
        ParquetSource(tmp_path / data)
    code, lines = _freescale(tmp_path, capsys, "train", "--nproc", "2", "--device", "cpu", "--data", data)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"freescale train: error: {data}: no samples"), lines
    code, lines = _freescale(tmp_path, capsys, "data", "stats", data)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"freescale data stats: error: {data}: no samples"), (
        lines
    )


def test_a_filter_that_leaves_no_sample_is_one_line_before_any_rank_starts(tmp_path, capsys):
    import pyarrow.parquet as pq

    from fsdata.schema import batch_to_table

    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=8)).read(0, 0, 8)
    batch.dense = torch.full_like(batch.dense, float("nan"))  # every sample bad: --drop-bad-samples keeps none
    pq.write_table(batch_to_table(batch), tmp_path / "nan.parquet", row_group_size=4)
    code, lines = _freescale(
        tmp_path, capsys, "train", "--nproc", "2", "--device", "cpu", "--data", "nan.parquet", "--drop-bad-samples"
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("freescale train: error: nan.parquet: no samples left: every one of its 8 samples"), (
        lines
    )
    assert ParquetSource(tmp_path / "nan.parquet", drop_bad_samples=True).first_kept_sample() is None
    batch.dense[5] = 0.0  # one sound sample, in the second row group: found, and the job may start
    pq.write_table(batch_to_table(batch), tmp_path / "one.parquet", row_group_size=4)
    assert ParquetSource(tmp_path / "one.parquet", drop_bad_samples=True).first_kept_sample() == 5


def _with_column(table, name, change):
    """``table`` with column ``name`` rebuilt from its Python values after ``change(values)`` edited them."""
    import pyarrow as pa

    values = table.column(name).to_pylist()
    change(values)
    return table.set_column(
        table.schema.get_field_index(name), name, pa.array(values, type=table.schema.field(name).type)
    )


def _set(path, value):
    def change(values):
        target = values
        for i in path[:-1]:
            target = target[i]
        target[path[-1]] = value

    return change


@pytest.mark.parametrize(
    "column, path, what",
    [
        ("user_id", (5,), "column 'user_id' is null"),
        ("uih_item_ids", (5,), "column 'uih_item_ids' is null"),
        ("uih_item_ids", (5, 2), "column 'uih_item_ids' holds a null at position 2 of its list"),
        ("uih_timestamps", (5, 1), "column 'uih_timestamps' holds a null at position 1 of its list"),
        ("uih_action_types", (5, 0), "column 'uih_action_types' holds a null at position 0 of its list"),
        ("dense", (5, 3), "column 'dense' holds a null at position 3 of its list"),
        ("candidate_labels", (5, 0), "column 'candidate_labels' holds a null list for candidate 0"),
        ("candidate_labels", (5, 0, 0), "column 'candidate_labels' holds a null at position 0 of candidate 0's list"),
        ("candidate_content_ids", (5, 0, 0), "column 'candidate_content_ids' holds a null at position 0 of candidate"),
    ],
)
def test_a_null_anywhere_names_file_row_group_and_sample_id(tmp_path, column, path, what):
    from fsdata.schema import batch_to_table

    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=8, uih_min=3)).read(0, 0, 8)
    table = _with_column(batch_to_table(batch), column, _set(path, None))
    pq.write_table(table, tmp_path / "nulls.parquet", row_group_size=4)
    source = ParquetSource(tmp_path / "nulls.parquet")
    source.read(0, 0, 4)  # row group 0 is sound
    with pytest.raises(ValueError) as error:
        source.read(0, 4, 8)
    assert str(error.value).startswith(f"{tmp_path / 'nulls.parquet'} row group 1: sample_id 5 (row 1): {what}")
    assert str(error.value).endswith("; nulls are not allowed")


def test_a_null_sample_id_names_its_row(tmp_path):
    from fsdata.schema import batch_to_table

    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=8)).read(0, 0, 8)
    pq.write_table(_with_column(batch_to_table(batch), "sample_id", _set((6,), None)), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet row group 0: row 6: column 'sample_id' is null \(every sample"):
        ParquetSource(tmp_path / "n.parquet").read(0, 0, 8)


def backwards_file(path, num_samples=64, samples=(1, 6), at_start=()):
    """The tiny preset with two events swapped in ``samples`` (the last two; the first two for ``at_start``)."""
    from fsdata.schema import batch_to_table

    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=num_samples, uih_min=4)).read(
        0, 0, num_samples
    )

    def swap(values):
        for s in (*samples, *at_start):
            i = 0 if s in at_start else len(values[s]) - 2
            values[s][i], values[s][i + 1] = values[s][i + 1], values[s][i]

    pq.write_table(_with_column(batch_to_table(batch), "uih_timestamps", swap), path, row_group_size=16)
    return batch


def test_timestamps_going_backwards_are_counted_and_refused_on_request(tmp_path):
    path = tmp_path / "ts.parquet"
    batch = backwards_file(path, samples=(1, 6), at_start=(9,))
    source = ParquetSource(path)
    source.read(0, 0, 64)
    assert source.stats()["unordered_timestamps"] == 3
    # Cut to the 2 newest events, sample 9's swap (its 2 oldest) is gone: what is counted is what is served.
    capped = ParquetSource(path, uih_cap=2)
    capped.read(0, 0, 64)
    assert capped.stats()["unordered_timestamps"] == 2
    ts = batch.uih_timestamps[batch.uih_offsets[1] : batch.uih_offsets[2]].tolist()
    with pytest.raises(ValueError) as error:
        ParquetSource(path, require_ordered_timestamps=True).read(0, 0, 8)
    assert str(error.value) == (
        f"{path} row group 0: sample_id 1 (row 1): uih_timestamps go backwards at event {len(ts) - 1} ({ts[-2]} after"
        f" {ts[-1]}); the model reads time gaps, which needs every history oldest first and no negative time "
        "(--unordered-timestamps sort|drop)"
    )
    dropping = ParquetSource(path, require_ordered_timestamps=True, drop_bad_samples=True)
    kept = dropping.read(0, 0, 16)
    assert kept.sample_ids.tolist() == [i for i in range(16) if i not in (1, 6, 9)]
    assert dropping.stats()["dropped_bad_samples"] == 3 and dropping.stats()["unordered_timestamps"] == 3
    dropping.read(1, 0, 16)  # served again in the next epoch: still 3 distinct samples
    assert dropping.stats()["unordered_timestamps"] == 3 and dropping.unordered_samples().tolist() == [1, 6, 9]


def test_sort_orders_each_history_before_the_cut_and_a_negative_time_is_refused_or_dropped(tmp_path):
    path = tmp_path / "ts.parquet"
    batch = backwards_file(path, samples=(1, 6), at_start=(9,))
    raw = ParquetSource(path).read(0, 0, 16)  # as stored: the swapped events' items kept in place
    sorting = ParquetSource(path, unordered_timestamps="sort", uih_cap=3)
    served = sorting.read(0, 0, 16)
    assert sorting.stats()["unordered_timestamps"] == 3
    for row in range(16):  # every history oldest first, its newest 3 events kept, each event with its own item
        a, b = raw.uih_offsets[row], raw.uih_offsets[row + 1]
        events = sorted(zip(raw.uih_timestamps[a:b].tolist(), raw.uih_item_ids[a:b].tolist()))[-3:]
        c, d = served.uih_offsets[row], served.uih_offsets[row + 1]
        assert list(zip(served.uih_timestamps[c:d].tolist(), served.uih_item_ids[c:d].tolist())) == events
    assert sorting.read(1, 0, 16).uih_timestamps.equal(served.uih_timestamps)

    from fsdata.schema import batch_to_table

    negative = tmp_path / "neg.parquet"
    pq.write_table(
        _with_column(batch_to_table(batch), "uih_timestamps", lambda v: v[20].__setitem__(0, -5)),
        negative,
        row_group_size=16,
    )
    for policy in ("error", "sort"):
        with pytest.raises(ValueError) as error:
            ParquetSource(negative, unordered_timestamps=policy).read(0, 16, 32)
        assert str(error.value).startswith(
            f"{negative} row group 1: sample_id 20 (row 4): uih_timestamps holds a negative time at event 0 (-5); "
        ), str(error.value)
    assert str(error.value).endswith("(--unordered-timestamps drop)")
    dropping = ParquetSource(negative, unordered_timestamps="drop")
    assert 20 not in dropping.read(0, 16, 32).sample_ids.tolist() and dropping.stats()["unordered_timestamps"] == 1
    with pytest.raises(ValueError, match="unordered_timestamps must be one of count, error, sort, drop, got 'keep'"):
        ParquetSource(negative, unordered_timestamps="keep")


def test_data_stats_counts_timestamps_going_backwards_in_a_line_and_its_json(tmp_path, capsys):
    import json

    from pipelines.cli import main

    backwards_file(tmp_path / "ts.parquet", samples=(1, 6, 40))
    assert main(["data", "stats", str(tmp_path / "ts.parquet"), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "  UIH timestamps going backwards: 3 samples (the first: sample_id 1)" in out, out
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["unordered_timestamps"] == {"samples": 3, "first_sample_id": 1}
    backwards_file(tmp_path / "ok.parquet", samples=())
    main(["data", "stats", str(tmp_path / "ok.parquet")])
    assert "  UIH timestamps going backwards: 0 samples" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_timestamps_going_backwards_reach_the_run_summary_and_a_model_reading_time_gaps_refuses_them(tmp_path):
    """The softmax model reads no time gap: served and counted, as distinct samples (both are in step 0 of every
    epoch: 10 steps of 8 read them twice). HSTU reads them: refused in one line, or sorted on request."""
    import json

    from tests.test_reliability_cli import FAST, freescale

    backwards_file(tmp_path / "ts.parquet", num_samples=64, samples=(1, 6))
    proc = freescale(tmp_path, "train", *FAST, "--steps", "10", "--data", "ts.parquet", "--summary-json", "s.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "s.json").read_text())["data_counts"]["unordered_timestamps"] == 2
    assert "unordered timestamps 2" in proc.stdout
    hstu = [*FAST, "--steps", "2", "--data", "ts.parquet", "--model", "hstu"]
    refused = freescale(tmp_path, "train", *hstu)
    lines = [line for line in refused.stderr.splitlines() if "error" in line]
    assert refused.returncode != 0 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "ts.parquet row group 0: sample_id 1 (row 1): uih_timestamps go backwards at event" in lines[0]
    assert "(--unordered-timestamps sort|drop)" in lines[0], lines[0]
    sorted_ = freescale(tmp_path, "train", *hstu, "--unordered-timestamps", "sort")
    assert sorted_.returncode == 0 and "unordered timestamps 2" in sorted_.stdout, sorted_.stderr[-3000:]


def test_data_stats_says_which_unit_the_timestamps_look_like(tmp_path, capsys):
    import numpy as np

    from pipelines.cli import main
    from pipelines.cli.data_stats import timestamp_unit

    now = 1_700_000_000
    for scale, unit in ((1, "seconds"), (1000, "milliseconds"), (10**6, "microseconds"), (10**9, "nanoseconds")):
        assert timestamp_unit(np.array([now, now + 60]) * scale)["unit"] == unit
    assert timestamp_unit(np.array([0, 5, 3600]))["unit"] is None  # relative times: no epoch
    backwards_file(tmp_path / "ok.parquet", samples=())
    main(["data", "stats", str(tmp_path / "ok.parquet")])
    out = capsys.readouterr().out
    assert "  UIH timestamps look like epoch seconds (median " in out and "convert" not in out, out
