"""`python -m benchmarks kernels` end to end on CPU with tiny sizes: every row's three implementations agree and
the JSON carries the fields BENCHMARKS.md reads (speedup_vs_eager, speedup_vs_twin, bandwidth)."""

from __future__ import annotations

import argparse
import json

from benchmarks import kernels as bench


def test_bench_runs_on_cpu_and_writes_json(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "kernels.json"
    args = parser.parse_args(
        [
            "--device",
            "cpu",
            "--world-sizes",
            "1,3",
            "--batch-size",
            "4",
            "--uih-median",
            "6",
            "--uih-mean",
            "9",
            "--uih-cap",
            "40",
            "--embedding-dim",
            "4",
            "--reps",
            "1",
            "--eager-reps",
            "1",
            "--ops",
            "indexed_permute/plan,ranged_dispatch,ranged_combine,keyed_transpose,segment_sum,collision_mask",
            "--json",
            str(path),
        ]
    )
    assert bench.main(args) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["world_size"] for r in rows} == {1, 3}
    assert len(rows) == 12 and all(r["agree"] for r in rows)
    assert {"speedup_vs_eager", "speedup_vs_twin", "bandwidth_fraction", "triton_us", "twin_us", "eager_us"} <= set(
        rows[0]
    )


def test_uih_lengths_are_heavy_tailed_and_capped():
    import numpy as np

    lengths = bench.uih_lengths(np.random.default_rng(0), 20000, 3400.0, 5000.0, 21000)
    assert lengths.max() == 21000 and lengths.min() >= 1
    assert 3000 < np.median(lengths) < 3800 and 4400 < lengths.mean() < 5200
