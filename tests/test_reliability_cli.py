"""Faults at the command line end in one line naming the rank and cause, with a non-zero exit, within the
communication timeout plus a few seconds (docs/reliability.md lists every case and its test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdata.schema import batch_to_table, write_parquet
from fsdata.synthetic import SyntheticConfig, SyntheticSource

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
FAST = ["--nproc", "2", "--device", "cpu", "--no-progress", "--batch-size", "4", "--num-samples", "64"]


def freescale(tmp_path, *argv, timeout=120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", *argv]
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)


def cli(tmp_path, capsys, *argv) -> subprocess.CompletedProcess:
    """`freescale ...` in this process, for errors raised before any rank starts (a subprocess costs seconds)."""
    from pipelines.cli import main

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(list(argv))
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error" in line.lower()]


def one_line_error(proc, *fragments) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def synth(n=64):
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n)).read(0, 0, n)


@pytest.mark.multiprocess
def test_rank_error_is_one_line_naming_rank_and_cause_with_a_traceback_log(tmp_path):
    batch = synth()
    batch.uih_item_ids = batch.uih_item_ids.clone()
    batch.uih_item_ids[batch.uih_offsets[5]] = -3  # sample 5: on rank 1 (batch size 4 per rank)
    pq.write_table(batch_to_table(batch), tmp_path / "bad.parquet", row_group_size=4)  # row group 1: rank 1 only
    proc = freescale(tmp_path, "train", *FAST, "--data", "bad.parquet", "--log-dir", "logs")
    line = one_line_error(
        proc,
        "freescale train: error: rank 1:",
        "bad.parquet row group 1",
        "sample_id 5",
        "negative id -3 in uih_item_ids",
        "traceback: ",
    )
    log = Path(line.split("traceback: ")[1].split(")")[0])
    assert log.is_file() and "Traceback" in log.read_text()


def test_a_ranks_report_is_one_line_with_its_traceback_in_the_log_and_under_verbose(tmp_path, capsys):
    """What a failing rank leaves for the launcher (in process: a launch costs seconds)."""
    from pipelines.job.failure_report import report_failure

    try:
        raise ValueError("nan.parquet row group 1: sample_id 5 (row 1): non-finite value nan in column 'dense'")
    except ValueError as exc:
        line = report_failure(exc, 1, verbose=True, log_dir=str(tmp_path))
    assert line == (
        f"rank 1: nan.parquet row group 1: sample_id 5 (row 1): non-finite value nan in column 'dense' "
        f"(traceback: {tmp_path / 'rank1.log'})"
    )
    assert "Traceback" in capsys.readouterr().err and "Traceback" in (tmp_path / "rank1.log").read_text()
    report = json.loads((tmp_path / "rank1.error").read_text())
    assert report == {"rank": 1, "line": line, "root": True}


def test_corrupt_parquet_is_one_line_before_any_rank_starts(tmp_path, capsys):
    good = tmp_path / "data" / "a.parquet"
    good.parent.mkdir()
    write_parquet(synth(), str(good), row_group_size=16)
    (tmp_path / "data" / "b.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # cut mid-file
    proc = cli(tmp_path, capsys, "train", *FAST, "--data", "data")
    one_line_error(proc, "freescale train: error:", "b.parquet: not a readable Parquet file")


def _unsafe_checkpoint(directory: Path, marker: Path) -> None:
    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    directory.mkdir(parents=True)
    import torch

    torch.save({"world_size": 1, "model": {}, "payload": RunsCode()}, directory / "rank0.pt")
    (directory / "COMPLETE").write_text("1\n")


def test_a_checkpoint_carrying_a_pickled_callable_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    _unsafe_checkpoint(tmp_path / "ck" / "step_000001", marker)
    proc = cli(tmp_path, capsys, "train", *FAST, "--resume", str(tmp_path / "ck" / "step_000001"))
    one_line_error(proc, "rank0.pt: refused: it holds objects other than tensors and plain data")
    assert not marker.exists()
    from pipelines.job.checkpoint import checkpointer as checkpoint

    with pytest.raises(ValueError, match="refused"):  # and every load of the library path refuses it too
        checkpoint.load(tmp_path / "ck" / "step_000001", 0, 1)
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage, match",
    [
        ("missing", "does not exist"),
        ("no-marker", "no COMPLETE marker: the save was interrupted"),
        ("lacks-rank", "is incomplete: it lacks rank1.pt"),
        ("truncated", "rank0.pt: not a readable checkpoint file"),
    ],
)
def test_an_explicit_checkpoint_that_is_missing_or_incomplete_is_one_line(tmp_path, capsys, damage, match):
    import torch

    step = tmp_path / "ck" / "step_000002"
    if damage != "missing":
        step.mkdir(parents=True)
        torch.save({"world_size": 2, "model": {}}, step / "rank0.pt")
        torch.save({"world_size": 2, "model": {}}, step / "rank1.pt")
        (step / "COMPLETE").write_text("2\n")
        if damage == "no-marker":  # an interrupted save: the marker is written last
            (step / "COMPLETE").unlink()
            (step / "rank1.tmp").write_bytes(b"half a file")
        elif damage == "lacks-rank":
            (step / "rank1.pt").unlink()
        elif damage == "truncated":
            data = (step / "rank0.pt").read_bytes()
            (step / "rank0.pt").write_bytes(data[: len(data) // 2])
    proc = cli(tmp_path, capsys, "train", *FAST, "--resume", str(step))
    one_line_error(proc, match)


def test_unknown_partitioner_is_one_line_before_ranks_start(tmp_path, capsys):
    proc = cli(tmp_path, capsys, "train", *FAST, "--partitioner", "nosuch")
    one_line_error(proc, "freescale train: error:", "nosuch")


def _rank_pids(log_dir: Path) -> dict[int, int]:
    """The launched ranks' process ids, which each rank leaves in the log directory."""
    return {int(p.stem[4:]): int(p.read_text()) for p in log_dir.glob("rank*.pid")}


