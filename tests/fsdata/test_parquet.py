"""ParquetSource and the writer: round trips, row-group streaming, the global index, and every bad input."""

import gc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fsdata.batch import Batch, Sample
from fsdata.parquet import ParquetSource
from fsdata.schema import batch_to_table, validate_schema, write_parquet
from fsdata.synthetic import SyntheticConfig, SyntheticSource


def synth(n=300, **kw) -> SyntheticSource:
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n, **kw))


def sample(sid, uih, cands=((5,),), labels=None, dense=(0.5, 1.0), side=True) -> Sample:
    uih = np.asarray(uih, dtype=np.int64)
    return Sample(
        sample_id=sid,
        user_id=7,
        uih_item_ids=uih,
        candidate_labels=np.asarray(labels if labels is not None else [[1.0]] * len(cands), dtype=np.float32),
        content_ids=[np.asarray(c, dtype=np.int64) for c in cands],
        dense=np.asarray(dense, dtype=np.float32),
        uih_action_types=np.zeros(len(uih), dtype=np.int64) if side else None,
        uih_timestamps=np.arange(len(uih), dtype=np.int64) if side else None,
    )


def write_raw(batch: Batch, path) -> str:
    """Writes without the writer's validation (to produce the bad files a reader must reject)."""
    pq.write_table(batch_to_table(batch), path)
    return str(path)


def test_round_trip_any_range(tmp_path):
    src = synth(300)
    write_parquet((src.read(0, i, i + 50) for i in range(0, 300, 50)), tmp_path / "a.parquet", row_group_size=32)
    ps = ParquetSource(tmp_path / "a.parquet")
    assert ps.num_samples(0) == 300 and pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 10
    assert ps.read(0, 0, 300).equals(src.read(0, 0, 300))
    for a, b in ((0, 1), (31, 33), (40, 200), (299, 300)):
        assert ps.read(1, a, b).equals(src.read(0, a, b))
    assert ps.read(0, 7, 7).batch_size == 0


def test_reads_only_overlapping_row_groups_with_a_cache(tmp_path):
    write_parquet(synth(256).read(0, 0, 256), tmp_path / "a.parquet", row_group_size=64)
    ps = ParquetSource(tmp_path / "a.parquet")
    ps.read(0, 70, 80)
    assert ps.stats()["row_groups_decoded"] == 1
    ps.read(0, 80, 100)  # same row group: cache hit
    ps.read(0, 100, 140)  # spans groups 1 and 2: one new decode
    s = ps.stats()
    assert (s["row_groups_decoded"], s["cache_hits"], s["samples_read"]) == (2, 2, 70)


