"""`python -m benchmarks multihost`: its table from runs' records (medians of runs, ratios per run and pair), and
one small run on 2 emulated hosts with rate-limited links, which leaves no switch namespace behind."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from benchmarks import multihost
from tests import harness_hosts


def _a2a(host_us: float, tcp_us: float) -> dict:
    rows = [
        {"backend": b, "block_bytes": 1 << 18, "median_us": t} for b, t in (("host", host_us), ("host-tcp", tcp_us))
    ]
    return {"paths": {"host": "shm+tcp", "host-tcp": "tcp"}, "rows": rows}


def test_the_table_gives_medians_of_runs_and_of_each_runs_ratio():
    a2a = [_a2a(1000, 2000), _a2a(3000, 3000), _a2a(2000, 8000)]  # ratios 0.5, 1.0, 0.25: median 0.5
    train = [
        {"transport": "host", "samples_per_s": 100.0, "paths": ["shm+tcp"]},
        {"transport": "host-tcp", "samples_per_s": 50.0, "paths": ["tcp"]},
        {"transport": "host-tcp", "samples_per_s": 100.0, "paths": ["tcp"]},
        {"transport": "host", "samples_per_s": 100.0, "paths": ["shm+tcp"]},
    ]
    rows = multihost.summarize(a2a, train, world=4)
    assert rows[0]["bytes_per_rank"] == 1 << 20  # the size is what a rank sends in total: 4 blocks
    assert (rows[0]["host_ms"], rows[0]["host-tcp_ms"], rows[0]["mixed_over_tcp_time"]) == (2.0, 3.0, 0.5)
    assert rows[0]["paths"] == {"host": ["shm+tcp"], "host-tcp": ["tcp"]}
    assert rows[1]["mixed_over_tcp_samples"] == 1.5 and rows[1]["host-tcp_samples_per_s"] == 75.0
    text = multihost.table({"layouts": [{"layout": "2x2", "rate": "1gbit", "rows": rows}]})
    assert "| 2x2 | 1gbit | all_to_all 1 MiB: ms (GB/s) | 2.00 (0.524) | 3.00 (0.350) | 0.50x time |" in text
    assert "| 2x2 | 1gbit | e2e samples/s | 100 | 75 | 1.50x samples/s |" in text


def test_a_bad_layout_is_one_line():
    with pytest.raises(ValueError, match=r"--layouts: HOSTSxRANKS such as 2x2, got '2by2'"):
        multihost.parse_layout("2by2")


@pytest.mark.multiprocess
def test_a_small_run_on_two_hosts_measures_both_variants_and_removes_its_network(tmp_path):
    problem = harness_hosts.network_problem()
    if problem:
        pytest.skip(problem)
    parser = argparse.ArgumentParser()
    multihost.add_arguments(parser)
    out = tmp_path / "multihost.json"
    argv = ["--layouts", "2x1", "--sizes", "65536", "--a2a-runs", "1", "--a2a-reps", "2", "--train-runs", "1"]
    args = parser.parse_args([*argv, "--steps", "3", "--warmup-steps", "1", "--timeout", "120", "--json", str(out)])
    assert multihost.main(args) == 0
    (block,) = json.loads(out.read_text())["layouts"]
    a2a, e2e = block["rows"]
    assert a2a["paths"] == {"host": ["tcp"], "host-tcp": ["tcp"]}  # one rank per host: no pair shares a host
    assert a2a["bytes_per_rank"] == 65536 and a2a["host_ms"] > 0 and a2a["host-tcp_ms"] > 0
    assert e2e["paths"] == {"host": ["tcp"], "host-tcp": ["tcp"]} and e2e["host_samples_per_s"] > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in listed.split() if n.startswith(f"fs-switch-{os.getpid()}-")]
