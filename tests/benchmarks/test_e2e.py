"""bench e2e's pairing: freescale is compared with sync of the same case and the same run, never across runs; and
its report of the steps that stalled."""

from __future__ import annotations

import pytest

from benchmarks.e2e import losses_against_sync, pair_with_sync, spread, stalled_steps
from pipelines.job.run.accounting import stall_clues as _stall_clues


def _row(case, mode, repeat, bubble, median, qps):
    return {
        "case": case,
        "mode": mode,
        "repeat": repeat,
        "bubble_ms": bubble,
        "bubble_median_ms": median,
        "samples_per_s": qps,
    }


def test_pairs_within_a_run_and_spreads_over_runs():
    rows = [
        _row("light", "sync", 0, 10.0, 8.0, 100.0),
        _row("light", "freescale", 0, 5.0, 2.0, 90.0),
        _row("light", "sync", 1, 20.0, 10.0, 200.0),
        _row("light", "freescale", 1, 4.0, 5.0, 210.0),
        _row("light", "sync", 2, 8.0, 8.0, 100.0),
        _row("light", "freescale", 2, 6.0, 4.0, 100.0),
    ]
    pair_with_sync(rows)
    ours = [r for r in rows if r["mode"] == "freescale"]
    assert [r["bubble_reduction"] for r in ours] == pytest.approx([0.5, 0.8, 0.25])
    assert [r["bubble_reduction_median"] for r in ours] == pytest.approx([0.75, 0.5, 0.5])
    assert all(r["bubble_reduction"] is None for r in rows if r["mode"] == "sync")
    (line,) = spread(rows)
    assert "over 3 runs, bubble_reduction median 50.0% (min 25.0%, max 80.0%)" in line
    assert "samples/s median 1.000 (min 0.900, max 1.050)" in line


def test_no_sync_no_reduction():
    rows = [_row("heavy", "freescale", 0, 5.0, 5.0, 10.0)]
    pair_with_sync(rows)
    assert rows[0]["bubble_reduction"] is None and spread(rows) == []


def test_the_spread_counts_the_schedules_freescale_kept():
    rows = []
    for repeat, choice in enumerate(["sdd", "prioritized", "sdd"]):
        rows += [_row("light", "sync", repeat, 10.0, 10.0, 100.0), _row("light", "freescale", repeat, 5.0, 5.0, 110.0)]
        rows[-1]["embedding_schedule"] = {"choice": choice}
    pair_with_sync(rows)
    (line,) = spread(rows)
    assert line.endswith("embedding schedule kept: prioritized 1x, sdd 2x")


def test_a_stalled_step_is_named_with_the_part_that_absorbed_it_and_its_clues():
    """Steps 2-6 are timed (2 of warm-up, the drain left out). Step 4 stalls in the gradient wait while a relay
    block is allocated; the warm-up's and the drain's slow steps are not reported, nor is one under the floor."""
    history = [{"gc_s": 0.0, "relay_allocations": n, "pinned_allocations": 3} for n in (4, 6, 6, 6, 7, 7, 7, 7)]
    history[4]["gc_s"] = 0.002
    clues = _stall_clues(history)
    assert clues["new_relay_blocks"] == [4, 2, 0, 0, 1, 0, 0, 0] and clues["new_pinned_blocks"] == [3] + [0] * 7
    bubbles = [40.0, 30.0, 1.0, 1.2, 41.0, 1.1, 4.0, 30.0]
    grad = [0.0, 0.0, 0.5, 0.6, 39.0, 0.5, 3.0, 0.0]
    row = {
        "case": "heavy",
        "mode": "freescale",
        "repeat": 1,
        "bubble_median_ms": 1.15,
        "bubbles_ms": bubbles,
        "warmup_steps": 2,
        "drain_steps": 1,
        "stall_clues_per_step": clues,
        "exposed_per_step_ms": {"grad_a2a": grad, "emb_a2a": [0.1] * 8, "dense_allreduce": [None] * 8},
    }
    (line,) = stalled_steps([row])
    assert line == (
        "stalled step: heavy freescale run 2 step 4: bubbles 41.0 ms (run median 1.15), most in grad_a2a; "
        "rank 0: gc 2.0 ms, new relay blocks 1, new pinned blocks 0"
    )
    assert _stall_clues([{"gc_s": 0.0}])["new_pinned_blocks"] is None  # not recorded off a GPU
    assert stalled_steps([dict(row, bubble_median_ms=None)]) == []  # a run without timings (torchrec) says nothing


def test_losses_are_compared_with_sync_of_the_same_run_step_by_step():
    curves = {"sync": [0.7, 0.6], "freescale": [0.7, 0.6], "torchrec-pec": [0.7, 0.625]}
    rows = [dict(_row("light", mode, 0, 1.0, 1.0, 1.0), ne=0.9, loss_curve=c) for mode, c in curves.items()]
    rows.append(dict(_row("light", "torchrec", 1, 1.0, 1.0, 1.0), ne=0.9, loss_curve=[0.0, 0.0]))  # no sync in run 2
    pair_with_sync(rows)
    assert [r["loss_max_diff_vs_sync"] for r in rows] == pytest.approx([0.0, 0.0, 0.025, None])
    (line,) = losses_against_sync(rows)
    assert line == "losses against sync, light (run 1, 2 steps): freescale bit for bit, torchrec-pec max |diff| 2.5e-02"


def test_the_bench_overrides_reach_the_job_config_and_the_defaults_stay():
    import argparse

    from benchmarks.e2e import add_arguments, case_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = case_config("light", "freescale", parser.parse_args([]))
    assert default.loader.background_stages and default.loader.stage_lookahead
    assert default.embeddings.exclusive_start == "forward" and default.embeddings.early_start == "backward"
    changed = case_config(
        "light",
        "freescale",
        parser.parse_args(
            [
                "--loader.no-background-stages",
                "--loader.no-stage-lookahead",
                "--embeddings.exclusive-start",
                "backward",
                "--embeddings.early-start",
                "forward",
            ]
        ),
    )
    assert not changed.loader.background_stages and not changed.loader.stage_lookahead
    assert changed.embeddings.exclusive_start == "backward" and changed.embeddings.early_start == "forward"


def test_the_straggler_shares_of_sync_and_freescale_are_reported_side_by_side():
    from benchmarks.e2e import straggler_shares

    rows = [
        {**_row("heavy", "sync", 0, 1.0, 1.0, 1.0), "straggler_pct": 12.5},
        {
            **_row("heavy", "freescale", 0, 1.0, 1.0, 1.0),
            "straggler_pct": 2.0,
            "attention": "jagged",
            "partitioner": "fbs",
            "balanced_steps": 9,
        },
        {**_row("light", "freescale", 0, 1.0, 1.0, 1.0), "straggler_pct": 1.0},
    ]
    (line,) = straggler_shares(rows)
    assert line == "straggler share, heavy (run 1, jagged attention): sync 12.5%, freescale 2.0% (fbs, moved 9 steps)"
