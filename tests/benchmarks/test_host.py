"""`python -m benchmarks host` runs, and its paths dispatch as many torch ops at 16 ranks as at 2."""

from __future__ import annotations

import argparse
import json


def test_bench_host_ops_do_not_grow_with_the_world_size(tmp_path):
    from benchmarks import host

    parser = argparse.ArgumentParser()
    host.add_arguments(parser)
    out = tmp_path / "host.json"
    args = parser.parse_args(["--world-sizes", "2,16", "--batch-size", "8", "--repeats", "2", "--json", str(out)])
    assert host.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    by_path = {}
    for r in rows:
        assert r["ms"] > 0
        by_path.setdefault(r["path"], {})[r["world_size"]] = r["torch_ops"]
    assert set(by_path) == {"balance measures", "stage II unpad", "flags split", "fbs plan"}
    for path, ops in by_path.items():
        assert ops[2] == ops[16], f"{path}: {ops[2]} torch ops at 2 ranks, {ops[16]} at 16"
