"""`python -m benchmarks attention` on CPU with tiny sizes: the records carry the fields the lead merges, the jagged
path agrees with the padded one, and the pair counting of TFLOP/s is the causal jagged one for both paths."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from benchmarks import attention as bench


def test_bench_runs_on_cpu_and_writes_json(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "attention.json"
    args = parser.parse_args(
        [
            "--device",
            "cpu",
            "--cases",
            "3:40",
            "--equal",
            "2:16",
            "--plan-case",
            "4:64",
            "--target-case",
            "3:40:2",
            "--kernels",
            "padded,torch,torch-det",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--uih-median",
            "10",
            "--uih-mean",
            "14",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--plan-reps",
            "1",
            "--json",
            str(path),
        ]
    )
    assert bench.main(args) == 0
    records = json.loads(path.read_text())["records"]
    assert [(r["case"], r["backend"]) for r in records] == [
        ("lognormal", "padded"),
        ("lognormal", "torch"),
        ("lognormal", "torch-det"),
        ("target", "padded"),
        ("target", "torch"),
        ("target", "torch-det"),
        ("equal", "sdpa"),
        ("equal", "torch"),
        ("equal", "torch-det"),
        ("plan", "plan"),
    ]
    fields = {
        "backend",
        "batch_size",
        "cap",
        "tokens",
        "fwd_bwd_ms",
        "speedup_vs_padded",
        "tflops",
        "max_rel_err",
        "needs_plan",
        "repro",
    }
    assert all(fields <= set(r) for r in records)
    kernels = [r for r in records if r["backend"].startswith("torch")]
    assert all(r["max_rel_err"] < 1e-5 and r["repro"] and r["needs_plan"] is False for r in kernels)
    assert records[0]["tokens"] == records[1]["tokens"] and records[6]["tokens"] == 32
    assert not torch.are_deterministic_algorithms_enabled()  # the -det rows restore the process's setting


def test_tflops_count_only_the_causal_pairs():
    lengths = np.array([1, 3])
    assert bench._pairs(lengths) == 1 + 6
    assert bench._tflops(lengths, heads=2, head_dim=4, ms=1e3) == 3.5 * 4 * 4 * 2 * 7 / 1e12


def test_an_unknown_kernel_is_refused_by_name():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match="unknown kernel 'sdpa2' in --kernels"):
        bench.main(parser.parse_args(["--device", "cpu", "--kernels", "padded,sdpa2"]))
