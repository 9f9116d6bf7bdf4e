"""Faults of the launchers' ranks (`python -m benchmarks *`'s local ranks, `freescale train`): one line naming the rank
and the cause, exit status 1, no traceback on the terminal, no shared-memory segment left in /dev/shm, no stray
warning (docs/reliability.md lists every case and its test)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
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
    from benchmarks import transport

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
    from benchmarks import launch, transport
    from fscomm.shm import FAULT_ENV

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
    assert err[-1].startswith("benchmarks transport: error: rank 1 died (signal SIGKILL) without an error"), err
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
    from benchmarks.launch import launch

    monkeypatch.setenv("FREESCALE_LOG_DIR", str(tmp_path / "logs"))
    with pytest.raises(SystemExit) as ended:
        launch(_rank_1_raises, argparse.Namespace(timeout=120, nproc=2), "demo")
    assert ended.value.code == 1
    err = _terminal_lines(capfd.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith("benchmarks demo: error: rank 1: the bench's input is bad on purpose (traceback: "), err
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


def test_a_thread_group_whose_peer_closed_its_connection_says_so_and_the_time_that_passed():
    from fscomm.groups import _join_failure

    closed = RuntimeError("Gloo connectFullMesh failed with [...] Connection closed by peer [127.0.0.1]:60571")
    msg = _join_failure("fscomm-default", 0, 2, _Store({0, 1}), 0.04, 1800.0, closed)
    assert msg.startswith(
        "new_thread_group('fscomm-default') on rank 0 of 2: a peer closed its connection after 0.0 s"
    ), msg
    assert "every rank called it" in msg and "within 1800" not in msg and "\n" not in msg
    late = _join_failure("embedding", 0, 2, _Store({0}), 2.0, 2.0, RuntimeError("Timed out"))
    assert "not every rank joined within 2.0 s (the group timeout, run out: waited 2.0 s)" in late
    assert "rank(s) [1] never called it" in late


def _rank_and_world(args, rank, world_size):
    return (rank, world_size)


@pytest.mark.multiprocess
def test_the_bench_launcher_brings_every_ranks_result_back_when_asked():
    from benchmarks.launch import launch

    assert launch(_rank_and_world, argparse.Namespace(timeout=120, nproc=2), "demo", every_rank=True) == [
        (0, 2),
        (1, 2),
    ]


# --- signals: one line, 128 + the signal, nothing left behind -------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The launcher's child processes (its ranks, multiprocessing's resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _wait_for(path: Path, proc: subprocess.Popen, lines: int) -> None:
    """Until ``path`` holds ``lines`` lines: the job has made progress. Bounded, and never a fixed sleep."""
    deadline = time.monotonic() + 180
    while not (path.exists() and len(path.read_text().splitlines()) >= lines):
        assert proc.poll() is None, f"the job ended before {path.name}: {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} within 180 s"
        time.sleep(0.2)


def _train(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "pipelines.cli", "train", "--nproc", "2", "--device", "cpu", "--no-progress"),
        *("--batch-size", "4", "--num-samples", "100000", *extra),
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sig, to, checkpoints",
    [
        (signal.SIGTERM, "launcher", True),  # a job manager's stop
        (signal.SIGINT, "group", True),  # Ctrl-C: every process of the group gets it at once
        (signal.SIGINT, "launcher", False),
        (signal.SIGTERM, "group", False),
    ],
)
def test_a_signal_ends_the_job_in_one_line_with_its_step_and_checkpoint_leaving_nothing_behind(
    tmp_path, sig, to, checkpoints
):
    tmp = tmp_path / "tmp"  # the job's TMPDIR: its temporary log folder must not stay
    tmp.mkdir()
    progress = ("--checkpoint-dir", "ck", "--checkpoint-every", "2") if checkpoints else ("--metrics-jsonl", "m.jsonl")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            _train(tmp_path, "--steps", "100000", *progress),
            cwd=tmp_path,
            env={**ENV, "TMPDIR": str(tmp)},
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, as a shell gives a job
        )
        try:
            # progress: a complete checkpoint of step 4 (its marker is one line), or the metrics of 3 steps
            if checkpoints:
                _wait_for(tmp_path / "ck" / "step_000004" / "COMPLETE", proc, 1)
            else:
                _wait_for(tmp_path / "m.jsonl", proc, 3)
            pids = _children(proc.pid)
            (os.killpg if to == "group" else os.kill)(proc.pid, sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = (tmp_path / "err").read_text()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    lines = _terminal_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    clause = r"last complete checkpoint step (\d+)" if checkpoints else "no checkpoint"
    match = re.fullmatch(rf"freescale train: interrupted \({sig.name}\) at step (\d+); {clause}", lines[0])
    assert match, lines[0]
    print(lines[0])  # shown with -s: the line a user sees
    assert len(pids) >= 2 and _segments_of(pids) == []
    assert [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")] == []  # torch's own cache may stay
    if not checkpoints:
        return
    step, saved = int(match.group(1)), int(match.group(2))
    assert step >= saved >= 4
    resumed = subprocess.run(
        _train(tmp_path, "--steps", str(saved + 2), "--checkpoint-dir", "ck", "--resume", "latest"),
        cwd=tmp_path,
        env={**ENV, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from ck/step_{saved:06d} at step {saved}" in resumed.stdout, resumed.stdout[-3000:]


def _spawned_ranks(pid: int) -> list[int]:
    """The launcher's rank processes that multiprocessing has spawned (its resource tracker left out)."""
    found = []
    for child in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:  # it has ended since
            continue
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig, to", [(signal.SIGINT, "group"), (signal.SIGTERM, "launcher")])
def test_a_signal_while_the_ranks_set_up_is_one_line_and_ends_the_job_in_seconds(tmp_path, sig, to):
    """While the ranks import torch (seconds), Ctrl-C gave each rank's KeyboardInterrupt traceback (80 lines), and
    the launcher waited 30 s for a rank that had not taken the signal."""
    log_dir = tmp_path / "logs"
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            _train(tmp_path, "--steps", "100000", "--log-dir", str(log_dir)),
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not (ranks := _spawned_ranks(proc.pid)):  # just spawned: they import torch for a second or more
                assert proc.poll() is None and time.monotonic() < deadline, "no rank was seen setting up"
                time.sleep(0.02)
            (os.killpg if to == "group" else os.kill)(proc.pid, sig)
            sent = time.monotonic()
            proc.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = (tmp_path / "err").read_text()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    lines = _terminal_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.fullmatch(rf"freescale train: interrupted \({sig.name}\) during set-up; no checkpoint", lines[0]), lines
    assert took < 15, took  # 1-3 s on a quiet machine: a rank that has not taken the signal is killed after 2 s
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]  # no rank outlives the launcher


