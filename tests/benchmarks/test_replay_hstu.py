"""`python -m benchmarks replay` on the HSTU model (``--replay-model-preset hstu``): its real forward+backward timed on
the CPU, every figure on its packed sequences (kept UIH then candidates), the noise floor beside each row, and the
flags it does not have refused in one line."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from benchmarks import replay
from fsdata.partition import GatheredLengths, Plan
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from pipelines.models.hstu import HSTUModel
from pipelines.simulate import simulator

HSTU = ("--preset", "tiny", "--max-uih", "64", "--replay-model-preset", "hstu", "--replay-dim", "16")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared two-core machine, two threads per tiny kernel mostly wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args(["--step-model", "replay", *HSTU, *argv])


def test_the_fit_times_the_hstu_model_on_its_packed_sequences(tmp_path, monkeypatch, capsys):
    measured = []
    measure = replay.Timer.measure
    monkeypatch.setattr(replay.Timer, "measure", lambda self, b, k: measured.append(b) or measure(self, b, k))
    out = tmp_path / "replay.json"
    args = parse(
        "--ranks", "4", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--partitioner", "none,fbs,kk",
        "--replay-timings", "12", "--replay-timing-ranks", "2", "--replay-jitter", "residual,repeat",
        "--replay-ranks", "4,8", "--seed", "3", "--json", str(out),
    )  # fmt: skip
    assert replay.main(args) == 0
    records = json.loads(out.read_text())
    assert [(r["jitter"], r["ranks"], r["partitioner"]) for r in records] == [
        (j, w, p) for j in ("residual", "repeat") for w in (4, 8) for p in ("none", "fbs", "kk")
    ]
    for r in records:
        assert r["replay_model"] == "hstu" and r["sequence"] == "uih+candidates" and r["replay_kernel"] == "jagged"
        assert r["model_config"]["head_dim"] == 16 and r["model_config"]["dim"] == 16  # HSTUConfig, --replay-dim
        assert r["model_config"]["max_uih"] == 64 and r["n_batches_timed"] == 12
        assert r["noise_floor_pct"] > 0 and r["straggler_over_noise_floor"] == pytest.approx(
            r["straggler_pct"] / r["noise_floor_pct"]
        )
    # Every timed row's figures are those of its batch's packed sequences: kept UIH plus candidates.
    rows = json.loads((tmp_path / "replay_timings_jagged.json").read_text())["timings"]
    assert len(rows) == len(measured) == 12  # no probe off CUDA: one measure() per timed batch
    for row, batch in zip(rows, measured):
        seq = (batch.uih_lengths + batch.num_candidates).numpy()
        assert (row["count"], row["sum_L"], row["sum_L2"], row["max_L"]) == (
            seq.size,
            float(seq.sum()),
            float((seq**2).sum()),
            int(seq.max()),
        )
        assert row["sum_L"] > float(batch.uih_lengths.sum())  # every sample has a candidate
    text = capsys.readouterr().out
    assert "floor%" in text.splitlines()[0] and "x floor" in text.splitlines()[0]
    assert "jagged kernel (hstu model, L = uih+candidates), cpu fp32: 12 whole local batches" in text


def test_the_timer_runs_the_hstu_model_and_counts_its_candidates():
    args = parse()
    source = replay._source(args, 100, 0)
    model = replay._model(args, source, torch.device("cpu"))
    assert isinstance(model, HSTUModel) and model.config.max_uih == 64
    timer = replay.Timer(model, torch.device("cpu"), "fp32")
    batch = source.read(0, 0, 4)
    np.testing.assert_array_equal(timer.lengths(batch), (batch.uih_lengths + batch.num_candidates).numpy())
    times = timer.measure(batch, repeats=2)
    assert times.shape == (2,) and np.all(times > 0) and timer.calls == 3
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the backward reached them all


def test_the_step_time_and_the_bound_read_the_candidates_of_an_hstu_fit():
    coef = np.array([1e-3, 0, 1e-6, 1e-9, 0, 0, 0])
    fit = replay.Fit(coef, residuals=np.zeros(1), sequence="uih+candidates")
    lengths = GatheredLengths.from_rank_lengths([np.array([100, 200]), np.array([300])], [[2, 3], [5]])
    plan = Plan.from_destinations(np.array([0, 0, 1]), 2)
    seq = [np.array([102, 203]), np.array([305])]
    np.testing.assert_allclose(replay.ReplayStepTime(fit, seed=0)(lengths, plan), fit.predict(replay.features(seq)))
    costs = replay.ReplayStepTime(fit, seed=0).sample_costs(lengths)
    np.testing.assert_allclose(costs, [1e-6 * s + 1e-9 * s * s for s in (102, 203, 305)])
    uih_only = replay.ReplayStepTime(replay.Fit(coef, residuals=np.zeros(1)), seed=0)  # the softmax model's L
    np.testing.assert_allclose(uih_only(lengths, plan), fit.predict(replay.features([[100, 200], [300]])))


def test_the_memory_probe_counts_the_candidates_as_tokens():
    class Probed(replay.Timer):  # peak = 1 GiB + 10 KiB per packed token, as a CUDA device would report it
        def measure(self, batch, repeats):
            self.calls += 1 + repeats
            self.last_peak_bytes = 2**30 + 10240 * float(self.lengths(batch).sum())
            return np.zeros(repeats)

    timer = Probed(None, torch.device("cuda"), "bf16")  # only the device's type is read
    timer.sequence = "uih+candidates"
    batch = SyntheticSource(SyntheticConfig(num_samples=4, num_candidates_mean=4.0)).read(0, 0, 1)
    guard = replay.MemoryGuard.probe(timer, batch, 1000, limit_gib=2.0, max_pairs=np.inf, kernel="jagged")
    assert guard.fixed_bytes == pytest.approx(2**30) and guard.per_token_bytes == pytest.approx(10240)


def test_direct_mode_times_every_rank_of_the_hstu_model():
    args = parse(
        "--ranks", "2", "--batch-size", "4", "--steps", "1", "--warmup", "0", "--partitioner", "none,kk",
        "--replay-mode", "direct",
    )  # fmt: skip
    records = simulator.run_grid(args, 2, 4, 64)
    assert [r["partitioner"] for r in records] == ["none", "kk"]
    assert all(r["replay_model"] == "hstu" and r["sequence"] == "uih+candidates" for r in records)
    assert all(r["n_timings_sim"] == 2 and r["noise_floor_pct"] >= 0 for r in records)


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--replay-kernel", "padded"), "--replay-kernel padded: --replay-model-preset hstu packs its sequences"),
        (("--replay-attention-impl", "varlen"), "--replay-attention-impl varlen: the HSTU model's are triton, torch"),
        (("--replay-model-preset", "replay", "--replay-head-dim", "8"), "--replay-head-dim is the HSTU model's"),
        (("--replay-model-preset", "tiny", "--replay-attention-impl", "triton"), "the softmax model's are varlen"),
        (("--replay-model-preset", "hstu-small"), r"choose from \[.*'hstu', 'hstu-large'"),
        (("--replay-head-dim", "0"), "HSTUConfig: head_dim must be >= 1"),
    ],
)
def test_flags_the_model_does_not_have_are_refused_in_one_line(argv, message):
    with pytest.raises(ValueError, match=message):
        replay.build_step_time(parse(*argv))
