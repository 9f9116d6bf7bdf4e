"""Faults of the launchers' ranks (`freescale bench *`'s local ranks, `freescale train`): one line naming the rank
and the cause, exit status 1, no traceback on the terminal, no shared-memory segment left in /dev/shm, no stray
warning (docs/reliability.md lists every case and its test)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdata.schema import batch_to_table
from fsdata.synthetic import SyntheticConfig, SyntheticSource

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SHM = Path("/dev/shm")


def _segments_of(pids) -> list[str]:
    prefixes = tuple(f"fscomm-{pid}-" for pid in pids)
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefixes)) if SHM.is_dir() else []


def _pids(log_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(log_dir.glob("rank*.pid"))]


def _terminal_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def _bench_args(*argv: str) -> argparse.Namespace:
    from pipelines.research.bench import transport

    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    return parser.parse_args(
        [
            "--device",
            "cpu",
            "--backends",
            "host-shm",
            "--sizes",
            "4096",
            "--reps",
            "2",
            "--no-contention",
            "--timeout",
            "120",
            *argv,
        ]
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("point", ["created", "mapped", "exchange"])
def test_a_bench_rank_killed_at_each_point_of_the_segments_life_leaves_one_line_and_no_segment(
    tmp_path, monkeypatch, capfd, point
):
    from fscomm.shm import FAULT_ENV
    from pipelines.research.bench import launch, transport

    removed = []

    def recording(pids):  # what the launcher removed: the kill did leave segments behind
        removed.extend(launch_remove(pids))
        return removed

    launch_remove = launch.remove_segments_of
    monkeypatch.setattr(launch, "remove_segments_of", recording)
    monkeypatch.setenv(FAULT_ENV, f"{point}:1")
    monkeypatch.setenv("FREESCALE_LOG_DIR", str(tmp_path / "logs"))
    with pytest.raises(SystemExit) as ended:
        transport.main(_bench_args())
    assert ended.value.code == 1
    err = _terminal_lines(capfd.readouterr().err)
    assert len(err) <= 3 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith("freescale bench transport: error: rank 1 died (signal SIGKILL) without an error"), err
    assert removed, "the kill left no segment: the fault point did not run where segments exist"
    pids = _pids(tmp_path / "logs")
    assert len(pids) == 2 and _segments_of(pids) == []


def _rank_1_raises(args, rank, world_size):
    if rank == 1:
        raise ValueError("the bench's input is bad on purpose")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for its peer, which has gone: it fails after it
    return {"rank": rank}


@pytest.mark.multiprocess
def test_a_bench_rank_that_raises_is_one_line_naming_it_with_the_traceback_in_its_log(tmp_path, monkeypatch, capfd):
    from pipelines.research.bench.launch import launch

    monkeypatch.setenv("FREESCALE_LOG_DIR", str(tmp_path / "logs"))
    with pytest.raises(SystemExit) as ended:
        launch(_rank_1_raises, argparse.Namespace(timeout=120, nproc=2), "demo")
    assert ended.value.code == 1
    err = _terminal_lines(capfd.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith("freescale bench demo: error: rank 1: the bench's input is bad on purpose (traceback: "), (
        err
    )
    assert "Traceback" in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.multiprocess
def test_a_train_rank_killed_mid_exchange_leaves_no_segment(tmp_path):
    from fscomm.shm import FAULT_ENV

    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--no-progress",
            "--batch-size",
            "4",
            "--num-samples",
            "64",
            "--steps",
            "4",
            "--log-dir",
            str(log_dir),
        ],
        cwd=tmp_path,
        env={**ENV, FAULT_ENV: "exchange:1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1
    err = _terminal_lines(proc.stderr)
    assert len(err) <= 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[-1].startswith("freescale train: error: rank 1 died"), err
    pids = _pids(log_dir)
    assert len(pids) == 2 and _segments_of(pids) == []


@pytest.mark.multiprocess
def test_a_rank_that_fails_with_its_progress_bar_drawn_leaves_no_stray_warning(tmp_path):
    """A bar's multiprocessing lock, left registered by a rank that ended without clean-up, made the resource
    tracker warn of a "leaked semaphore" at the launcher's exit."""
    n = 64
    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n)).read(0, 0, n)
    batch.uih_item_ids = batch.uih_item_ids.clone()
    batch.uih_item_ids[batch.uih_offsets[25]] = -3  # step 3, rank 0 (the rank that draws the bar)
    pq.write_table(batch_to_table(batch), tmp_path / "late.parquet", row_group_size=4)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--batch-size",
            "4",
            "--steps",
            "6",
            "--data",
            "late.parquet",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1
    assert "rank 0: late.parquet row group 6: sample_id 25" in proc.stderr, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


class _Store:
    def __init__(self, joined):
        self.joined = joined

    def check(self, keys):
        return int(keys[0].rsplit("/", 1)[1]) in self.joined


def test_a_stage_group_whose_peer_closed_its_connection_says_so_and_the_time_that_passed():
    from fscomm.groups import _join_failure

    closed = RuntimeError("Gloo connectFullMesh failed with [...] Connection closed by peer [127.0.0.1]:60571")
    msg = _join_failure("fscomm-default", 0, 2, _Store({0, 1}), 0.04, 1800.0, closed)
    assert msg.startswith(
        "new_stage_group('fscomm-default') on rank 0 of 2: a peer closed its connection after 0.0 s"
    ), msg
    assert "every rank called it" in msg and "within 1800" not in msg and "\n" not in msg
    late = _join_failure("embedding", 0, 2, _Store({0}), 2.0, 2.0, RuntimeError("Timed out"))
    assert "not every rank joined within 2.0 s (the group timeout, run out: waited 2.0 s)" in late
    assert "rank(s) [1] never called it" in late


def _rank_and_world(args, rank, world_size):
    return (rank, world_size)


@pytest.mark.multiprocess
def test_the_bench_launcher_brings_every_ranks_result_back_when_asked():
    from pipelines.research.bench.launch import launch

    assert launch(_rank_and_world, argparse.Namespace(timeout=120, nproc=2), "demo", every_rank=True) == [
        (0, 2),
        (1, 2),
    ]