def test_a_stop_signal_while_the_agent_spawns_a_rank_is_taken_again_after_it(monkeypatch):
    """Raised in the middle of a spawn, the launcher's signal left a rank half started (its EOFError traceback)."""
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from pipelines.job.launch.signals import raise_signal

    sent = threading.Event()
    monkeypatch.setattr(
        os, "kill", lambda pid, sig: sent.set() if (pid, sig) == (os.getpid(), signal.SIGTERM) else None
    )
    spawning: dict = {}  # a function of torch's name and file, calling the handler as Python would inside it
    exec(
        compile(
            "def start_processes(f, sig, sys):\n    f(sig, sys._getframe())\n", "torch/multiprocessing/spawn.py", "exec"
        ),
        spawning,
    )
    spawning["start_processes"](raise_signal, signal.SIGTERM, sys)  # returns: the signal is sent again
    assert sent.wait(timeout=10)
    with pytest.raises(SignalException):
        raise_signal(signal.SIGTERM, sys._getframe())


def test_ctrl_c_while_the_command_loads_is_one_line(monkeypatch, capsys):
    import pipelines.cli as cli

    def loading(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", loading)
    assert cli.main(["train", "--nproc", "2"]) == 130
    assert capsys.readouterr().err == "freescale train: interrupted (SIGINT)\n"
    assert cli.main(["data", "stats", "x.parquet"]) == 130
    assert capsys.readouterr().err == "freescale data stats: interrupted (SIGINT)\n"


def test_sigterm_while_the_command_loads_is_one_line(monkeypatch, capsys):
    """SIGTERM before the launcher takes the stop signals (the command still importing torch): one line and 143,
    not a silent -15."""
    import pipelines.cli as cli

    def loading(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises inside the sleep
        raise AssertionError("SIGTERM did not end the loading")

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "build_parser", loading)
    try:
        assert cli.main(["train", "--nproc", "2"]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err == "freescale train: interrupted (SIGTERM)\n"


def _report(log_dir: Path, rank: int, sig: str, step) -> None:
    (log_dir / f"rank{rank}.interrupted").write_text(json.dumps({"rank": rank, "signal": sig, "step": step}))


def test_an_interruption_names_the_signal_the_step_every_rank_completed_and_the_newest_complete_checkpoint(tmp_path):
    from types import SimpleNamespace

    from pipelines.job.launch.signals import interruption

    (tmp_path / "ck" / "step_000006").mkdir(parents=True)
    (tmp_path / "ck" / "step_000006" / "COMPLETE").write_text("2 dcp\n")
    (tmp_path / "ck" / "step_000008").mkdir()  # a save the signal cut short: no marker, not resumed
    config = SimpleNamespace(run=SimpleNamespace(nproc=2), checkpoint=SimpleNamespace(dir=str(tmp_path / "ck")))
    logs = tmp_path / "logs"
    logs.mkdir()
    _report(logs, 0, "SIGTERM", 8)
    _report(logs, 1, "SIGTERM", 7)  # a step behind: step 8 is not complete on every rank
    through_launcher = interruption(logs, config, signum=signal.SIGTERM)
    assert str(through_launcher) == "interrupted (SIGTERM) at step 7; last complete checkpoint step 6"
    assert through_launcher.signum == signal.SIGTERM and list(logs.iterdir()) == []  # the reports are read once
    # sent to rank 1 alone: the launcher saw it end first (128 + SIGTERM), then stopped rank 0 with its SIGTERM
    _report(logs, 1, "SIGTERM", 7)
    _report(logs, 0, "SIGTERM", 8)
    alone = interruption(logs, config, exitcodes={1: 128 + signal.SIGTERM})
    assert str(alone) == "interrupted (SIGTERM to rank(s) [1]) at step 7; last complete checkpoint step 6"
    # rank 1 failed (exit 1); rank 0 reports only the SIGTERM that stopped it after: a failure, not an interruption
    _report(logs, 0, "SIGTERM", 8)
    assert interruption(logs, config, exitcodes={1: 1}) is None
    _report(logs, 0, "SIGINT", None)  # before its trainer was built (set-up, a restore)
    _report(logs, 1, "SIGINT", None)
    none = SimpleNamespace(run=SimpleNamespace(nproc=2), checkpoint=SimpleNamespace(dir=None))
    both = {0: 128 + signal.SIGINT, 1: 128 + signal.SIGINT}
    assert str(interruption(logs, none, exitcodes=both)) == "interrupted (SIGINT) during set-up; no checkpoint"


def test_the_launchers_temporary_folder_stays_only_with_a_ranks_log(tmp_path):
    from pipelines.job.launch.log_dirs import tidy

    def folder(name, *files):
        (tmp_path / name / "torchelastic" / "run" / "attempt_0").mkdir(parents=True)
        for f in files:
            (tmp_path / name / f).write_text("x")
        return tmp_path / name

    # made here: a clean run, or a failure or signal that left only pid files, leaves nothing
    assert not tidy(folder("clean", "rank0.pid", "rank0.log"), made_here=True, clean=True)
    assert not tidy(folder("pids", "rank0.pid", "rank1.pid"), made_here=True, clean=False)
    assert not (tmp_path / "clean").exists() and not (tmp_path / "pids").exists()
    # made here, a rank's log: it stays, pid files beside it (the line names the folder), and no later launcher's
    # clean-up takes it (its marker goes)
    assert tidy(folder("logs", "rank0.pid", "rank1.pid", "rank0.log", "launcher.pid"), made_here=True, clean=False)
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"rank0.pid", "rank1.pid", "rank0.log", "torchelastic"}
    # the user's --log-dir: never removed, its pid files go after a clean run only
    assert not tidy(folder("mine", "rank0.pid", "rank0.log"), made_here=False, clean=False)
    assert {p.name for p in (tmp_path / "mine").glob("rank*")} == {"rank0.pid", "rank0.log"}
    assert not tidy(tmp_path / "mine", made_here=False, clean=True)
    assert {p.name for p in (tmp_path / "mine").glob("rank*")} == {"rank0.log"}


def test_a_killed_launchers_temporary_folder_goes_at_the_next_start_on_its_host(tmp_path):
    """A launcher killed outright (its host lost, kill -9) could not tidy its folder; a folder it kept for a failed
    rank's log (no marker), another host's, or one whose launcher or ranks still run, stays."""
    import socket

    from pipelines.job.launch import log_dirs

    host = socket.gethostname()
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    me = f"{os.getpid()} {log_dirs._start_time(os.getpid())}"

    def folder(name, marker=None, rank_pid=None):
        path = tmp_path / f"freescale-{name}"
        path.mkdir()
        (path / "rank0.log").write_text("x")
        if marker is not None:
            (path / "launcher.pid").write_text(marker + "\n")
        if rank_pid is not None:
            (path / "rank0.pid").write_text(f"{rank_pid}\n")
        return path

    killed = folder("killed", f"{host} {dead} 1", rank_pid=dead)
    reused = folder("reused", f"{host} {os.getpid()} 1")  # its launcher's id is this process's now
    folder("running", f"{host} {me}")
    folder("elsewhere", f"another-host {dead} 1")
    folder("kept")  # a failed job's, named by its line: no marker
    folder("ranks-left", f"{host} {dead} 1", rank_pid=os.getpid())
    assert sorted(log_dirs.remove_stale(tmp_path)) == sorted([killed, reused])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "freescale-elsewhere",
        "freescale-kept",
        "freescale-ranks-left",
        "freescale-running",
    ]


