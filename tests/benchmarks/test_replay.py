"""`python -m benchmarks replay`: the real forward+backward timed on the CPU with a tiny model, the fit, direct mode,
the hook into the simulator."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import replay
from fsdata.partition import GatheredLengths, Plan
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from pipelines.models.softmax import SoftmaxConfig
from pipelines.simulate import simulator

ROOT = Path(__file__).resolve().parents[2]

TINY = (
    "--preset",
    "tiny",
    "--max-uih",
    "64",
    "--replay-model-preset",
    "tiny",
    "--replay-dim",
    "8",
    "--replay-heads",
    "2",
    "--replay-layers",
    "1",
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)  # simulate's flags plus --replay-ranks and --replay-repeats
    return parser.parse_args(["--step-model", "replay", *argv])


def fit_run(tmp_path, *argv: str, steps: str = "2", exit_code: int = 0) -> list[dict]:
    """The fit mode on 4 ranks of 8-sample batches (1 warm-up step) with ``argv``: main's exit code is checked,
    the records written to tmp_path/replay.json are returned."""
    out = tmp_path / "replay.json"
    args = parse(
        *TINY, "--ranks", "4", "--batch-size", "8", "--steps", steps, "--warmup", "1", *argv, "--json", str(out)
    )
    assert replay.main(args) == exit_code
    return json.loads(out.read_text())


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
    # Longer than a sample: its own events repeated from the start, the most recent one last.
    long = replay.equal_length(expected, 100)
    np.testing.assert_array_equal(long.uih_lengths.numpy(), [100] * 4)
    for i, s in enumerate(samples[j] for j in idx):
        ids, n = long.uih_item_ids[100 * i : 100 * (i + 1)].numpy(), len(s.uih_item_ids)
        np.testing.assert_array_equal(ids[-n:], s.uih_item_ids)
        np.testing.assert_array_equal(ids, np.resize(np.roll(s.uih_item_ids, 100 % n), 100))
    assert long.candidate_labels.equal(expected.candidate_labels) and long.content_ids.equal(expected.content_ids)
    with pytest.raises(ValueError, match="length must be >= 1"):
        replay.equal_length(expected, 0)


def test_repeat_deviations_leave_out_the_median_call_and_give_the_spread():
    np.testing.assert_allclose(replay.repeat_deviations(np.array([1.1, 0.9, 1.0])), [-0.1, 0.1])
    assert replay.rel_spread(np.array([1.1, 0.9, 1.0])) == pytest.approx(0.1)
    # Even k: all k deviations, scaled so the mean square has k - 1 degrees of freedom.
    dev = replay.repeat_deviations(np.array([1.0, 2.0, 1.0, 2.0]))
    assert dev.size == 4
    assert np.mean(dev**2) == pytest.approx(np.sum((np.array([1, 2, 1, 2]) / 1.5 - 1) ** 2) / 3)
    assert replay.repeat_deviations(np.array([0.5])).size == 0 and np.isnan(replay.rel_spread(np.array([0.5])))


class ScriptedTimer(replay.Timer):
    """A Timer whose calls take the scripted seconds (the first is the warm-up)."""

    def __init__(self, seconds):
        super().__init__(model=None, device=replay.torch.device("cpu"), dtype="fp32")
        self.seconds = list(seconds)

    def _call(self, batch, plan=None):
        self.calls += 1
        return self.seconds.pop(0)

    def _plan(self, batch):
        return None


def test_each_batch_is_warmed_up_once_then_timed_k_times_and_its_time_is_the_median():
    batch = SyntheticSource(SyntheticConfig(num_samples=4)).read(0, 0, 4)
    timer = ScriptedTimer([9.0, 1.0, 3.0, 2.0])  # 9 s: the first call of the shape, never counted
    times = timer.measure(batch, repeats=3)
    np.testing.assert_array_equal(times, [1.0, 3.0, 2.0])
    assert timer.calls == 4 and np.median(times) == 2.0
    # The real model on the CPU: k timed calls after one warm-up, all positive.
    args = parse(*TINY)
    source = replay._source(args, 100, 0)
    real = replay.Timer(replay._model(args, source, replay.torch.device("cpu")), replay.torch.device("cpu"), "fp32")
    times = real.measure(source.read(0, 0, 4), repeats=2)
    assert times.shape == (2,) and np.all(times > 0) and real.calls == 3


def test_the_timed_calls_do_no_host_plan_work(monkeypatch):
    """A model whose kernel takes a plan (FlexAttention on CUDA) gets it built once per measured batch, before
    the first call, as the loader builds it ahead in training; every timed call receives it."""
    args = parse(*TINY)
    source = replay._source(args, 100, 0)
    model = replay._model(args, source, replay.torch.device("cpu"))
    built, seen = [], []
    monkeypatch.setattr(model, "needs_plan", lambda device: True)
    monkeypatch.setattr(model, "plan_function", lambda: lambda uih, cand: built.append(1) or PlanStub())
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda batch, plan=None: seen.append((len(built), plan)) or forward(batch))
    timer = replay.Timer(model, replay.torch.device("cpu"), "fp32")
    timer.measure(source.read(0, 0, 4), repeats=3)
    assert len(built) == 1 and len(seen) == 4  # one build, then the warm-up and three timed calls
    assert all(n == 1 and isinstance(plan, PlanStub) for n, plan in seen)  # each call after the build, with its plan


class PlanStub:
    def to(self, device):
        return self


def test_timing_batches_are_whole_local_batches_of_the_partitioners_plans():
    from fsdata.partition import RuntimeInfo, get_partitioner

    args = parse(*TINY, "--batch-size", "4", "--replay-timing-ranks", "3")
    source = replay._source(args, 10**6, 7)
    jobs = replay.timing_batches(args, source, np.random.default_rng(0))
    seen = [next(jobs) for _ in range(2 * 3 * 4)]  # two timing steps of 3 ranks x 4 partitioners
    for step in (0, 1):
        sizes = source.lengths(0, step * 12, (step + 1) * 12)
        lengths = GatheredLengths(
            sizes["uih_lengths"],
            sizes["num_candidates"],
            sizes["candidate_lengths"],
            np.arange(12),
            np.arange(4) * 4,
            3,
        )
        mine = [(n, r, b) for n, s, r, b in seen if s == step]
        assert sorted((n, r) for n, r, _ in mine) == sorted(
            (n, r) for n in replay.TIMING_PARTITIONERS for r in range(3)
        )
        for name, rank, batch in mine:
            idx = get_partitioner(name)(lengths, RuntimeInfo(step=step)).rank_samples(rank).numpy()
            assert batch.batch_size == idx.size  # the whole local batch, never a subset
            ids = source.read(0, step * 12, (step + 1) * 12).sample_ids.numpy()
            np.testing.assert_array_equal(batch.sample_ids.numpy(), ids[idx])
            np.testing.assert_array_equal(batch.uih_lengths.numpy(), sizes["uih_lengths"][idx])
    # Partitioners interleaved: the first round already holds one batch of each.
    assert {n for n, *_ in seen[:4]} == set(replay.TIMING_PARTITIONERS)


@pytest.mark.parametrize("kernel", ["padded", "jagged"])
def test_fit_mode_times_once_and_records_what_each_figure_rests_on(tmp_path, kernel):
    records = fit_run(
        tmp_path,
        "--replay-timings",
        "16",
        "--replay-timing-ranks",
        "2",
        "--replay-kernel",
        kernel,
        "--seed",
        "5",
        "--replay-jitter",
        "residual,repeat",
        steps="3",
    )
    assert [(r["jitter"], r["partitioner"]) for r in records] == [
        (j, p) for j in ("residual", "repeat") for p in ("none", "fbs", "vbs", "kk")
    ]
    for r in records:
        assert r["step_model"] == "replay" and r["replay_mode"] == "fit" and r["replay_kernel"] == kernel
        assert r["replay_repeats"] == 3 and r["n_batches_timed"] == 16 and r["n_timings_repeat"] == 16
        assert r["n_calls_timed"] == 48 and r["n_calls_total"] == 64  # + one warm-up per batch (no probe on the CPU)
        assert r["n_timings_fit"] == 12 and r["n_timings_heldout"] == 4  # 16 timings, a quarter held out
        assert sum(r["timings_by_partitioner"].values()) == 16 and r["n_subset_batches"] == 0
        assert r["n_skipped_too_large"] == 0 and r["n_oom"] == 0 and r["timing_wall_s"] > 0
        assert np.isfinite(r["r2_heldout"]) and r["median_rel_err_heldout"] >= 0 and r["jitter_rel_std_fit"] >= 0
        assert r["repeat_rel_std"] > 0 and r["n_jitter_repeats"] == 32  # 2 of 3 calls per batch off the median
        assert r["jitter_source"] == replay.JITTER_SOURCES[r["jitter"]]
        pool = "repeat_rel_std" if r["jitter"] == "repeat" else "jitter_rel_std_fit"
        assert r["jitter_rel_std"] == pytest.approx(r[pool])
        assert all(c >= 0 for c in r["coefficients"].values())
        assert r["fit_features"] == list(replay.FIT_FEATURES[kernel])
        assert all(v == 0 for k, v in r["coefficients"].items() if k not in replay.FIT_FEATURES[kernel])
        assert r["model_config"]["max_uih"] == 64  # the simulation's max UIH, never the preset's
        assert r["straggler_pct"] >= 0 and r["imbalance_max_over_mean"] >= 1.0
    assert len({json.dumps(r["coefficients"]) for r in records}) == 1  # one fit shared by every partitioner
    timings = json.loads((tmp_path / f"replay_timings_{kernel}.json").read_text())
    rows = timings["timings"]
    assert len(rows) == 16 and sum(r["heldout"] for r in rows) == 4
    for row in rows:
        assert len(row["times_s"]) == 3 and row["median_s"] == float(np.median(row["times_s"]))
        # The local batch as it is, for both kernels (the jagged one is the model's own jagged attention).
        assert (row["max_L"], row["sum_L"], row["sum_L2"]) == (
            row["local_max_L"],
            row["local_sum_L"],
            row["local_sum_L2"],
        )
    assert all(r["model_config"]["attention"] == kernel for r in records)


def test_batches_over_the_guard_are_skipped_and_recorded_never_cut(tmp_path):
    record = fit_run(
        tmp_path,
        "--replay-timings",
        "12",
        "--replay-timing-ranks",
        "2",
        "--replay-max-pairs",
        "8000",
        "--replay-kernel",
        "padded",
        "--partitioner",
        "none",
    )[0]
    rows = json.loads((tmp_path / "replay_timings_padded.json").read_text())["timings"]
    assert record["n_skipped_too_large"] >= 1 and record["n_subset_batches"] == 0
    assert all("replay-max-pairs" in s["reason"] for s in record["skipped_examples"])
    assert all(r["count"] * r["max_L"] ** 2 <= 8000 for r in rows) and len(rows) == 12
    guard = replay.MemoryGuard(limit_bytes=2**30, fixed_bytes=0.0, per_token_bytes=2**20)
    assert guard.refuses(replay.features([np.full(8, 100)])[0]) is None  # 800 tokens, 800 MiB
    assert "memory" in guard.refuses(replay.features([np.full(8, 200)])[0])  # 1,600 tokens
    jagged = replay.MemoryGuard(limit_bytes=2**30, fixed_bytes=0.0, per_token_bytes=2**20, kernel="jagged")
    ragged = replay.features([np.array([1000, 10, 10])])[0]  # 3,000 padded tokens, 1,020 jagged ones
    assert "memory" in guard.refuses(ragged) and jagged.refuses(ragged) is None


class SyntheticTimer(replay.Timer):
    """Times from a known padded cost with 1% noise per call; 'runs out of memory' above 300 padded tokens."""

    def __init__(self, model, device, dtype):
        super().__init__(model, device, dtype)
        self.rng = np.random.default_rng(0)

    def measure(self, batch, repeats):
        x = replay.features([batch.uih_lengths.numpy()])[0]
        self.calls += 1
        if x[5] > 300:
            raise replay.torch.cuda.OutOfMemoryError("synthetic")
        self.calls += repeats
        truth = 1e-3 + 1e-5 * x[1] + 2e-6 * x[5] + 1e-8 * x[6]
        return truth * (1.0 + 0.01 * self.rng.standard_normal(repeats))


def test_the_fit_recovers_a_known_cost_and_records_out_of_memory_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(replay, "Timer", SyntheticTimer)
    r = fit_run(
        tmp_path,
        "--replay-timings",
        "40",
        "--replay-timing-ranks",
        "4",
        "--partitioner",
        "none",
        "--replay-repeats",
        "5",
        "--replay-kernel",
        "padded",
    )[0]  # the synthetic truth is a padded cost
    assert r["n_oom"] >= 1 and r["n_batches_timed"] == 40 and r["timed_tokens_range"][1] <= 300
    assert r["r2_heldout"] > 0.95 and r["median_rel_err_heldout"] < 0.02
    assert 0.005 < r["repeat_rel_std"] < 0.02  # the 1% noise of one call, measured from the repeats
    assert r["n_calls_total"] == 40 * 6 + r["n_oom"]


def test_a_kernel_whose_fit_fails_is_recorded_and_the_next_one_still_runs(tmp_path):
    records = fit_run(
        tmp_path,
        "--replay-timings",
        "3",
        "--replay-timing-ranks",
        "2",
        "--replay-kernel",
        "padded,jagged",
        "--partitioner",
        "none",
        exit_code=1,
    )
    assert [r["replay_kernel"] for r in records] == ["padded", "jagged"]
    assert all("only 3 whole local batches" in r["error"] for r in records)
    assert len(json.loads((tmp_path / "replay_timings_jagged.json").read_text())["timings"]) == 3  # kept anyway


def test_the_memory_probe_gives_fixed_and_per_token_bytes():
    class Probed(ScriptedTimer):  # peak = 1 GiB + 10 KiB per token, as a CUDA device would report it
        def measure(self, batch, repeats):
            self.calls += 1 + repeats
            self.last_peak_bytes = 2**30 + 10240 * batch.uih_offsets[-1].item()
            return np.zeros(repeats)

    timer = Probed([])
    timer.device = replay.torch.device("cuda")  # only its type is read
    batch = SyntheticSource(SyntheticConfig(num_samples=4)).read(0, 0, 1)
    guard = replay.MemoryGuard.probe(timer, batch, 1000, limit_gib=2.0, max_pairs=np.inf)
    assert guard.fixed_bytes == pytest.approx(2**30) and guard.per_token_bytes == pytest.approx(10240)
    assert guard.token_cap() == pytest.approx(2**30 / 10240) and timer.calls == 2


def test_replay_step_time_from_a_fit_predicts_per_rank_and_jitters():
    coef = np.array([1e-3, 0, 1e-6, 0, 0, 0, 0])
    fit = replay.Fit(coef, residuals=np.array([0.0]), info={"n_timings_fit": 0})
    step_time = replay.ReplayStepTime(fit, seed=0)
    lengths = GatheredLengths.from_rank_lengths([np.array([100, 200]), np.array([1000])])
    plan = Plan.from_destinations(np.array([0, 0, 1]), 2)
    np.testing.assert_allclose(step_time(lengths, plan), [1e-3 + 300e-6, 1e-3 + 1000e-6])
    noisy = replay.ReplayStepTime(
        replay.Fit(coef, np.array([0.0]), repeats=np.array([0.5, 0.5])), seed=0, jitter="repeat"
    )
    np.testing.assert_allclose(noisy(lengths, plan), 1.5 * np.array([1e-3 + 300e-6, 1e-3 + 1000e-6]))
    np.testing.assert_allclose(step_time.sample_costs(lengths), [100e-6, 200e-6, 1000e-6])
    assert step_time.params.d == 1e-3  # simulate's lower bound adds the fixed cost to every rank


@pytest.mark.parametrize("kernel", ["padded", "jagged"])
def test_direct_mode_times_every_rank_through_simulate(tmp_path, kernel):
    args = parse(
        *TINY,
        "--ranks",
        "3",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--partitioner",
        "none,fbs",
        "--replay-mode",
        "direct",
        "--replay-kernel",
        kernel,
    )
    records = simulator.run_grid(args, 3, 4, 64)  # the hook in simulator.STEP_TIME_MODELS
    assert [r["partitioner"] for r in records] == ["none", "fbs"] and all(r["step_model"] == "replay" for r in records)
    step_time = replay.build_step_time(args)
    assert isinstance(step_time, replay.DirectStepTime)
    lengths = simulator.PresetLengths("tiny", 3, 4, 64, 3, 0).step(1)
    busy = step_time(lengths, Plan.from_destinations(np.arange(12) % 3, 3))
    assert busy.shape == (3,) and np.all(busy > 0) and step_time.record()["n_timings_sim"] == 3


def test_bad_settings_are_refused_with_a_clear_message(monkeypatch):
    with pytest.raises(ValueError, match="replay-kernel"):
        replay.build_step_time(parse(*TINY, "--replay-kernel", "dense"))
    with pytest.raises(ValueError, match="--replay-repeats must be"):
        replay.build_step_time(parse(*TINY, "--replay-repeats", "0"))
    with pytest.raises(ValueError, match="replay-repeats >= 2"):
        replay.build_step_time(parse(*TINY, "--replay-jitter", "repeat", "--replay-repeats", "1"))
    with pytest.raises(ValueError, match="replay-time-budget"):
        replay.build_step_time(parse(*TINY, "--replay-time-budget", "0"))
    # main refuses a bad entry of a list before it times anything.
    monkeypatch.setattr(replay, "build_fit", lambda args: pytest.fail("timed before checking every flag"))
    with pytest.raises(ValueError, match="replay-jitter"):
        replay.main(parse(*TINY, "--replay-jitter", "residual,gaussian"))
    with pytest.raises(ValueError, match="replay-kernel"):
        replay.main(parse(*TINY, "--replay-kernel", "padded,ragged"))
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
    """A GPU host may have neither; the simulator and replay must not need them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torchdata', 'torchrec'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pipelines.simulate.simulator, benchmarks.replay, fsdata.synthetic, fsdata.partition\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "ok", result.stderr


def test_importing_the_harness_offers_replay_to_the_simulator_with_the_models_own_attention():
    assert simulator.STEP_TIME_MODELS["replay"] is replay.build_step_time
    assert parse().replay_kernel == SoftmaxConfig().attention == "jagged"