def test_global_index_spans_sorted_files_and_directories(tmp_path):
    src = synth(200)
    write_parquet(src.read(0, 100, 200), tmp_path / "b.parquet", row_group_size=30)
    write_parquet(src.read(0, 0, 100), tmp_path / "a.parquet", row_group_size=30)
    for arg in (tmp_path, [tmp_path / "b.parquet", tmp_path / "a.parquet"]):
        ps = ParquetSource(arg)
        assert ps.num_samples(0) == 200
        assert ps.read(0, 90, 130).equals(src.read(0, 90, 130))
    # disjoint rank ranges cover the data exactly once, whatever the world size
    for world in (1, 3, 4):
        per = -(-200 // world)
        got = torch.cat(
            [ParquetSource(tmp_path).read(0, r * per, min(200, (r + 1) * per)).sample_ids for r in range(world)]
        )
        assert torch.equal(got, src.read(0, 0, 200).sample_ids)


def test_list_values_are_shared_with_arrow(tmp_path):
    write_parquet(synth(64).read(0, 0, 64), tmp_path / "a.parquet")
    ps = ParquetSource(tmp_path / "a.parquet")
    ps.read(0, 0, 64)
    rg = ps._cache[0]
    gc.collect()  # arrow memory of earlier tests' garbage must not be freed in between: the counter is global
    gc.disable()
    try:
        before = pa.total_allocated_bytes()
        b = ps.read(0, 0, 64)
        after = pa.total_allocated_bytes()
    finally:
        gc.enable()
    assert after <= before  # a cached read allocates no arrow memory ...
    assert b.uih_item_ids.data_ptr() == rg.uih_item_ids.data_ptr()  # ... and returns views of the decoded buffers
    np_values = pq.read_table(tmp_path / "a.parquet").column("uih_item_ids").combine_chunks().values.to_numpy()
    assert np.array_equal(b.uih_item_ids.numpy(), np_values)


def test_source_pickles_without_open_handles(tmp_path):
    import pickle

    write_parquet(synth(64).read(0, 0, 64), tmp_path / "a.parquet", row_group_size=16)
    ps = ParquetSource(tmp_path / "a.parquet")
    first = ps.read(0, 10, 40)
    clone = pickle.loads(pickle.dumps(ps))
    assert clone._cache == {} and clone.read(0, 10, 40).equals(first)


def test_side_features_are_optional(tmp_path):
    write_parquet(synth(40, side_features=False).read(0, 0, 40), tmp_path / "a.parquet")
    b = ParquetSource(tmp_path / "a.parquet").read(0, 0, 40)
    assert b.uih_action_types is None and b.uih_timestamps is None


def test_long_uih_keeps_the_most_recent_items_and_is_counted(tmp_path):
    batch = Batch.from_samples([sample(0, range(10)), sample(1, [3, 4]), sample(2, range(100, 120))])
    write_parquet(batch, tmp_path / "a.parquet")
    ps = ParquetSource(tmp_path / "a.parquet", uih_cap=5)
    b = ps.read(0, 0, 3)
    assert b.uih_lengths.tolist() == [5, 2, 5]
    assert b.uih_item_ids.tolist() == [5, 6, 7, 8, 9, 3, 4, 115, 116, 117, 118, 119]
    assert b.uih_timestamps.tolist()[:5] == [5, 6, 7, 8, 9]
    assert ps.stats()["truncated_uih"] == 2
    ps.read(0, 1, 2)
    assert ps.stats()["truncated_uih"] == 2  # counted per served sample


# ---------------------------------------------------------------------- bad input
def test_missing_path():
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ParquetSource("/nonexistent/nope.parquet")


def test_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="no \\*.parquet"):
        ParquetSource(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_or_truncated_file(tmp_path, damage):
    path = tmp_path / "a.parquet"
    write_parquet(synth(64).read(0, 0, 64), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not parquet at all" * 10)
    with pytest.raises(ValueError, match="a.parquet.*not a readable Parquet file"):
        ParquetSource(path)


def test_corrupt_row_group_names_file_and_row_group(tmp_path):
    path = tmp_path / "a.parquet"
    write_parquet(synth(64).read(0, 0, 64), path, row_group_size=64, compression="none")
    data = bytearray(path.read_bytes())
    md = pq.ParquetFile(path).metadata
    col = md.row_group(0).column(2)  # uih_item_ids pages
    start = col.data_page_offset
    data[start + 4 : start + 4 + col.total_compressed_size - 8] = b"\xff" * (col.total_compressed_size - 8)
    path.write_bytes(bytes(data))
    ps = ParquetSource(path)
    with pytest.raises(ValueError, match="a.parquet row group 0"):
        ps.read(0, 0, 10)


def test_wrong_schema_names_file_and_column(tmp_path):
    table = batch_to_table(synth(8).read(0, 0, 8))
    bad = table.set_column(table.schema.get_field_index("user_id"), "user_id", pa.array(np.arange(8, dtype=np.int32)))
    pq.write_table(bad, tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: column 'user_id' has type int32, expected int64"):
        ParquetSource(tmp_path / "a.parquet")
    pq.write_table(table.drop_columns(["candidate_labels"]), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: missing column 'candidate_labels'"):
        ParquetSource(tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="x.parquet: column 'dense'"):
        validate_schema(
            table.schema.set(table.schema.get_field_index("dense"), pa.field("dense", pa.list_(pa.float64()))),
            "x.parquet",
        )


def test_negative_ids_name_file_row_group_and_sample(tmp_path):
    cases = {
        "uih_item_ids": [sample(10, [1, 2]), sample(11, [3, -4])],
        "candidate_content_ids": [sample(10, [1]), sample(11, [2], cands=((5, 6), (7, -1)))],
    }
    for column, samples in cases.items():
        path = write_raw(Batch.from_samples(samples), tmp_path / "a.parquet")
        with pytest.raises(ValueError, match=rf"a.parquet row group 0: sample_id 11 .*negative id -?\d+ in {column}"):
            ParquetSource(path).read(0, 0, 2)
    path = write_raw(Batch.from_samples([sample(-3, [1])]), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="negative sample_id -3"):
        ParquetSource(path).read(0, 0, 1)


def test_empty_uih_names_file_row_group_and_sample(tmp_path):
    batch = Batch.from_samples([sample(i, [1, 2]) for i in range(5)] + [sample(42, [])])
    path = tmp_path / "a.parquet"
    pq.write_table(batch_to_table(batch), path, row_group_size=3)
    ps = ParquetSource(path)
    ps.read(0, 0, 3)  # the first row group is fine
    with pytest.raises(ValueError, match=r"a.parquet row group 1: sample_id 42 .*empty UIH"):
        ps.read(0, 3, 6)
    with pytest.raises(ValueError, match="empty UIH"):  # the writer refuses it too
        write_parquet(batch, tmp_path / "b.parquet")


def test_inconsistent_lists_are_rejected(tmp_path):
    table = batch_to_table(Batch.from_samples([sample(0, [1, 2, 3]), sample(1, [4])]))
    short = pa.array([[0, 0, 0], []], type=pa.list_(pa.int64()))
    pq.write_table(
        table.set_column(table.schema.get_field_index("uih_action_types"), "uih_action_types", short),
        tmp_path / "a.parquet",
    )
    with pytest.raises(ValueError, match="sample_id 1 .*uih_action_types has 0 values but the UIH has 1"):
        ParquetSource(tmp_path / "a.parquet").read(0, 0, 2)
    nulls = pa.array([[1, 2, 3], None], type=pa.list_(pa.int64()))
    pq.write_table(
        table.set_column(table.schema.get_field_index("uih_item_ids"), "uih_item_ids", nulls), tmp_path / "a.parquet"
    )
    with pytest.raises(ValueError, match=r"sample_id 1 \(row 1\): column 'uih_item_ids' is null; nulls are not"):
        ParquetSource(tmp_path / "a.parquet").read(0, 0, 2)


def test_files_must_agree_on_side_features_and_dims(tmp_path):
    write_parquet(synth(8).read(0, 0, 8), tmp_path / "a.parquet")
    write_parquet(synth(8, side_features=False).read(0, 0, 8), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="b.parquet: side-feature columns"):
        ParquetSource(tmp_path)
    write_parquet(synth(8, dense_dim=3).read(0, 0, 8), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="b.parquet: dense_dim is 3 but earlier files have 4"):
        ParquetSource(tmp_path)