@pytest.mark.multiprocess
def test_the_bench_launchers_folder_goes_unless_it_holds_a_failed_ranks_log(tmp_path, monkeypatch, capfd):
    import tempfile

    from benchmarks.launch import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("FREESCALE_LOG_DIR", raising=False)
    assert launch(_rank_and_world, argparse.Namespace(timeout=120, nproc=2), "demo") == [0, 2]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        launch(_rank_1_raises, argparse.Namespace(timeout=120, nproc=2), "demo")
    [kept] = tmp_path.iterdir()
    assert [p.name for p in kept.iterdir()] == ["logs"]  # its store and results gone, the ranks' logs kept
    err = _terminal_lines(capfd.readouterr().err)
    assert len(err) == 1 and f"(traceback: {kept / 'logs' / 'rank1.log'})" in err[0], err


def test_the_launchers_unraisable_hook_drops_only_the_agents_thread_joining_itself():
    """A signal can leave torch's rendezvous keep-alive thread to run its own joining finalizer, which printed
    'Exception ignored ... cannot join current thread' beside the one line; any other report still reaches the hook."""
    from types import SimpleNamespace

    from pipelines.job.launch.launcher import without_agent_thread_join

    seen = []
    hook = without_agent_thread_join(seen.append)
    assert without_agent_thread_join(hook) is hook  # installed once per process, however many launches
    hook(SimpleNamespace(exc_value=RuntimeError("cannot join current thread")))
    other = SimpleNamespace(exc_value=RuntimeError("something else"))
    hook(other)
    assert seen == [other]
