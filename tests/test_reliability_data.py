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
