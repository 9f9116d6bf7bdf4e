"""`python -m benchmarks transport` on 2 CPU ranks: both host paths measured in one run, with their ratio; nccl-ce is
not offered."""

from __future__ import annotations

import argparse
import json

import pytest

pytestmark = pytest.mark.multiprocess


def test_bench_transport_reports_tcp_and_shm_side_by_side(tmp_path, capsys):
    from benchmarks import transport

    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    out = tmp_path / "transport.json"
    args = parser.parse_args(
        [
            "--device",
            "cpu",
            "--sizes",
            "4096,65536",
            "--reps",
            "2",
            "--backends",
            "host-tcp,host-shm,nccl-ce",
            "--timeout",
            "60",
            "--json",
            str(out),
        ]
    )
    assert transport.main(args) == 0
    result = json.loads(out.read_text())
    assert result["paths"] == {"host-tcp": "tcp", "host-shm": "shm"}
    assert "withdrawn" in result["skipped"]["nccl-ce"]
    rows = {(r["backend"], r["op"], r["block_bytes"]) for r in result["latency"]}
    assert {
        (b, op, s) for b in ("host-tcp", "host-shm") for op in ("all_to_all", "all_gather") for s in (4096, 65536)
    } <= rows
    assert [r["block_bytes"] for r in result["summary"]] == [4096, 65536]
    assert all(r["shm_over_tcp"] > 0 for r in result["summary"])
    assert "shm/tcp" in capsys.readouterr().out
