"""`--model replay`: the real forward+backward timed on the CPU with a tiny model, the fit, direct mode, the hook."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from fsdata.partition import GatheredLengths, Plan
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from pipelines import replay, simulate

TINY = ("--preset", "tiny", "--max-uih", "64", "--replay-model-preset", "tiny", "--replay-dim", "8",
        "--replay-heads", "2", "--replay-layers", "1")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args(["--model", "replay", *argv])


def test_nonnegative_fit_recovers_the_truth_and_never_goes_negative():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 5000, rng.integers(1, 64)) for _ in range(60)]
    x = replay.features(lengths)
    truth = np.array([2e-3, 1e-5, 0.0, 0.0, 0.0, 3e-8, 4e-12])
    coef = replay.fit_nonnegative(x, x @ truth)
    np.testing.assert_allclose(x @ coef, x @ truth, rtol=1e-6)
    # A truth with a negative term: the fit stays feasible (a kernel never gets faster with more work).
    coef = replay.fit_nonnegative(x, x @ np.array([2e-3, -1e-6, 1e-7, 0, 0, 0, 0]) + 1e-3)
    assert np.all(coef >= 0)
    with pytest.raises(ValueError, match="positive"):
        replay.fit_nonnegative(x, np.zeros(len(lengths)))


def test_features_of_a_local_batch():
    x = replay.features([np.array([3, 1, 2]), np.array([], dtype=np.int64)])
    np.testing.assert_array_equal(x[0], [1, 3, 6, 14, 3, 9, 27])
    np.testing.assert_array_equal(x[1], [1, 0, 0, 0, 0, 0, 0])


def test_select_and_equal_length_build_the_samples_asked_for():
    batch = SyntheticSource(SyntheticConfig(num_samples=40, uih_max=30)).read(0, 0, 40)
    idx = np.array([7, 3, 31, 0])
    samples = batch.to_samples()
    expected = type(batch).from_samples([samples[i] for i in idx])
    assert replay.select(batch, idx).equals(expected)
    cut = replay.equal_length(expected, 2)
    np.testing.assert_array_equal(cut.uih_lengths.numpy(), [2, 2, 2, 2])
    for i, s in enumerate(samples[j] for j in idx):  # the most recent events are kept
        np.testing.assert_array_equal(cut.uih_item_ids[2 * i : 2 * i + 2].numpy(), s.uih_item_ids[-2:])
    with pytest.raises(ValueError, match="shorter"):
        replay.equal_length(expected, 10_000)


@pytest.mark.parametrize("kernel", ["padded", "jagged"])
def test_fit_mode_times_once_and_records_what_each_figure_rests_on(tmp_path, kernel):
    out = tmp_path / "replay.json"
    args = parse(*TINY, "--ranks", "4", "--batch-size", "8", "--steps", "3", "--warmup", "1", "--replay-timings",
                 "16", "--replay-timing-ranks", "2", "--replay-kernel", kernel, "--seed", "5", "--json", str(out))
    assert replay.main(args) == 0
    records = json.loads(out.read_text())
    assert [r["partitioner"] for r in records] == ["none", "fbs", "vbs", "kk"]
    for r in records:
        assert r["model"] == "replay" and r["replay_mode"] == "fit" and r["replay_kernel"] == kernel
        assert r["jitter"] == "residual" and r["n_timings_repeat"] == 3  # every 5th of 16 timed twice
        assert r["n_timings_fit"] == 12 and r["n_timings_heldout"] == 4  # 16 timings, a quarter held out
        assert sum(r["timings_by_partitioner"].values()) == 16
        assert np.isfinite(r["r2_heldout"]) and r["median_rel_err_heldout"] >= 0 and r["jitter_rel_std_fit"] >= 0
        assert all(c >= 0 for c in r["coefficients"].values())
        assert r["model_config"]["max_uih"] == 64  # the simulation's max UIH, never the preset's
        assert r["straggler_pct"] >= 0 and r["imbalance_max_over_mean"] >= 1.0
    assert len({json.dumps(r["coefficients"]) for r in records}) == 1  # one fit shared by every partitioner
    if kernel == "jagged":
        assert all(records[0]["coefficients"][k] == 0 for k in ("max_L", "count_x_max_L", "count_x_max_L2"))


def test_replay_step_time_from_a_fit_predicts_per_rank_and_jitters():
    coef = np.array([1e-3, 0, 1e-6, 0, 0, 0, 0])
    fit = replay.Fit(coef, residuals=np.array([0.0]), info={"n_timings_fit": 0})
    step_time = replay.ReplayStepTime(fit, seed=0)
    lengths = GatheredLengths.from_rank_lengths([np.array([100, 200]), np.array([1000])])
    plan = Plan.from_destinations(np.array([0, 0, 1]), 2)
    np.testing.assert_allclose(step_time(lengths, plan), [1e-3 + 300e-6, 1e-3 + 1000e-6])
    noisy = replay.ReplayStepTime(replay.Fit(coef, np.array([0.0]), repeats=np.array([0.5, 0.5])), seed=0, jitter="repeat")
    np.testing.assert_allclose(noisy(lengths, plan), 1.5 * np.array([1e-3 + 300e-6, 1e-3 + 1000e-6]))
    np.testing.assert_allclose(step_time.sample_costs(lengths), [100e-6, 200e-6, 1000e-6])
    assert step_time.params.d == 1e-3  # simulate's lower bound adds the fixed cost to every rank


def test_direct_mode_times_every_rank_through_simulate(tmp_path):
    args = parse(*TINY, "--ranks", "3", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--partitioner",
                 "none,fbs", "--replay-mode", "direct")
    records = simulate.run_grid(args, 3, 4, 64)  # the hook in simulate.STEP_TIME_MODELS
    assert [r["partitioner"] for r in records] == ["none", "fbs"] and all(r["model"] == "replay" for r in records)
    step_time = replay.build_step_time(args)
    assert isinstance(step_time, replay.DirectStepTime)
    lengths = simulate.PresetLengths("tiny", 3, 4, 64, 3, 0).step(1)
    busy = step_time(lengths, Plan.from_destinations(np.arange(12) % 3, 3))
    assert busy.shape == (3,) and np.all(busy > 0) and step_time.record()["n_timings_sim"] == 3


def test_bad_settings_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="direct"):
        replay.build_step_time(parse(*TINY, "--replay-mode", "direct", "--replay-kernel", "jagged"))
    with pytest.raises(ValueError, match="replay-kernel"):
        replay.build_step_time(parse(*TINY, "--replay-kernel", "dense"))
    fit = replay.Fit(np.zeros(7), residuals=np.zeros(3), repeats=np.zeros(1))
    with pytest.raises(ValueError, match="repeated timings"):
        replay.ReplayStepTime(fit, seed=0, jitter="repeat")
    with pytest.raises(ValueError, match="replay-jitter"):
        replay.ReplayStepTime(fit, seed=0, jitter="gaussian")
    with pytest.raises(ValueError, match="replay-model-preset"):
        replay.build_step_time(parse("--preset", "tiny", "--replay-model-preset", "huge"))
    with pytest.raises(ValueError, match="--data"):
        replay.build_step_time(parse("--data", "x.parquet", "--max-uih", "64", "--replay-model-preset", "tiny"))
    if not replay.torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            replay.build_step_time(parse(*TINY, "--device", "cuda"))


def test_the_replay_path_imports_without_torchdata_or_torchrec():
    """The GPU machine has neither; the simulator and replay must not need them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torchdata', 'torchrec'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pipelines.simulate, pipelines.replay, fsdata.synthetic, fsdata.partition\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr
