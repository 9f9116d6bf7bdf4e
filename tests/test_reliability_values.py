"""Bad values reach the user as one error naming the sample and the column, or are dropped and counted; ids
past the item table are an error unless the job or the dataset declares a fold (docs/reliability.md)."""

import pyarrow.parquet as pq
import pytest
import torch

from fsdata.id_overflow import IdRangeSource, hash_ids
from fsdata.parquet import ParquetSource
from fsdata.schema import META_ID_OVERFLOW, batch_to_table, write_parquet
from fsdata.synthetic import SyntheticConfig, SyntheticSource


def synth(n=64, **kw) -> SyntheticSource:
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n, **kw))


def write_raw(batch, path, metadata=None) -> str:
    table = batch_to_table(batch)
    if metadata:
        table = table.replace_schema_metadata({**table.schema.metadata, **metadata})
    pq.write_table(table, path, row_group_size=16)
    return str(path)


def damaged(n=64, **changes):
    batch = synth(n).read(0, 0, n)
    for name, (index, value) in changes.items():
        t = getattr(batch, name).clone()
        t.view(-1)[index] = value
        setattr(batch, name, t)
    return batch


@pytest.mark.parametrize(
    "column, index, value, match",
    [
        ("dense", 9, float("nan"), r"sample_id 2 \(row 2\): non-finite value nan in column 'dense'"),
        ("dense", 0, float("inf"), r"sample_id 0 \(row 0\): non-finite value inf in column 'dense'"),
        ("candidate_labels", 0, float("nan"), r"sample_id 0 .*non-finite label nan in column 'candidate_labels'"),
        ("candidate_labels", 0, 1.5, r"sample_id 0 .*label outside \[0, 1\].* 1.5 in column 'candidate_labels'"),
        ("candidate_labels", 0, -0.5, r"label outside \[0, 1\]"),
    ],
)
def test_bad_values_are_refused_at_read_naming_sample_and_column(tmp_path, column, index, value, match):
    path = write_raw(damaged(**{column: (index, value)}), tmp_path / "bad.parquet")
    source = ParquetSource(path)
    with pytest.raises(ValueError, match=match) as err:
        source.read(0, 0, 64)
    assert "bad.parquet row group 0" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="non-finite|outside"):  # and the writer never writes such a file
        write_parquet(damaged(**{column: (index, value)}), str(tmp_path / "w.parquet"))


def test_drop_bad_samples_leaves_them_out_and_counts_them(tmp_path):
    batch = damaged(dense=(9, float("nan")), candidate_labels=(0, 2.0))  # samples 2 and 0
    path = write_raw(batch, tmp_path / "bad.parquet")
    source = ParquetSource(path, drop_bad_samples=True)
    out = source.read(0, 0, 20)
    assert out.sample_ids.tolist() == [i for i in range(20) if i not in (0, 2)]
    assert source.stats()["dropped_bad_samples"] == 2
    assert torch.isfinite(out.dense).all() and ((out.candidate_labels >= 0) & (out.candidate_labels <= 1)).all()
    clean = synth(64).read(0, 0, 20)  # the samples kept are exactly the clean ones
    for i, sid in enumerate(out.sample_ids.tolist()):
        a, b = out.uih_offsets, clean.uih_offsets
        assert torch.equal(out.uih_item_ids[a[i] : a[i + 1]], clean.uih_item_ids[b[sid] : b[sid + 1]])
        assert torch.equal(out.dense[i], clean.dense[sid])


def test_ids_beyond_the_table_are_an_error_naming_sample_and_its_largest_id(tmp_path):
    batch = damaged(uih_item_ids=(5, 2**62))
    source = IdRangeSource(ParquetSource(write_raw(batch, tmp_path / "big.parquet")), num_rows=20_000)
    with pytest.raises(
        ValueError,
        match=r"sample_id 0: id in column 'uih_item_ids' beyond the item table's 20000 rows "
        r"\(its largest id 4611686018427387904; 1 such ids in this batch\)",
    ):
        source.read(0, 0, 16)
    # The sample named quotes its own largest id, not the batch's (a later sample's content id here).
    batch = damaged(uih_item_ids=(5, 30_000), content_ids=(-1, 2**62))
    source = IdRangeSource(ParquetSource(write_raw(batch, tmp_path / "two.parquet")), num_rows=20_000)
    with pytest.raises(ValueError, match=r"sample_id 0: .* \(its largest id 30000; 2 such ids in this batch\)"):
        source.read(0, 0, 64)


@pytest.mark.parametrize("overflow", ["modulo", "hash"])
def test_a_declared_fold_maps_ids_onto_rows_and_counts_them(tmp_path, overflow):
    batch = damaged(uih_item_ids=(5, 2**62))
    meta = {META_ID_OVERFLOW: overflow.encode()}
    for source in (
        IdRangeSource(ParquetSource(write_raw(batch, tmp_path / "a.parquet")), 20_000, overflow),
        IdRangeSource(ParquetSource(write_raw(batch, tmp_path / "b.parquet", meta)), 20_000),
    ):
        out = source.read(0, 0, 16)
        assert int(out.uih_item_ids.max()) < 20_000 and source.stats()["folded_ids"] == 1
        expect = 2**62 % 20_000 if overflow == "modulo" else int(hash_ids(torch.tensor([2**62]), 20_000))
        assert int(out.uih_item_ids[5]) == expect


def test_hash_spreads_neighbouring_large_ids():
    ids = torch.arange(2**40, 2**40 + 10_000)
    rows = hash_ids(ids, 1000)
    assert rows.min() >= 0 and rows.max() < 1000 and len(rows.unique()) > 990


def test_presets_that_rely_on_folding_declare_it():
    assert SyntheticConfig.from_preset("kuairand-1k").id_overflow == "modulo"
    assert SyntheticConfig.from_preset("movielens-20m").id_overflow == "modulo"
    assert SyntheticConfig.from_preset("tiny").id_overflow is None  # vocabulary 10,000 fits the tiny model's rows
    source = IdRangeSource(SyntheticSource(SyntheticConfig.from_preset("movielens-20m", num_samples=64)), 20_000)
    source.read(0, 0, 64)
    assert source.stats()["folded_ids"] > 0


def test_a_bad_declaration_in_the_metadata_is_refused(tmp_path):
    path = write_raw(synth().read(0, 0, 8), tmp_path / "a.parquet", {META_ID_OVERFLOW: b"wrap"})
    with pytest.raises(ValueError, match="freescale.id_overflow is 'wrap'"):
        ParquetSource(path)


def _nan_on_rank_1_at_step_2(rank, world_size):
    from pipelines.job.run.step_log import NonFiniteLoss
    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    with Trainer(tiny_config("sync", 5).validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as t:

        def poison(module, args, out):
            return out * float("nan") if rank == 1 and t.step == 2 else out

        t.model.register_forward_hook(poison)
        try:
            t.train()
        except NonFiniteLoss as e:
            return str(e), e.root, len(t.history)
    return None


@pytest.mark.multiprocess
def test_a_non_finite_loss_stops_the_run_at_that_step_naming_the_rank():
    from tests.harness import run_ranks

    (msg0, root0, _), (msg1, root1, _) = run_ranks(_nan_on_rank_1_at_step_2, 2, timeout=120)
    assert msg1 == "non-finite loss at step 2 on rank 1 (its loss sum is nan): the run stops here" and root1
    assert msg0.startswith("non-finite loss at step 2 on another rank") and not root0