def _start_long_job(tmp_path, *extra):
    """`freescale train` of many steps under a 3 s communication timeout, once it has trained a few steps."""
    log_dir = tmp_path / "logs"
    metrics = tmp_path / "m.jsonl"
    cmd = [
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
        "--steps",
        "100000",
        "--mode",
        "replicated",
        "--partitioner",
        "none",
        "--comm-timeout-s",
        "3",
        "--log-dir",
        str(log_dir),
        "--metrics-jsonl",
        str(metrics),
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not start training"
        time.sleep(0.2)
    pids = _rank_pids(log_dir)
    assert sorted(pids) == [0, 1]
    return proc, pids, log_dir


@pytest.mark.multiprocess
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    proc, pids, log_dir = _start_long_job(tmp_path)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while not (log_dir / "rank0.error").exists():
            assert time.monotonic() - stopped < 3 + 8, "rank 0 still waits past the timeout"
            time.sleep(0.1)
        waited = time.monotonic() - stopped
        # rank 0 does not wait for its loader's item in flight after the timeout, and a stopped process takes no
        # SIGTERM: the launcher kills it itself, 2 s after the error (not torch's 30 s)
        _, err = proc.communicate(timeout=25)
        ended = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.kill(pids[1], signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 1 and ended < waited + 2 + 3, (waited, ended)
    line = [x for x in err.splitlines() if "error" in x]
    assert len(line) == 1, err[-3000:]
    assert "rank 0: CommTimeout: a collective in " in line[0] and "timed out after 3 s" in line[0], line[0]
    assert "did not arrive, stopped responding: rank 1 (silent for" in line[0], line[0]
    assert 3 <= waited < 3 + 8
    print(line[0])  # shown with -s: the line a user sees


@pytest.mark.multiprocess
def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    """Within seconds, whatever the communication timeout (the launcher sees the rank die, and the others end on
    its SIGTERM at once). Also: --resume latest over a directory without a complete checkpoint says so and trains
    from step 0, and an option the mode ignores gets a warning (one launch for the three: each costs seconds)."""
    (tmp_path / "ck" / "step_000004").mkdir(parents=True)  # an interrupted save: no marker, not a checkpoint
    proc, pids, _ = _start_long_job(
        tmp_path,
        "--mode",
        "sync",
        "--partitioner",
        "kk",
        "--checkpoint-dir",
        "ck",
        "--resume",
        "latest",
        "--comm-timeout-s",
        "600",
    )
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 10, err[-3000:]  # 1 s when the machine is quiet
    assert proc.returncode == 1
    line = [x for x in err.splitlines() if "error" in x]
    assert len(line) == 1 and line[0].startswith("freescale train: error: rank 1 died"), err[-3000:]
    assert "without an error of its own" in line[0]  # with its signal, when the launcher saw it die first
    assert "no checkpoint in ck, starting at step 0" in out
    assert "warning: --partitioner is ignored in mode sync" in err


def test_options_the_mode_ignores_are_named_only_when_set():
    from pipelines.cli import build_parser
    from pipelines.job.config.flags import config_from_args, ignored_option_lines

    def warnings(*argv):
        config = config_from_args(build_parser().parse_args(["train", *argv]))
        return ignored_option_lines(config)

    assert warnings("--mode", "sync") == []  # defaults are never "set"
    assert warnings("--mode", "sync", "--partitioner", "kk", "--embeddings.early-start", "backward") == [
        "--partitioner is ignored in mode sync (it applies to mode(s) replicated, freescale)",
        "--embeddings.early-start is ignored in mode sync (it applies to mode(s) freescale)",
    ]
    assert warnings("--mode", "replicated", "--transport", "host") == [
        "--transport is ignored in mode replicated (it applies to mode(s) sync, sdd, semisync, freescale)"
    ]
    assert warnings("--mode", "freescale", "--partitioner", "kk", "--transport", "host") == []


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--comm-timeout-s", "0"], "comm_timeout_s must be > 0"),
        (["--id-overflow", "wrap"], "id_overflow must be one of error, modulo, hash"),
    ],
)
def test_new_flags_are_validated(argv, match):
    from pipelines.cli import build_parser
    from pipelines.job.config.flags import config_from_args

    with pytest.raises(ValueError, match=match):
        config_from_args(build_parser().parse_args(["train", *argv]))


