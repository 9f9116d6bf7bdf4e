"""The multi-GPU suite's script (argument handling, the plan for any GPU count, --dry-run) and the helpers it
runs that need no GPU: the scaling table, the replay cross-check, bench peer's flag checks."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peer as bench_peer
from benchmarks import scaling

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multi_gpu_suite.sh"


def _suite(
    *args: str, ngpus: str = "8", out: str = "/tmp/fs-multi-gpu-test", **env_extra: str
) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPUS": ngpus, "OUT": out, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "ngpus, counts, transports",
    [
        ("1", [1], []),
        ("2", [1, 2], [2]),
        ("3", [1, 2, 3], [2, 3]),
        ("8", [1, 2, 4, 8], [2, 8]),
        ("16", [1, 2, 4, 8, 16], [2, 16]),
    ],
)
def test_plan_covers_every_gpu_count(ngpus, counts, transports):
    res = _suite("plan", ngpus=ngpus)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("bash ")]
    parts = [line.split()[2:] for line in lines]
    assert parts[0] == ["check"] and parts[-2:] == [["replay"], ["table"]]
    assert [int(p[1]) for p in parts if p[0] == "transport"] == transports
    for case in ("heavy", "light"):
        assert [int(p[1]) for p in parts if p[0] == "scaling" and p[2] == case] == counts


@pytest.mark.parametrize(
    "args, ngpus, message",
    [
        ([], "8", "usage:"),
        (["bogus"], "8", "unknown part 'bogus'"),
        (["scaling", "9", "heavy"], "8", "scaling NPROC=9: this host has 8 GPU(s)"),
        (["scaling", "2", "medium"], "8", "CASE must be heavy or light, got 'medium'"),
        (["scaling", "x", "heavy"], "8", "needs NPROC, a whole number of GPUs"),
        (["scaling", "2"], "8", "scaling takes two arguments"),
        (["transport", "1"], "8", "transport needs 2 to 8"),
        (["transport", "2"], "1", "this host has 1 GPU(s)"),
        (["plan", "extra"], "8", "plan takes no arguments"),
        (["plan"], "abc", "NGPUS must be a whole number"),
        (["plan"], "0", "no GPU found"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, ngpus, message):
    res = _suite("--dry-run", *args, ngpus=ngpus)
    assert res.returncode == 2
    assert message in res.stderr, res.stderr
    assert res.stdout == ""


def _commands(res: subprocess.CompletedProcess) -> list[str]:
    assert res.returncode == 0, res.stderr
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ") and "-m benchmarks" in line]


def test_dry_run_prints_the_commands_without_running_them(tmp_path):
    # the look at what the code offers, for real: peer is not in the registry on this branch
    cmds = _commands(_suite("--dry-run", "transport", "8", out=str(tmp_path)))
    assert any("-m benchmarks transport --device cuda --nproc 8 --backends host,nccl,nccl-ce " in c for c in cmds)
    assert any("-m benchmarks peer --nproc 8" in c and f"{tmp_path}/peer_8.json" in c for c in cmds)
    assert not list(tmp_path.glob("*.json"))  # nothing ran
    cmds = _commands(_suite("--dry-run", "scaling", "4", "light", out=str(tmp_path), SUITE_OFFERS="0 0 0"))
    e2e = next(c for c in cmds if "benchmarks e2e" in c)
    assert "--nproc 4 --cases light --modes sync,sdd,freescale" in e2e and f"{tmp_path}/e2e_light_4.json" in e2e
    assert "--transport" not in e2e


def test_peer_is_used_once_registered():
    cmds = _commands(_suite("--dry-run", "transport", "2", SUITE_OFFERS="1 1 1"))
    assert any("--backends host,nccl,nccl-ce,peer " in c for c in cmds)
    e2e = next(
        c
        for c in _commands(_suite("--dry-run", "scaling", "8", "heavy", SUITE_OFFERS="1 0 1"))
        if "benchmarks e2e" in c
    )
    assert "--transport peer" in e2e
    e2e = next(
        c
        for c in _commands(_suite("--dry-run", "scaling", "8", "heavy", SUITE_OFFERS="1 1 1", E2E_TRANSPORT="nccl"))
        if "benchmarks e2e" in c
    )
    assert "--transport nccl" in e2e


# --- the scaling table and the replay cross-check ------------------------------------------------------------


def _row(case, mode, world, qps, straggler, bubble, repeat=0, reduction=None):
    return {
        "case": case,
        "mode": mode,
        "world_size": world,
        "samples_per_s": qps,
        "straggler_pct": straggler,
        "bubble_ms": bubble,
        "exposed_ms": {"emb_a2a": 1.0, "dense_allreduce": 0.5},
        "bubble_reduction": reduction,
        "repeat": repeat,
    }


def test_scaling_rows_per_gpu_efficiency_and_medians():
    rows = [
        _row("heavy", "sync", 1, 100.0, 0.0, 2.0),
        _row("heavy", "sync", 8, 640.0, 30.0, 20.0),
        _row("heavy", "freescale", 1, 110.0, 0.0, 1.0),
        _row("heavy", "freescale", 8, 800.0, 5.0, 2.0, repeat=0, reduction=0.9),
        _row("heavy", "freescale", 8, 840.0, 7.0, 3.0, repeat=1, reduction=0.8),
        _row("light", "sync", 2, 200.0, 1.0, 1.0),
    ]
    table = {(r["case"], r["mode"], r["gpus"]): r for r in scaling.scaling_rows(rows)}
    assert table[("heavy", "sync", 8)]["samples_per_s_per_gpu"] == 80.0
    assert table[("heavy", "sync", 8)]["scaling_efficiency"] == pytest.approx(0.8)
    fs8 = table[("heavy", "freescale", 8)]
    assert fs8["runs"] == 2 and fs8["samples_per_s_per_gpu"] == pytest.approx(102.5)  # median of 100 and 105
    assert fs8["scaling_efficiency"] == pytest.approx(102.5 / 110.0)
    assert fs8["straggler_pct"] == 6.0 and fs8["bubble_reduction"] == pytest.approx(0.85)
    assert table[("light", "sync", 2)]["scaling_efficiency"] is None  # no 1-GPU run: unknown, not 0
    assert (
        table[("heavy", "sync", 1)]["exposed_ms"]["emb_a2a"] == 1.0
        and table[("heavy", "sync", 1)]["exposed_ms"]["data"] is None
    )


def test_crosscheck_pairs_replay_partitioners_with_modes():
    rows = [
        _row("heavy", "sync", 8, 640.0, 30.0, 20.0),
        _row("heavy", "freescale", 8, 800.0, 5.0, 2.0),
        _row("light", "sync", 8, 1.0, 99.0, 1.0),
    ]
    replay = [
        {"ranks": 8, "partitioner": "none", "straggler_pct": 27.5, "replay_kernel": "padded", "jitter": "repeat"},
        {"ranks": 8, "partitioner": "fbs", "straggler_pct": 4.0, "replay_kernel": "padded", "jitter": "repeat"},
        {"ranks": 8, "partitioner": "kk", "straggler_pct": 3.0},  # no mode ran it
        {"ranks": 64, "partitioner": "none", "straggler_pct": 40.0},  # no 64-GPU run
        {"replay_kernel": "jagged", "error": "fit failed"},
    ]
    checks = scaling.crosscheck(replay, rows)
    assert [(c["partitioner"], c["mode"], c["measured_pct"], c["predicted_pct"]) for c in checks] == [
        ("none", "sync", 30.0, 27.5),
        ("fbs", "freescale", 5.0, 4.0),
    ]
    assert checks[0]["apart_points"] == pytest.approx(2.5)


def test_scaling_main_writes_json_and_refuses_other_files(tmp_path, capsys):
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps([_row("heavy", "sync", 1, 100.0, 0.0, 2.0), _row("heavy", "sync", 2, 190.0, 3.0, 4.0)]))
    out = tmp_path / "scaling.json"
    args = argparse.Namespace(e2e=[str(e2e)], replay=None, partitioner="fbs", json=str(out))
    assert scaling.main(args) == 0
    assert "heavy  sync" in capsys.readouterr().out
    assert json.loads(out.read_text())["scaling"][1]["scaling_efficiency"] == pytest.approx(0.95)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="is not the JSON of `python -m benchmarks e2e`"):
        scaling.load_rows([str(bad)])
    with pytest.raises(ValueError, match="cannot read e2e records"):
        scaling.load_rows([str(tmp_path / "missing.json")])


def test_bench_peer_flag_checks():
    parser = argparse.ArgumentParser()
    bench_peer.add_arguments(parser)
    bench_peer.check_args(parser.parse_args([]))
    for flags, message in (
        (["--sizes", "4M"], "comma-separated byte counts"),
        (["--sizes", "0"], "positive"),
        (["--kernels", "sdpa,conv"], "unknown kernel 'conv'"),
        (["--reps", "0"], "--reps must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            bench_peer.check_args(parser.parse_args(flags))
