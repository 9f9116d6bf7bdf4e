"""The run summary's running aggregates (pipelines.job.run.aggregates): exact where a run is short, bounded however long
it runs."""

from __future__ import annotations

import json
import math
import random

import pytest

from pipelines.job.run.aggregates import CURVE_POINTS, WINDOW, Curve, RunAggregates, Window, per_step


def _record(step: int, rng: random.Random) -> dict:
    wait = rng.random() * 1e-3
    return {
        "step": step,
        "loss": 0.7 - step * 1e-5,
        "labels": 32.0,
        "loss_sum": 20.0 + rng.random(),
        "positives": 8.0,
        "samples_per_rank": [16, 16],
        "step_time_s": 0.01 + rng.random() * 1e-3,
        "data_wait_s": 1e-4,
        "data_blocked_s": 0.0,
        "compute_s": [0.008, 0.009],
        "bubble_s": wait + 2e-4,
        "straggler_pct": 5.0,
        "straggler_wait_s": wait,
        "exposed_s": {"data": 1e-4, "dense_allreduce": 1e-4},
        "gc_s": 0.0,
        "balance": {"exchanged": step % 2, "predicted_gain": 0.1},
    }


def test_a_curve_keeps_evenly_spaced_points_and_never_more_than_its_bound():
    curve = Curve(points=8)
    for step in range(8):
        curve.add(step, float(step))
    assert curve.steps == list(range(8)) and curve.stride == 1  # a short run: every step
    for step in range(8, 1000):
        curve.add(step, float(step))
        assert len(curve.steps) <= 8
    assert curve.steps == [curve.stride * i for i in range(len(curve.steps))] and curve.values == curve.steps
    assert curve.steps[-1] + curve.stride > 1000 - 2 * curve.stride  # it still reaches the end of the run


def test_a_window_reads_the_latest_values_and_an_unmeasured_one_makes_it_unknown():
    window = Window(size=4)
    for v in (9.0, 9.0, 1.0, 2.0, 3.0, 4.0):
        window.add(v)
    assert window.median() == 2.0 and window.quantile(0.99) == 4.0  # over 1..4: the first two let go
    window.add(None)
    assert window.median() is None and window.quantile(0.5) is None
    assert math.isnan(Window().median())


def test_the_summary_is_the_same_size_after_a_thousand_steps_as_after_twenty_thousand():
    """Also: each figure is the one computed from the whole list of records, where the run is short."""
    rng = random.Random(0)
    records = [_record(step, rng) for step in range(20_000)]
    short = RunAggregates(10, warmup_steps=2, world_size=2, rank=0)
    for r in records[:10]:
        short.add(r)
    s = short.summary()
    timed = records[2:9]  # warm-up 2, drain 1
    assert s["steps"] == 10 and s["samples"] == 320 and s["balanced_steps"] == 5
    assert s["step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in timed) / 7)
    assert s["step_time_median_s"] == sorted(r["step_time_s"] for r in timed)[3]
    assert s["loss"] == pytest.approx(sum(r["loss_sum"] for r in records[5:10]) / (5 * 32.0))
    assert s["loss_curve"] == [r["loss"] for r in records[:10]] and s["curve_steps"] == list(range(10))
    assert s["per_rank_compute_s"] == pytest.approx([0.008, 0.009]) and s["exposed_s"]["data"] == pytest.approx(1e-4)

    sizes = {}
    for steps in (1_000, 20_000):
        run = RunAggregates(steps, warmup_steps=2, world_size=2, rank=0)
        for r in records[:steps]:
            run.add(r)
        s = run.summary()
        assert len(s["loss_curve"]) <= CURVE_POINTS and s["aggregate_window_steps"] == min(steps - 3, WINDOW)
        assert len(run.step_time.values) <= WINDOW
        sizes[steps] = len(json.dumps(s))
    assert sizes[20_000] <= 1.1 * sizes[1_000], sizes  # the curves hold at most CURVE_POINTS points either way


def test_every_steps_series_is_read_back_from_the_metrics_file():
    rng = random.Random(1)
    lines = [_record(step, rng) for step in range(3)] + [{"step": 3, "eval": {"ne": 0.9}}]
    series = per_step(lines)
    assert series["step_times_s"] == [r["step_time_s"] for r in lines[:3]]
    assert series["exposed_per_step_s"]["data"] == [1e-4] * 3 and series["predicted_gains"] == [0.1] * 3
    assert series["stall_clues_per_step"]["gc_s"] == [0.0] * 3