def test_a_stage_worker_that_hangs_is_an_error_naming_the_stages(monkeypatch):
    import threading

    from torchdata.nodes import BaseNode

    from fscomm import groups
    from fsdata.nodes import background
    from fsdata.nodes.background import Background

    release = threading.Event()
    before = {t for t in threading.enumerate() if t.name.startswith("fsdata-stages")}  # other tests' workers

    class Stuck(BaseNode):
        def reset(self, initial_state=None):
            super().reset(initial_state)

        def next(self):
            release.wait(10)  # as a collective whose peer never comes
            return 1

        def get_state(self):
            return {}

    monkeypatch.setattr(background, "_WAIT_MARGIN_S", 0.2)
    groups.set_comm_timeout(0.3)
    try:
        with Background(Stuck()) as node:
            node.reset()
            t0 = time.monotonic()
            with pytest.raises(
                TimeoutError, match=r"stage worker did not hand over the next item within 0.5 s .*stages: Stuck"
            ):
                next(node)
            assert time.monotonic() - t0 < 3
            release.set()
    finally:
        groups.set_comm_timeout(None)
    assert not {t for t in threading.enumerate() if t.name.startswith("fsdata-stages")} - before


@pytest.mark.parametrize(
    "reports, failures, pids, expect",
    [
        # rank 1's own fault is named, not rank 0's consequence of it
        ({0: False, 1: True}, {0: 1, 1: 1}, [0, 1], "rank 1: cause 1 (traceback: x); rank(s) [0] failed after it"),
        # a rank killed without a report, seen by the launcher
        ({0: False}, {0: 1, 1: -9}, [0, 1], "rank 1 died (signal SIGKILL) without an error of its own"),
        # ... not seen by it (it saw rank 0 fail first): found by its missing report
        ({0: False}, {0: 1}, [0, 1], "rank 1 died without an error of its own"),
        # the launcher stopping the others (SIGTERM) is not a cause
        ({}, {0: -9, 1: -15}, [0, 1], "rank 0 died (signal SIGKILL) without an error of its own"),
    ],
)
def test_the_launcher_names_the_rank_where_the_fault_happened(tmp_path, reports, failures, pids, expect):
    from types import SimpleNamespace

    from pipelines.job.launch.failure import child_failure_line

    for rank, root in reports.items():
        line = f"rank {rank}: cause {rank} (traceback: x)"
        (tmp_path / f"rank{rank}.error").write_text(json.dumps({"rank": rank, "line": line, "root": root}))
    for rank in pids:
        (tmp_path / f"rank{rank}.pid").write_text(f"{100 + rank}\n")
    failure = SimpleNamespace(failures={r: SimpleNamespace(exitcode=c, pid=100 + r) for r, c in failures.items()})
    assert child_failure_line(failure, tmp_path).startswith(expect)


def test_the_launcher_names_a_failed_rank_by_the_jobs_rank_not_torchs(tmp_path):
    """On several hosts torch's agent numbers the ranks in its own order of the hosts, the job by --node-rank: the
    ranks' pid files tell which process is which; a rank that died before it wrote one keeps torch's number."""
    from types import SimpleNamespace

    from pipelines.job.launch.failure import exitcodes

    (tmp_path / "rank2.pid").write_text("100\n")  # torch's rank 0 is the job's rank 2
    (tmp_path / "rank3.pid").write_text("101\n")
    failures = {0: SimpleNamespace(exitcode=-9, pid=100), 1: SimpleNamespace(exitcode=1, pid=101)}
    assert exitcodes(SimpleNamespace(failures=failures), tmp_path) == {2: -9, 3: 1}
    unknown = {1: SimpleNamespace(exitcode=-9, pid=555)}
    assert exitcodes(SimpleNamespace(failures=unknown), tmp_path) == {1: -9}


