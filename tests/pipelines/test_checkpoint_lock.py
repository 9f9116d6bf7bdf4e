"""One job per checkpoint folder (pipelines.job.checkpoint.lock): a second job is refused in one line naming the
folder and the holder, under `freescale train` before its ranks start and under torchrun at rank 0; a holder killed
with SIGKILL leaves no lock behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipelines.job.checkpoint import checkpointer as checkpoint
from pipelines.job.checkpoint import lock as checkpoint_lock
from tests.harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
_HOLD = (
    "import sys, time\nfrom pipelines.job.checkpoint import lock as checkpoint_lock\n"
    "checkpoint_lock.hold(sys.argv[1], sys.argv[2])\n"
)


def _holder(folder: Path, role: str) -> subprocess.Popen:
    """Another process that holds ``folder`` for ``role`` until it is killed."""
    script = _HOLD + "print('held', flush=True)\ntime.sleep(600)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(folder), role], env=ENV, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _gone(pid: int) -> bool:
    """Every thread of ``pid`` has exited (its files, and so its locks, are closed once the last one has; a zombie
    waiting to be reaped holds none)."""
    try:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:
        return True
    return all(state in ("Z", "X") for state in states)


def _wait_gone(*pids: int) -> None:
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} still alive after SIGKILL"
        time.sleep(0.05)


@pytest.mark.parametrize("holder_role", ["rank 0", "launcher"])
def test_a_second_job_is_refused_naming_the_folder_and_holder_and_kill_9_leaves_no_stale_lock(tmp_path, holder_role):
    folder = tmp_path / "ck"
    holder = _holder(folder, holder_role)
    lock_file = folder / {"rank 0": checkpoint_lock.RANK0_FILE, "launcher": checkpoint_lock.LAUNCHER_FILE}[holder_role]
    record = json.loads(lock_file.read_text())
    assert (record["role"], record["pid"], record["host"]) == (holder_role, holder.pid, socket.gethostname())
    expected = (
        f"--checkpoint-dir {folder}: another job uses it ({holder_role} on host {socket.gethostname()}, pid "
        f"{holder.pid}, since {record['started']}; lock file {lock_file}): two jobs would replace each other's steps; "
        "give this job another --checkpoint-dir, or end that job"
    )
    try:
        for role in ("launcher", "rank 0"):  # whichever role each job holds it by
            with pytest.raises(ValueError) as refused:
                checkpoint_lock.hold(folder, role)
            assert str(refused.value) == expected
        with pytest.raises(checkpoint.CheckpointError) as refused:  # a job's rank 0, as under torchrun
            checkpoint.Checkpointer(folder, 0, 1)
        assert str(refused.value) == expected
    finally:
        holder.kill()
        holder.wait()
    _wait_gone(holder.pid)
    saver = checkpoint.Checkpointer(folder, 0, 1)  # the OS let go of the lock with the process
    assert json.loads((folder / checkpoint_lock.RANK0_FILE).read_text())["pid"] == os.getpid()
    model = torch.nn.Linear(2, 1)
    saver.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, {"epoch": 0, "cursor": 0})
    assert checkpoint.complete_steps(folder) == [folder / "step_000001"]  # the lock files are no step


def test_a_file_system_without_locks_goes_on_with_a_warning(tmp_path, monkeypatch, capsys):
    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(checkpoint_lock.fcntl, "flock", unsupported)
    checkpoint_lock.hold(tmp_path / "ck", "launcher")
    assert capsys.readouterr().err == (
        f"[freescale] warning: --checkpoint-dir {tmp_path / 'ck'}: its file system does not lock files (No locks "
        "available): a second job using this folder would not be refused\n"
    )


def _torchrun_ranks(rank, world_size, root):
    """Ranks without a launcher of ours: rank 0 holds the folder; a process of another job (here rank 1, another
    process on the host) is refused whichever role it asks for."""
    checkpoint.Checkpointer(root, rank, world_size)
    torch.distributed.barrier()
    refused = []
    if rank == 1:
        for role in ("rank 0", "launcher"):
            try:
                checkpoint_lock.hold(root, role)
            except ValueError as e:
                refused.append(str(e))
    torch.distributed.barrier()
    return os.getpid(), refused


@pytest.mark.multiprocess
def test_rank_0_holds_the_folder_without_a_launcher_of_ours(tmp_path):
    (rank0_pid, _), (_, refused) = run_ranks(_torchrun_ranks, 2, args=(tmp_path / "ck",), timeout=90)
    assert len(refused) == 2, refused
    for line in refused:
        assert line.startswith(f"--checkpoint-dir {tmp_path / 'ck'}: another job uses it (rank 0 on host ")
        assert f"pid {rank0_pid}," in line and checkpoint_lock.RANK0_FILE in line


def _train_cmd(*argv: str) -> list[str]:
    return [
        sys.executable, "-m", "pipelines.cli", "train", "--nproc", "2", "--device", "cpu", "--no-progress",
        "--batch-size", "4", "--mode", "replicated", "--partitioner", "none", "--checkpoint-dir", "ck", *argv,
    ]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_second_freescale_train_on_the_same_folder_is_refused_before_its_ranks_start(tmp_path):
    metrics, logs = tmp_path / "m.jsonl", tmp_path / "logs"
    first = subprocess.Popen(
        _train_cmd("--steps", "100000", "--log-dir", str(logs), "--metrics-jsonl", str(metrics)),
        cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and first.poll() is None, "the first job did not start training"
            time.sleep(0.2)
        second = subprocess.run(
            _train_cmd("--steps", "4", "--log-dir", str(tmp_path / "logs2")),
            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        lines = [line for line in second.stderr.splitlines() if "error" in line]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert lines[0].startswith(
            f"freescale train: error: --checkpoint-dir ck: another job uses it (launcher on host "
            f"{socket.gethostname()}, pid {first.pid}, since "
        ), lines[0]
        assert not (tmp_path / "logs2").exists()  # refused before any rank started
        ranks = [int(p.read_text()) for p in logs.glob("rank*.pid")]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    for pid in ranks:  # its ranks, left without their launcher, go the same way
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(*ranks)
    checkpoint_lock.hold(tmp_path / "ck", "launcher")  # nothing stale: a third job takes the folder
    print(lines[0])  # shown with -s: the line a user sees
