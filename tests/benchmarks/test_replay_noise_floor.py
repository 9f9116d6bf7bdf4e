"""The replay's noise floor: the straggler share that the jitter alone gives on a perfectly balanced step, by the
simulator's own definition, printed and recorded beside each partitioner's straggler share."""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest

from benchmarks import replay
from fsdata.partition import GatheredLengths, Plan
from pipelines.simulate import simulator

POOL = np.random.default_rng(3).standard_normal(500) * 0.01  # a fixed 1% jitter pool


def hand_floor(pool: list[float], ranks: int, sync: float = 0.0) -> float:
    """The definition by enumeration: every equally likely draw of one factor per rank, the expected mean idle
    wait over the expected step time (the limit of the simulator's ratio of sums over many steps)."""
    idle, step, n = 0.0, 0.0, 0
    for draw in itertools.product(pool, repeat=ranks):
        busy = np.maximum(1.0 + np.array(draw), 0.0)
        idle += float((busy.max() - busy).mean())
        step += float(busy.max()) + sync
        n += 1
    return 100.0 * idle / step


def test_no_jitter_gives_no_floor():
    rng = np.random.default_rng(0)
    assert replay.noise_floor_pct(np.zeros(7), 64, rng) == 0.0
    assert replay.noise_floor_pct(np.zeros(0), 64, rng) == 0.0  # nothing measured: no floor drawn
    fit = replay.Fit(np.array([1e-3, 0, 1e-6, 0, 0, 0, 0]), residuals=np.zeros(5))
    step_time = replay.ReplayStepTime(fit, seed=0)
    lengths = GatheredLengths.from_rank_lengths([np.array([100, 200]), np.array([300])])
    step_time(lengths, Plan.from_destinations(np.array([0, 0, 1]), 2))
    record = step_time.record()
    assert record["noise_floor_pct"] == 0.0 and record["noise_floor_rel_std"] == 0.0
    assert replay.over_floor({**record, "straggler_pct": 5.0}) is None  # no ratio against a zero floor


def test_the_floor_grows_with_the_rank_count():
    floors = [replay.noise_floor_pct(POOL, w, np.random.default_rng([0, w])) for w in (2, 8, 64, 512)]
    assert all(a < b for a, b in itertools.pairwise(floors)), floors
    assert 0.3 < floors[0] < floors[-1] < 5.0  # of the order of the 1% jitter, a few sigma at most


@pytest.mark.parametrize(
    "pool, ranks, sync",
    [
        ([-0.1, 0.1], 2, 0.0),  # 0.05 / 1.05: half the steps wait 0.2 on one rank of two
        ([-0.1, 0.1], 3, 0.0),
        ([-0.1, 0.1], 2, 0.5),  # the sync time joins every step, as in the simulator
        ([-2.0, 0.0], 2, 0.0),  # a factor below zero is clipped to 0, as the step-time model clips it
    ],
)
def test_the_floor_is_the_hand_computed_definition(pool, ranks, sync):
    floor = replay.noise_floor_pct(np.array(pool), ranks, np.random.default_rng(1), steps=50_000, sync_s=sync)
    assert floor == pytest.approx(hand_floor(pool, ranks, sync), rel=0.02)
    if (pool, ranks, sync) == ([-0.1, 0.1], 2, 0.0):
        assert hand_floor(pool, ranks) == pytest.approx(100 * 0.05 / 1.05)


def test_straggler_pct_is_the_simulators_own():
    """Busy times handed to the simulator give its straggler % exactly: the floor's definition is the same."""
    rng = np.random.default_rng(2)
    busy = 1.0 + 0.1 * rng.random((6, 4))
    steps = iter(busy)
    settings = simulator.SimSettings(ranks=4, batch_size=8, max_uih=64, steps=6, warmup=0, sync_s=0.05)
    source = simulator.LognormalLengths(4, 8, 64, seed=0)
    record = simulator.simulate("none", source, lambda lengths, plan: next(steps), settings)
    assert replay.straggler_pct(busy, sync_s=0.05) == pytest.approx(record["straggler_pct"], rel=1e-12)
    assert replay.straggler_pct(np.array([[1.1, 0.9], [1.0, 1.0]])) == pytest.approx(100 * 0.1 / 2.1)