def _launch_forbidden(monkeypatch) -> None:
    """Makes a launch fail the test: these errors must come before any rank starts."""
    from pipelines.job import train

    monkeypatch.setattr(train, "launch", lambda config, worker: pytest.fail("the ranks were started"))


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path, capsys, monkeypatch):
    _launch_forbidden(monkeypatch)
    (tmp_path / "job.toml").write_text("[run]\nsteps = 4\n\nlr = fast\n")
    proc = cli(tmp_path, capsys, "train", *FAST, "--config", "job.toml")
    assert proc.returncode == 2
    assert one_line_error(proc) == (
        "freescale train: error: job.toml: not valid TOML: Invalid value (at line 4, column 6)"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ('[run]\nsteps = "four"\n', 'job.toml: [run] steps: expected an integer, got "four" (str)'),
        ("[run]\nnproc = [2]\n", "job.toml: [run] nproc: expected an integer, got [2] (list)"),
        ("[run]\nsteps = 4.5\n", "job.toml: [run] steps: expected an integer, got 4.5 (float)"),
        ("[run]\nsteps = true\n", "job.toml: [run] steps: expected an integer, got true (bool)"),
        ("[run.steps]\nvalue = 4\n", "job.toml: [run] steps: expected an integer, got a table (dict)"),
        ('[run]\nlr = "fast"\n', 'job.toml: [run] lr: expected a finite number, got "fast" (str)'),
        ("[run]\nlr = true\n", "job.toml: [run] lr: expected a finite number, got true (bool)"),
        ("[run]\nlr = nan\n", "job.toml: [run] lr: expected a finite number, got nan (float)"),
        ("[loader]\nstage_lookahead = 1\n", "job.toml: [loader] stage_lookahead: expected true or false, got 1 (int)"),
        ("[data]\npath = 5\n", "job.toml: [data] path: expected a string, got 5 (int)"),
        ("run = 5\n", "job.toml: run: expected a table ([run]), got 5 (int)"),
        ("steps = 5\n", "job.toml: steps = 5 is outside any table; it belongs in [run]"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_one_line_naming_file_table_key_and_type(
    tmp_path, capsys, monkeypatch, text, message
):
    _launch_forbidden(monkeypatch)
    (tmp_path / "job.toml").write_text(text)
    proc = cli(tmp_path, capsys, "train", *FAST, "--config", "job.toml")
    assert proc.returncode == 2
    assert one_line_error(proc) == f"freescale train: error: {message}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "four"], 'argument --steps: expected an integer, got "four"'),
        (["--steps", "4.5"], 'argument --steps: expected an integer, got "4.5"'),
        (["--nproc", "true"], 'argument --nproc: expected an integer, got "true"'),
        (["--lr", "fast"], 'argument --lr: expected a finite number, got "fast"'),
        (["--lr", "inf"], 'argument --lr: expected a finite number, got "inf"'),
        (["--dense-sync.bucket-mb", "nan"], 'argument --dense-sync.bucket-mb: expected a finite number, got "nan"'),
    ],
)
def test_a_flag_of_the_wrong_type_is_refused_by_the_same_check(tmp_path, capsys, monkeypatch, argv, message):
    _launch_forbidden(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        cli(tmp_path, capsys, "train", *FAST, *argv)
    assert exited.value.code == 2
    assert error_lines(subprocess.CompletedProcess(argv, 2, "", capsys.readouterr().err)) == [
        f"freescale train: error: {message}"
    ]


def test_numbers_take_their_fields_type_and_a_config_set_in_python_is_checked_too(tmp_path):
    import numpy as np

    from pipelines.cli import build_parser
    from pipelines.job.config.flags import config_from_args
    from pipelines.job.config.sections import EXPECTED, JobConfig, config_fields, field_kind

    assert all(field_kind(path) in EXPECTED for path in config_fields())  # every field has a check
    (tmp_path / "job.toml").write_text("[run]\nlr = 1\nsteps = 3\n[balancer]\nalpha = 2\n")
    config = config_from_args(build_parser().parse_args(["train", "--config", str(tmp_path / "job.toml")]))
    assert config.run.lr == 1.0 and type(config.run.lr) is float and type(config.balancer.alpha) is float
    assert config.run.steps == 3 and config.explicit == {"run.lr", "run.steps", "balancer.alpha"}
    config = JobConfig()
    config.run.steps, config.run.lr = np.int64(3), 1  # an integer of any kind; an int is a float
    config.validate()
    for name, value, message in (
        ("steps", 4.5, "run.steps: expected an integer, got 4.5 (float)"),
        ("steps", True, "run.steps: expected an integer, got True (bool)"),
        ("lr", "fast", "run.lr: expected a finite number, got 'fast' (str)"),
        ("deterministic", 1, "run.deterministic: expected true or false, got 1 (int)"),
    ):
        config = JobConfig()
        setattr(config.run, name, value)
        with pytest.raises(ValueError) as error:
            config.validate()
        assert str(error.value) == message


def _write_data(path: Path, **synthetic) -> None:
    batch = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=16, **synthetic)).read(0, 0, 16)
    write_parquet(batch, str(path), row_group_size=8)


