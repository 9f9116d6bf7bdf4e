"""bench e2e's pairing: freescale is compared with sync of the same case and the same run, never across runs."""

from __future__ import annotations

import pytest

from pipelines.bench.e2e import pair_with_sync, spread


def _row(case, mode, repeat, bubble, median, qps):
    return {"case": case, "mode": mode, "repeat": repeat, "bubble_ms": bubble, "bubble_median_ms": median,
            "samples_per_s": qps}


def test_pairs_within_a_run_and_spreads_over_runs():
    rows = [
        _row("light", "sync", 0, 10.0, 8.0, 100.0), _row("light", "freescale", 0, 5.0, 2.0, 90.0),
        _row("light", "sync", 1, 20.0, 10.0, 200.0), _row("light", "freescale", 1, 4.0, 5.0, 210.0),
        _row("light", "sync", 2, 8.0, 8.0, 100.0), _row("light", "freescale", 2, 6.0, 4.0, 100.0),
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