def test_every_partitioner_at_one_rank_count_reads_against_one_floor():
    fit = replay.Fit(np.array([1e-3, 1e-5, 1e-6, 0, 0, 0, 0]), residuals=POOL, repeats=POOL[:100])
    lengths = GatheredLengths.from_rank_lengths([np.array([100, 200, 50]), np.array([300, 10, 40])])
    records = []
    for dest in ([0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1]):  # two plans, each a fresh step-time model
        step_time = replay.ReplayStepTime(fit, seed=4, jitter="repeat")
        step_time(lengths, Plan.from_destinations(np.array(dest), 2))
        records.append(step_time.record())
    assert records[0]["noise_floor_pct"] == records[1]["noise_floor_pct"] > 0
    expected = replay.floor_record(POOL[:100], 2, 4, 1.0, 0.0, replay.FLOOR_SOURCES["repeat"])
    assert {k: records[0][k] for k in expected} == pytest.approx(expected)  # without sync the busy time cancels
    assert records[0]["noise_floor_rel_std"] == pytest.approx(records[0]["jitter_rel_std"])
    residual = replay.ReplayStepTime(fit, seed=4)
    residual(lengths, Plan.from_destinations(np.zeros(6, dtype=np.int64), 2))
    assert "model error" in residual.record()["noise_floor_source"]


def test_direct_mode_draws_its_floor_from_the_measured_repeats():
    class Measured:  # a _Direct whose every rank takes 2 s and whose repeats deviated by +-5%
        info, deviations = {"replay_mode": "direct"}, [np.array([0.05, -0.05])]
        timer = argparse.Namespace(calls=0)

        def time(self, lengths, idx):
            return 2.0

    step_time = replay.DirectStepTime(Measured(), seed=1, sync_s=0.4)
    lengths = GatheredLengths.from_rank_lengths([np.array([10]), np.array([20]), np.array([30])])
    step_time(lengths, Plan.from_destinations(np.arange(3), 3))
    record = step_time.record()
    expected = replay.floor_record(np.array([0.05, -0.05]), 3, 1, 2.0, 0.4, replay.FLOOR_SOURCES["direct"])
    assert {k: record[k] for k in expected} == pytest.approx(expected)
    assert record["noise_floor_pct"] == pytest.approx(hand_floor([0.05, -0.05], 3, sync=0.4 / 2.0), rel=0.03)


def test_the_replay_table_and_records_show_the_floor(tmp_path, capsys):
    out = tmp_path / "replay.json"
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    argv = "--preset tiny --max-uih 64 --replay-model-preset tiny --replay-dim 8 --replay-heads 2 --replay-layers 1"
    argv += " --replay-ranks 2,16 --batch-size 8 --steps 2 --warmup 1 --replay-timings 12 --replay-timing-ranks 2"
    argv += " --partitioner none,fbs --replay-jitter residual,repeat --seed 5"
    assert replay.main(parser.parse_args([*argv.split(), "--json", str(out)])) == 0
    records = json.loads(out.read_text())
    for r in records:
        assert r["straggler_over_noise_floor"] == pytest.approx(r["straggler_pct"] / r["noise_floor_pct"])
        assert r["noise_floor_rel_std"] == pytest.approx(r["jitter_rel_std"]) and r["noise_floor_steps"] == 4000
    floor = {(r["jitter"], r["ranks"]): r["noise_floor_pct"] for r in records}
    assert len(floor) == 4 and all(floor[(j, 2)] < floor[(j, 16)] for j in ("residual", "repeat"))
    assert all(r["noise_floor_pct"] == floor[(r["jitter"], r["ranks"])] for r in records)  # one per rank count
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["floor%", "x", "floor"]
    for line, r in zip(lines[1:], records):
        assert line.split()[-2:] == [f"{r['noise_floor_pct']:.2f}", f"{r['straggler_over_noise_floor']:.1f}x"]
    residual = [line for line in lines if line.startswith("  jagged/residual jitter, ranks 16")]
    assert len(residual) == 1 and "x floor" in residual[0] and "includes the fit's model error" in residual[0]
