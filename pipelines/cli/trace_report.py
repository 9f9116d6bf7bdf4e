"""`freescale trace`: where a traced run's host time went, per phase of the step and per thread.

Reads the Chrome traces that `--trace` writes (`freescale train --trace PATH`: PATH.rankR.json; in a source
checkout, `python -m benchmarks e2e --trace DIR`: DIR/CASE_MODE.rankR.json; gzipped ones too) and prints, per
trace, averaged over its profiled steps:

- per phase of the training thread's step (the trainer's ``freescale/data``, ``freescale/forward``,
  ``freescale/backward`` and ``freescale/dense_allreduce`` spans, the rest as ``other``): its wall time, and for
  every thread that ran torch ops in it, the time inside them (the union of its top-level ops), how many, and
  the time its CUDA runtime calls took;
- ``between ops``: a phase's wall time minus the training thread's time inside ops. In the forward of a
  host-bound model this is Python, and waits: for handles, and for the GIL after each op, which the stage worker
  and the embedding chains take meanwhile. On a GPU the backward's ops run on autograd's thread, and the
  training thread only waits;
- on a GPU, how long the GPU was busy per step (kernels and copies, their union) and each thread's costliest
  CUDA runtime calls.

The profiler records torch ops of the threads that run the model (the training thread, autograd's) and CUDA
runtime calls of every thread; the loader's and the chains' own ops show only through their CUDA calls.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

PHASES = ("freescale/data", "freescale/forward", "freescale/backward", "freescale/dense_allreduce")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz) written by --trace")
    parser.add_argument("--top", type=int, default=4, help="costliest CUDA runtime calls shown per thread (default 4)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the reports as JSON")


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as fh:
            events = json.load(fh)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a Chrome trace written by --trace ({exc})") from exc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _top_level_starts(intervals: list[tuple[float, float]]) -> list[float]:
    """Start times of the intervals that begin outside every earlier one (the top-level ops, not those nested in
    them)."""
    starts, end = [], float("-inf")
    for start, stop in sorted(intervals):
        if start >= end:
            starts.append(start)
        end = max(end, stop)
    return starts


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if s < hi and e > lo]


def report(path: Path, top: int = 4) -> dict:
    """The summary of one trace (times in ms per profiled step)."""
    events = _load(path)
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e["name"]).startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    if not steps:
        raise ValueError(f"{path}: no profiled steps (ProfilerStep annotations) in this trace")
    trainer = Counter(e["tid"] for e in steps).most_common(1)[0][0]
    ops: dict = defaultdict(list)
    runtime: dict = defaultdict(list)
    runtime_calls: dict = defaultdict(Counter)
    gpu: list = []
    step_spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in steps]
    for e in events:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        cat = e.get("cat")
        if cat == "cpu_op":
            ops[e["tid"]].append(span)
        elif cat in RUNTIME_CATEGORIES:
            runtime[e["tid"]].append(span)
            if any(lo <= span[0] < hi for lo, hi in step_spans):  # per profiled step: calls outside them not
                runtime_calls[e["tid"]][e["name"]] += float(e["dur"])
        elif cat in GPU_CATEGORIES:
            gpu.append(span)
    top_level = {tid: _top_level_starts(spans) for tid, spans in ops.items()}
    marks = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in events
        if e.get("tid") == trainer and e.get("cat") == "user_annotation" and e["name"] in PHASES
    ]
    n = len(steps)
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in (*PHASES, "other")}
    for lo, hi in step_spans:
        covered = sorted(m for m in marks if lo <= m[0] < hi)
        for s, t, name in covered:
            windows[name].append((s, t))
        cursor = lo
        for s, t, _ in covered:  # the step's time outside every phase: "other"
            if s > cursor:
                windows["other"].append((cursor, s))
            cursor = max(cursor, t)
        if hi > cursor:
            windows["other"].append((cursor, hi))
    phases = {}
    for name, spans in windows.items():
        if not spans:
            continue
        wall = sum(t - s for s, t in spans)
        threads = {}
        for tid in set(ops) | set(runtime):
            busy = sum(_union(_clip(ops.get(tid, []), s, t)) for s, t in spans)  # an op across phases: split
            count = sum(1 for s, t in spans for start in top_level.get(tid, []) if s <= start < t)  # where it began
            rt = sum(_union(_clip(runtime.get(tid, []), s, t)) for s, t in spans)
            if busy / n >= 50 or rt / n >= 50:  # at least 0.05 ms per step
                threads[str(tid)] = {"ops_ms": busy / n / 1e3, "ops": count / n, "cuda_runtime_ms": rt / n / 1e3}
        own = threads.get(str(trainer), {"ops_ms": 0.0})
        phases[name.split("/")[-1]] = {
            "wall_ms": wall / n / 1e3,
            "between_ops_ms": wall / n / 1e3 - own["ops_ms"],
            "threads": threads,
        }
    lo, hi = step_spans[0][0], max(t for _, t in step_spans)
    return {
        "trace": str(path),
        "steps": n,
        "step_ms": [(t - s) / 1e3 for s, t in step_spans],
        "training_thread": str(trainer),
        "gpu_busy_ms": _union(_clip(gpu, lo, hi)) / n / 1e3 if gpu else None,
        "phases": phases,
        "cuda_runtime_top": {
            str(tid): {call: us / n / 1e3 for call, us in calls.most_common(top)}
            for tid, calls in runtime_calls.items()
        },
    }


def _print(r: dict) -> None:
    gpu = "" if r["gpu_busy_ms"] is None else f"; GPU busy {r['gpu_busy_ms']:.2f} ms/step"
    steps = ", ".join(f"{s:.1f}" for s in r["step_ms"])
    print(f"{r['trace']}: {r['steps']} profiled steps ({steps} ms){gpu}; training thread {r['training_thread']}")
    print(
        f"  {'phase':16s} {'wall ms':>8s} {'between ops':>11s}   per thread: ms in ops (top-level ops), ms in CUDA "
        "runtime"
    )
    for name, p in r["phases"].items():
        cells = [
            f"{tid}{'*' if tid == r['training_thread'] else ''}: {t['ops_ms']:.2f} ({t['ops']:.0f}), "
            f"{t['cuda_runtime_ms']:.2f}"
            for tid, t in sorted(p["threads"].items(), key=lambda kv: -kv[1]["ops_ms"])
        ]
        print(f"  {name:16s} {p['wall_ms']:8.2f} {p['between_ops_ms']:11.2f}   " + "; ".join(cells))
    for tid, calls in r["cuda_runtime_top"].items():
        if calls:
            print(
                f"  CUDA runtime, thread {tid}: " + ", ".join(f"{c} {ms:.3f}" for c, ms in calls.items()) + " (ms/step)"
            )


def main(args: argparse.Namespace) -> int:
    reports = []
    for name in args.traces:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"trace {path} does not exist")
        reports.append(report(path, args.top))
        _print(reports[-1])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0
