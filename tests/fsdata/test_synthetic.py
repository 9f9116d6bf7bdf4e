"""SyntheticSource: determinism under any split, the presets' length statistics, the collision knob, speed."""

import time

import numpy as np
import pytest
import torch

from fsdata.batch import Batch
from fsdata.synthetic import PRESETS, SyntheticConfig, SyntheticSource, collision_rate, row_ids


def tiny(**kw) -> SyntheticSource:
    return SyntheticSource(SyntheticConfig.from_preset("tiny", **{"num_samples": 600, **kw}))


def test_any_split_gives_the_same_samples():
    src = tiny(collision_block_size=64)
    whole = src.read(3, 10, 500)
    rng = np.random.default_rng(0)
    for _ in range(3):
        cuts = sorted(set(rng.integers(10, 500, size=6).tolist()) | {10, 500})
        fresh = tiny(collision_block_size=64)  # no shared cache: the values depend on (seed, epoch, index) only
        parts = [fresh.read(3, a, b) for a, b in zip(cuts[:-1], cuts[1:])][::-1]
        assert Batch.concat(parts[::-1]).equals(whole)
    assert src.read(3, 0, 600).to_samples()[10].sample_id == whole.sample_ids[0]


def test_epochs_and_seeds_differ_and_ids_are_unique():
    src = tiny()
    a, b = src.read(0, 0, 100), src.read(1, 0, 100)
    assert not torch.equal(a.uih_lengths, b.uih_lengths)
    assert not torch.equal(tiny(seed=1).read(0, 0, 100).uih_lengths, a.uih_lengths)
    ids = torch.cat([a.sample_ids, b.sample_ids])
    assert ids.unique().numel() == 200


def test_empty_and_out_of_range_reads():
    src = tiny()
    empty = src.read(0, 600, 600)
    assert empty.batch_size == 0 and empty.uih_action_types is not None and empty.dense.shape == (0, 4)
    with pytest.raises(ValueError, match="outside"):
        src.read(0, 590, 601)


def test_values_are_well_formed():
    src = tiny(num_samples=300, num_labels=2)
    b = src.read(0, 0, 300)
    c = src.config
    assert int(b.uih_lengths.min()) >= 1 and int(b.uih_lengths.max()) <= c.uih_max
    assert int(b.num_candidates.min()) >= 1 and int(b.num_candidates.max()) <= c.num_candidates_max
    assert int(b.candidate_lengths.min()) >= 1 and int(b.candidate_lengths.max()) <= c.content_length_max
    for ids in (b.uih_item_ids, b.content_ids):
        assert int(ids.min()) >= 0 and int(ids.max()) < c.vocab_size
    assert 0 <= int(b.uih_action_types.min()) and int(b.uih_action_types.max()) < c.num_action_types
    assert b.candidate_labels.shape == (int(b.num_candidates.sum()), 2)
    assert set(b.candidate_labels.unique().tolist()) <= {0.0, 1.0}
    # timestamps strictly increase inside every history
    ts, off = b.uih_timestamps, b.uih_offsets
    step = ts[1:] - ts[:-1]
    boundary = torch.zeros(len(ts) - 1, dtype=torch.bool)
    boundary[(off[1:-1] - 1)] = True
    assert bool((step[~boundary] > 0).all())
    lens = src.lengths(0, 0, 300)
    assert np.array_equal(lens["uih_lengths"], b.uih_lengths.numpy())
    assert np.array_equal(lens["candidate_lengths"], b.candidate_lengths.numpy())


def test_labels_carry_a_learnable_signal():
    b = tiny(num_samples=2000).read(0, 0, 2000)
    first = b.content_offsets[:-1]
    items = b.content_ids[first]
    sample_of = torch.repeat_interleave(torch.arange(b.batch_size), b.num_candidates)
    in_uih = torch.tensor(
        [
            bool((b.uih_item_ids[b.uih_offsets[s] : b.uih_offsets[s + 1]] == it).any())
            for s, it in zip(sample_of.tolist(), items.tolist())
        ]
    )
    y = b.candidate_labels[:, 0]
    assert float(y[in_uih].mean()) - float(y[~in_uih].mean()) > 0.3


def test_no_side_features():
    b = tiny(side_features=False).read(0, 0, 10)
    assert b.uih_action_types is None and b.uih_timestamps is None


