"""`python -m benchmarks soak`: a long run of `freescale train` (the demo's job: the softmax model on synthetic
data, 2 local CPU ranks) with the job's resident memory read at intervals.

A job that keeps something per step grows linearly however small the thing; over a million steps that is
gigabytes. The bench launches the job, and every ``--interval-s`` seconds reads the resident set (``VmRSS`` of
/proc) of the launcher and of every process under it (the ranks, and whatever they start), and the step the job
has reached (the lines of its ``--metrics-jsonl``, written as each step settles). It prints one row per reading,
then the growth between the first reading at or past ``--from-step`` and the last one (MiB in all, bytes per
step, and each process's resident set at both readings), and the size of the run summary; ``--json PATH`` writes
the readings and those figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20_000, help="steps of the job")
    parser.add_argument("--nproc", type=int, default=2, help="local CPU ranks")
    parser.add_argument("--batch-size", type=int, default=16, help="local batch size (the demo's)")
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between two readings")
    parser.add_argument("--from-step", type=int, default=1_000, help="growth is measured from this step on")
    parser.add_argument("--json", default=None, help="write the readings and the growth here")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _rss_mib(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _StepCounter:
    """The steps the job has settled: the step lines of its metrics file so far (read on from where it left)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.steps = path, 0, 0

    def read(self) -> int:
        if not self.path.exists():
            return self.steps
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.steps += sum(1 for line in complete.splitlines() if b'"eval"' not in line)
        return self.steps


def _reading(launcher: int, counter: _StepCounter, started: float) -> dict:
    rss = {p: _rss_mib(p) for p in _tree(launcher)}
    rss = {p: v for p, v in rss.items() if v is not None}
    return {
        "t_s": round(time.monotonic() - started, 1),
        "step": counter.read(),
        "rss_mib_total": round(sum(rss.values()), 1),
        "rss_mib_per_process": {str(p): round(v, 1) for p, v in sorted(rss.items())},
    }


def growth(readings: list[dict], from_step: int) -> dict:
    """The job's resident memory from the first reading at or past ``from_step`` to the last reading."""
    later = [r for r in readings if r["step"] >= from_step]
    # a reading taken while the ranks exit lacks them: only readings of the same processes compare
    later = [r for r in later if set(r["rss_mib_per_process"]) == set(later[0]["rss_mib_per_process"])] if later else []
    if len(later) < 2:
        return {"from_step": from_step, "to_step": None, "mib": None, "bytes_per_step": None}
    first, last = later[0], later[-1]
    mib = last["rss_mib_total"] - first["rss_mib_total"]
    steps = max(last["step"] - first["step"], 1)
    per_first, per_last = first["rss_mib_per_process"], last["rss_mib_per_process"]
    return {
        "from_step": first["step"],
        "to_step": last["step"],
        "mib": round(mib, 1),
        "bytes_per_step": mib * 2**20 / steps,
        # each process's resident set at both readings (MiB): the launcher and every rank apart
        "per_process_mib": {p: [per_first[p], per_last[p]] for p in per_first if p in per_last},
    }


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.interval_s <= 0:
        raise ValueError(f"--steps must be >= 1 and --interval-s > 0, got {args.steps} and {args.interval_s}")
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as folder:
        metrics, summary, log = Path(folder) / "metrics.jsonl", Path(folder) / "summary.json", Path(folder) / "log"
        cmd = [
            sys.executable, "-m", "pipelines.cli", "train", "--nproc", str(args.nproc), "--device", "cpu",
            "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--no-progress",
            "--metrics-jsonl", str(metrics), "--summary-json", str(summary),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        counter, readings = _StepCounter(metrics), []
        print(f"{'t (s)':>8} {'step':>7} {'job RSS (MiB)':>14}  per process (MiB)", flush=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
            started = time.monotonic()
            try:
                while proc.poll() is None:
                    time.sleep(args.interval_s)
                    if proc.poll() is not None:
                        break
                    r = _reading(proc.pid, counter, started)
                    readings.append(r)
                    per = " ".join(f"{v:.0f}" for v in r["rss_mib_per_process"].values())
                    print(f"{r['t_s']:>8.1f} {r['step']:>7} {r['rss_mib_total']:>14.1f}  {per}", flush=True)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
        if proc.returncode != 0:
            raise ValueError(f"the job failed (exit {proc.returncode}): {log.read_text()[-2000:]}")
        summary_bytes = summary.stat().st_size
        steps = counter.read()
    result = {"steps": steps, "growth": growth(readings, args.from_step), "summary_bytes": summary_bytes}
    g = result["growth"]
    if g["mib"] is None:
        print(f"growth: fewer than two readings past step {args.from_step}")
    else:
        print(
            f"growth from step {g['from_step']} to {g['to_step']}: {g['mib']:+.1f} MiB "
            f"({g['bytes_per_step']:+.0f} bytes per step); summary JSON {summary_bytes:,} bytes after {steps} steps"
        )
        for pid, (a, b) in g["per_process_mib"].items():
            print(f"  process {pid}: {a:.1f} -> {b:.1f} MiB ({b - a:+.1f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**result, "command": cmd[3:], "readings": readings}, indent=2))
    return 0
