"""Progress output in a file: plain lines (no carriage return), every N steps and at the end, with the bar's
figures; the bar only on a terminal."""

from __future__ import annotations

import io

import pytest

from pipelines.job.run.progress import PlainProgress, paused, progress_bar


def test_plain_progress_prints_lines_every_n_steps_and_at_the_end():
    out = io.StringIO()
    bar = PlainProgress(total=10, initial=2, desc="train freescale (2 ranks)", stream=out, every=3, seconds=1e9)
    for _ in range(7):
        bar.set_postfix(loss="0.6931")
        bar.update(1)
    bar.write("step 9: held-out NE 0.9")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [
        line.split(":")[1].split(",")[0].strip() for line in lines if "step " in line and "held-out" not in line
    ] == ["step 5/10", "step 8/10", "step 9/10"]
    assert all(line.startswith("train freescale (2 ranks): step") for line in lines if "held-out" not in line)
    assert "loss 0.6931" in lines[0] and lines[2] == "step 9: held-out NE 0.9"


def test_the_rate_leaves_out_the_time_spent_evaluating(monkeypatch):
    """4 steps in 2 s of training and 6 s of held-out evaluation: 2 steps/s, not 0.5, and the line says so."""
    clock = [100.0]
    monkeypatch.setattr("pipelines.job.run.progress.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = PlainProgress(total=4, desc="train freescale (2 ranks)", stream=out, every=4, seconds=1e9)
    for step in range(4):
        clock[0] += 0.5
        if step == 1:
            with paused(bar):
                clock[0] += 6.0
        bar.update(1)
    assert out.getvalue() == "train freescale (2 ranks): step 4/4 (8 s, 6 s of it held-out evaluation, 2.00 steps/s)\n"


def test_paused_moves_tqdms_clocks_past_the_block(monkeypatch):
    from tqdm import tqdm

    bar = tqdm(total=4, file=io.StringIO())
    start, last = bar.start_t, bar.last_print_t
    clock = [0.0]
    monkeypatch.setattr("pipelines.job.run.progress.time.monotonic", lambda: clock[0])
    with paused(bar):
        clock[0] += 6.0
    assert (bar.start_t, bar.last_print_t) == (start + 6.0, last + 6.0)
    bar.close()
    with paused(None):  # no bar (a rank other than 0): nothing to move
        pass


def test_a_stream_that_is_not_a_terminal_gets_plain_lines(monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress_bar(5), PlainProgress)


@pytest.mark.multiprocess
def test_a_run_into_a_file_reads_as_lines_and_leaves_no_temporary_folder(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "train", "--nproc", "2", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stdout + proc.stderr and "train freescale (2 ranks): step 3/3" in proc.stderr
    assert not list(tmp_path.glob("freescale-*")) and not list(tmp_path.glob("torchelastic_*"))