def test_presets_follow_the_published_length_statistics():
    kr = SyntheticSource(SyntheticConfig.from_preset("kuairand-1k")).lengths(0, 0, 100_000)
    raw = kr["raw_uih_lengths"]
    assert abs(np.median(raw) / 3379 - 1) < 0.03
    assert abs(raw.mean() / 5038 - 1) < 0.03
    assert raw.max() <= 49_332
    assert kr["uih_lengths"].max() == 21_000  # the paper's cap, default
    ml = SyntheticSource(SyntheticConfig.from_preset("movielens-20m")).lengths(0, 0, 100_000)["uih_lengths"]
    assert abs(ml.mean() / 144 - 1) < 0.03 and ml.min() >= 20


def test_cap_truncates_and_counts():
    src = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=500, uih_cap=8))
    b = src.read(0, 0, 500)
    raw = src.lengths(0, 0, 500)["raw_uih_lengths"]
    assert int(b.uih_lengths.max()) == 8
    assert src.stats()["truncated_uih"] == int((raw > 8).sum()) > 0


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 1.0])
def test_collision_knob_tracks_unique_row_overlap(p):
    block = 64
    src = tiny(num_samples=block * 6, vocab_size=10_000_000, collision_rate=p, collision_block_size=block)
    rows = [row_ids(src.read(0, k * block, (k + 1) * block)) for k in range(6)]
    rates = [collision_rate(rows[k], rows[k + 1]) for k in range(5)]
    assert max(abs(r - p) for r in rates) < 0.02, rates


def test_collision_rate_does_not_depend_on_duplicates():
    rates, dup = [], []
    for zipf, unique in ((0.6, 0.8), (1.4, 0.2)):
        src = tiny(
            num_samples=256, collision_rate=0.2, collision_block_size=128, zipf_exponent=zipf, unique_fraction=unique
        )
        a, b = src.read(0, 0, 128), src.read(0, 128, 256)
        rates.append(collision_rate(row_ids(a), row_ids(b)))
        dup.append(row_ids(b).numel() / (b.uih_item_ids.numel() + b.content_ids.numel()))
    assert abs(dup[0] - dup[1]) > 0.3  # very different within-batch duplication ...
    assert all(abs(r - 0.2) < 0.02 for r in rates), rates  # ... same collision rate


def test_kuairand_batch_generates_fast():
    src = SyntheticSource(SyntheticConfig.from_preset("kuairand-1k", num_samples=10_000))
    src.read(0, 0, 128)
    best = min(_cpu_seconds(lambda k=k: src.read(0, 128 * k, 128 * (k + 1))) for k in range(1, 4))
    assert best < 0.1, f"{best * 1e3:.0f} ms of CPU for 128 KuaiRand-like samples (about 640k ids)"


def _cpu_seconds(fn) -> float:
    """CPU time of this process: robust to other jobs sharing the cores (wall time is not)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="unknown synthetic preset"):
        SyntheticConfig.from_preset("nope")
    with pytest.raises(ValueError, match="unknown SyntheticConfig fields"):
        SyntheticConfig.from_preset("tiny", collision=0.1)
    with pytest.raises(ValueError, match="collision_rate"):
        SyntheticSource(SyntheticConfig(collision_rate=1.5))
    assert set(PRESETS) >= {"tiny", "kuairand-1k", "movielens-20m"}


def _run(module, argv):
    """Runs one `freescale data ...` subcommand module as the CLI router would."""
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.main(parser.parse_args(argv))


def test_cli_synth_then_stats(tmp_path, capsys):
    import json

    from fsdata.parquet import ParquetSource
    from pipelines.cli import data_stats, data_synth

    out = tmp_path / "s.parquet"
    argv = [
        "--num-samples",
        "640",
        "--out",
        str(out),
        "--row-group-size",
        "100",
        "--collision-rate",
        "0.3",
        "--batch-size",
        "64",
    ]
    assert _run(data_synth, argv + ["--set", "vocab_size=1000000"]) == 0
    expect = SyntheticSource(
        SyntheticConfig.from_preset(
            "tiny", num_samples=640, collision_rate=0.3, collision_block_size=64, vocab_size=10**6
        )
    )
    assert ParquetSource(out).read(0, 0, 640).equals(expect.read(0, 0, 640))
    assert (
        _run(
            data_stats,
            [str(out), "--batch-size", "32", "--global-batch-size", "64", "--json", str(tmp_path / "s.json")],
        )
        == 0
    )
    stats = json.loads((tmp_path / "s.json").read_text())
    assert abs(stats["collision_rate"]["mean"] - 0.3) < 0.01 and stats["collision_rate"]["pairs"] == 9
    assert stats["uih_lengths"]["max"] <= 64 and 0 < stats["sparsity_eq1_mean"] < 1
    assert _run(data_stats, ["--preset", "tiny", "--num-samples", "256", "--collision-rate", "0.05"]) == 0
    assert "collision rate between consecutive global batches of 128: mean 0.05" in capsys.readouterr().out