_SHAPED = "the model is shaped by the training data"


@pytest.mark.parametrize(
    "train, held_out, message",
    [
        (
            {},
            {"dense_dim": 3},
            f"has dense width 3 (column 'dense') but the training data (train.parquet) has 4: {_SHAPED}",
        ),
        (
            {},
            {"num_labels": 2},
            f"has label count 2 (column 'candidate_labels') but the training data (train.parquet) has 1: {_SHAPED}",
        ),
        (
            {},
            {"side_features": False},
            "lacks columns 'uih_action_types', 'uih_timestamps', which the training data (train.parquet) has and the "
            "model reads",
        ),
        (
            {"side_features": False},
            {},
            "has columns 'uih_action_types', 'uih_timestamps', which the training data (train.parquet) lacks: the "
            "model would read them in evaluation only",
        ),
        (
            None,
            {"dense_dim": 3},
            f"has dense width 3 (column 'dense') but the training data (synthetic preset 'tiny') has 4: {_SHAPED}",
        ),
        (
            None,
            {"side_features": False},
            "lacks columns 'uih_action_types', 'uih_timestamps', which the training data (synthetic preset 'tiny') "
            "has and the model reads",
        ),
    ],
)
def test_eval_data_that_differs_from_training_is_one_line_before_any_rank_starts(
    tmp_path, capsys, monkeypatch, train, held_out, message
):
    _launch_forbidden(monkeypatch)
    _write_data(tmp_path / "eval.parquet", **held_out)
    argv = ["train", *FAST, "--eval-data", "eval.parquet"]
    if train is not None:
        _write_data(tmp_path / "train.parquet", **train)
        argv += ["--data", "train.parquet"]
    proc = cli(tmp_path, capsys, *argv)
    assert proc.returncode == 2
    assert one_line_error(proc) == f"freescale train: error: --eval-data eval.parquet {message}"


def test_eval_data_that_matches_training_passes_also_without_freescales_metadata(tmp_path):
    """A file written by another tool carries no ``freescale.dense_dim``: its widths come from its first sample."""
    from fsdata.parquet import ParquetSource
    from pipelines.cli import build_parser
    from pipelines.job.config.flags import config_from_args
    from pipelines.job.launch.data_check import DataColumns, source_columns
    from pipelines.job.launch.preflight import check_before_launch

    _write_data(tmp_path / "train.parquet")
    table = batch_to_table(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=8)).read(0, 0, 8))
    pq.write_table(table.replace_schema_metadata(None), tmp_path / "bare.parquet")
    bare = ParquetSource(tmp_path / "bare.parquet")
    assert bare.dense_dim is None and source_columns(bare) == DataColumns(4, 1, ("uih_action_types", "uih_timestamps"))
    for data in ("synthetic", str(tmp_path / "train.parquet")):
        args = ["train", "--data", data, "--eval-data", str(tmp_path / "bare.parquet")]
        check_before_launch(config_from_args(build_parser().parse_args(args)))


@pytest.mark.multiprocess
def test_config_and_eval_data_errors_end_to_end(tmp_path):
    """`freescale train` as a user runs it (the ranks would start if the checks let it through)."""
    (tmp_path / "job.toml").write_text('[run]\nsteps = "four"\n')
    proc = freescale(tmp_path, "train", *FAST, "--config", "job.toml", timeout=60)
    assert proc.returncode == 2
    assert (
        one_line_error(proc) == 'freescale train: error: job.toml: [run] steps: expected an integer, got "four" (str)'
    )
    _write_data(tmp_path / "eval.parquet", num_labels=2)
    proc = freescale(tmp_path, "train", *FAST, "--eval-data", "eval.parquet", timeout=60)
    assert proc.returncode == 2
    one_line_error(proc, "--eval-data eval.parquet has label count 2", "(synthetic preset 'tiny') has 1")
