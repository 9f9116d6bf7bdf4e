"""`freescale simulate --step-model cost`: records, the paper's sanity check, the step-time hook and the sweep plots."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from pipelines.simulate import simulator


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulator.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_records_have_the_agreed_fields_and_balancing_cuts_stragglers(tmp_path):
    out = tmp_path / "sim.json"
    args = parse("--ranks", "8", "--batch-size", "32", "--steps", "6", "--warmup", "2", "--json", str(out))
    assert simulator.main(args) == 0
    records = json.loads(out.read_text())
    assert [r["partitioner"] for r in records] == ["none", "fbs", "vbs", "kk"]
    for r in records:
        for key in (
            "ranks",
            "batch_size",
            "max_uih",
            "partitioner",
            "straggler_pct",
            "imbalance_max_over_mean",
            "lower_bound",
            "samples_per_s",
            "sparsity",
        ):
            assert key in r
        assert r["ranks"] == 8 and r["batch_size"] == 32 and r["max_uih"] == 21000
        assert r["imbalance_max_over_mean"] >= 1.0 and r["lower_bound"] >= 1.0
    by = {r["partitioner"]: r for r in records}
    assert by["fbs"]["straggler_pct"] < by["none"]["straggler_pct"] / 2
    assert by["kk"]["straggler_pct"] < by["none"]["straggler_pct"] / 2
    assert by["vbs"]["sparsity"] < by["none"]["sparsity"] / 4


def test_no_balancing_at_64_ranks_and_21000_max_uih_wastes_over_20_percent():
    """The paper's observation (section 2.2); if this fails, the simulated workload is not realistic."""
    records = simulator.run_grid(parse("--partitioner", "none", "--steps", "20"), 64, 128, 21000)
    assert records[0]["straggler_pct"] > 20.0


def test_a_pluggable_step_time_model_is_used_and_unknown_models_fail(monkeypatch):
    calls = []

    def build(args):
        def step_time(lengths, plan):
            calls.append(plan.world_size)
            return np.ones(plan.world_size)  # perfectly even ranks: no stragglers whatever the plan

        return step_time

    monkeypatch.setitem(simulator.STEP_TIME_MODELS, "flat", build)
    records = simulator.run_grid(
        parse("--step-model", "flat", "--partitioner", "none", "--steps", "3", "--warmup", "0"), 4, 8, 100
    )
    assert calls == [4, 4, 4] and records[0]["straggler_pct"] == 0.0
    with pytest.raises(ValueError, match="unknown --step-model"):
        simulator.build_step_time(parse("--step-model", "nope"))


def test_freescale_simulate_sends_the_replay_model_to_the_benchmarks_in_one_line(capsys, monkeypatch):
    from pipelines.cli import main

    # as installed: no benchmarks.replay imported (a suite that ran its tests first has registered it here)
    monkeypatch.delitem(simulator.STEP_TIME_MODELS, "replay", raising=False)
    assert main(["simulate", "--step-model", "replay", "--steps", "1", "--warmup", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "freescale simulate: error: unknown --step-model 'replay'; choose from ['cost'] (the measured one, replay, runs"
        " from a source checkout: python -m benchmarks replay)"
    ]


def test_padded_kernel_makes_vbs_the_fastest():
    records = simulator.run_grid(parse("--kernel", "padded", "--partitioner", "fbs,vbs", "--steps", "6"), 16, 64, 21000)
    by = {r["partitioner"]: r for r in records}
    assert by["vbs"]["samples_per_s"] > 2 * by["fbs"]["samples_per_s"]


def test_sweep_plots_are_written(tmp_path):
    records = [
        {
            "partitioner": p,
            "sparsity": 0.5,
            "straggler_pct": 10.0 + v % 3,
            "step_model": "cost",
            "steps": 1,
            "ranks": 64,
            "batch_size": 128,
            "max_uih": 21000,
            "sweep": axis,
            axis: v,
        }
        for axis in simulator.SWEEPS
        for v in simulator.SWEEPS[axis][:3]
        for p in ("none", "fbs")
    ]
    paths = simulator.plot_sweeps(records, str(tmp_path))
    assert len(paths) == 3 and all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_parquet_lengths_are_read_capped_and_wrapped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    uih = [[1] * n for n in (3, 50, 7, 1, 20)]
    labels = [[[1.0]] * c for c in (1, 2, 1, 3, 1)]
    pq.write_table(pa.table({"uih_item_ids": uih, "candidate_labels": labels}), tmp_path / "part.parquet")
    source = simulator.ParquetLengths(str(tmp_path), ranks=2, batch_size=2, max_uih=10)
    step0, step1 = source.step(0), source.step(1)
    assert step0.uih_lengths.tolist() == [3, 10, 7, 1] and step0.num_candidates.tolist() == [1, 2, 1, 3]
    assert step1.uih_lengths.tolist() == [10, 3, 10, 7]  # sample 4, then wrapped to 0, 1, 2
    assert step1.rank_offsets.tolist() == [0, 2, 4]


def test_kuairand_27k_simulates_and_fbs_cuts_its_stragglers():
    records = simulator.run_grid(
        parse("--preset", "kuairand-27k", "--partitioner", "none,fbs", "--steps", "4", "--warmup", "1"), 8, 16, 21000
    )
    by = {r["partitioner"]: r for r in records}
    assert by["fbs"]["straggler_pct"] < by["none"]["straggler_pct"]
