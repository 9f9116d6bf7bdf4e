"""`freescale simulate --memory-budget`: each partitioner without and with the budget, per-rank tokens beside the
straggler share, and the budget met by every partitioner that moves samples."""

from __future__ import annotations

import argparse
import io

import pytest

from pipelines.simulate import simulator


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulator.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_partitioner_runs_without_and_with_the_budget_and_the_balancing_ones_meet_it():
    args = parse("--memory-budget", "1.2x", "--steps", "4", "--warmup", "1")
    records = simulator.run_grid(args, 16, 32, 21000)
    assert [(r["partitioner"], r["memory_budget"]) for r in records] == [
        (p, b) for p in ("none", "fbs", "vbs", "kk") for b in (None, "1.2x")
    ]
    by = {(r["partitioner"], r["memory_budget"]): r for r in records}
    assert by["vbs", None]["tokens_max_over_mean"] > 1.5  # what the budget is for
    for name in ("fbs", "vbs", "kk"):
        assert by[name, "1.2x"]["tokens_max_over_budget_worst"] <= 1.0
        assert by[name, "1.2x"]["tokens_max_over_mean_worst"] <= 1.2
    assert by["none", "1.2x"]["straggler_pct"] == by["none", None]["straggler_pct"]  # reported, nothing moved
    table = io.StringIO()
    simulator.print_table(records, out=table)
    assert "tok max/mean" in table.getvalue() and "1.2x" in table.getvalue()


def test_auto_is_refused_by_the_simulator():
    with pytest.raises(ValueError, match="simulator takes a token count or Nx"):
        simulator._validate(parse("--memory-budget", "auto"))
