"""What a piece of code does on the GPU, read from a torch.profiler trace: kernels, copies, their streams, how
much of the copies' time overlaps kernels of other streams, and the spans where no kernel runs with what the host
was doing when it launched the kernel that ended each.

This is how the claims of the host backend are checked (benchmark and GPU test): it launches no kernel, its
copies run on a stream of their own, and they overlap the compute they hide under.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class GpuActivity:
    kernels: list[dict] = field(default_factory=list)  # {"name", "stream", "ts", "dur", "correlation"} (microseconds)
    memcpys: list[dict] = field(default_factory=list)
    launches: dict[int, dict] = field(default_factory=dict)  # correlation -> the runtime call's {"tid", "ts"}
    host_ops: list[dict] = field(default_factory=list)  # torch operators: {"name", "tid", "ts", "dur"}

    def kernel_names(self) -> list[str]:
        return sorted({k["name"] for k in self.kernels})

    def streams(self, events: list[dict]) -> set[int]:
        return {e["stream"] for e in events}

    def copy_overlap(self) -> float:
        """Fraction of copy time during which a kernel of another stream runs (0..1)."""
        total = sum(m["dur"] for m in self.memcpys)
        if total <= 0:
            return 0.0
        covered = 0.0
        for stream in self.streams(self.memcpys):
            merged = _merge([(k["ts"], k["ts"] + k["dur"]) for k in self.kernels if k["stream"] != stream])
            for m in self.memcpys:
                if m["stream"] != stream:
                    continue
                a, b = m["ts"], m["ts"] + m["dur"]
                covered += sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
        return covered / total

    def summary(self) -> dict:
        return {
            "kernels": len(self.kernels),
            "kernel_names": self.kernel_names()[:8],
            "kernel_streams": sorted(self.streams(self.kernels)),
            "memcpys": len(self.memcpys),
            "memcpy_streams": sorted(self.streams(self.memcpys)),
            "memcpy_kinds": sorted({m["name"] for m in self.memcpys}),
            "copy_overlap_with_kernels": round(self.copy_overlap(), 3),
        }

    def idle_gaps(self, top: int = 8) -> list[dict]:
        """The ``top`` longest spans with no kernel running, longest first: each one's ms, the kernel that ended it,
        and the torch operators the host was in when it launched that kernel (outermost first): where the device
        waited on the host."""
        longest = sorted(self._gaps(), key=lambda g: -g[0])[:top]
        return [
            {"ms": gap / 1e3, "kernel": k["name"], "host": self._host_ops_at(k), "busy": self._busy(k["ts"] - gap, k)}
            for gap, k in longest
        ]

    def idle_ms(self) -> float:
        """Milliseconds with no kernel running between the first kernel's start and the last one's end."""
        return sum(gap for gap, _ in self._gaps()) / 1e3

    def _gaps(self) -> list[tuple[float, dict]]:
        gaps, end = [], None
        for k in sorted(self.kernels, key=lambda k: k["ts"]):
            if end is not None and k["ts"] > end:
                gaps.append((k["ts"] - end, k))
            end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
        return gaps

    def _busy(self, start: float, kernel: dict, most: int = 3) -> list[str]:
        """What kept the host from launching ``kernel`` sooner: the innermost torch operators (any thread) that ran
        through at least half of the span from ``start`` (the device idle) to the kernel's launch, shortest first."""
        launch = self.launches.get(kernel.get("correlation", -1))
        end = launch["ts"] if launch is not None else kernel["ts"]
        span = max(end - start, 1e-9)
        held = [op for op in self.host_ops if min(end, op["ts"] + op["dur"]) - max(start, op["ts"]) >= span / 2]
        return [f"{op['name']} {op['dur'] / 1e3:.2f} ms" for op in sorted(held, key=lambda op: op["dur"])[:most]]

    def _host_ops_at(self, kernel: dict) -> list[str]:
        launch = self.launches.get(kernel.get("correlation", -1))
        if launch is None:
            return []
        around = [
            op
            for op in self.host_ops
            if op["tid"] == launch["tid"] and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]
        ]
        return [op["name"] for op in sorted(around, key=lambda op: (op["ts"], -op["dur"]))]


def describe_gap(gap: dict) -> str:
    """One line for an entry of :meth:`GpuActivity.idle_gaps`: its ms, the kernel after it, and the host's ops then
    (the outermost two and the innermost three)."""
    ops = gap["host"]
    host = " > ".join(ops[:2] + ["..."] + ops[-3:] if len(ops) > 5 else ops)
    busy = f"; host busy in: {', '.join(gap['busy'])[:200]}" if gap.get("busy") else ""
    return f"{gap['ms']:6.3f} ms idle before {gap['kernel'][:50]}; host: {host[:160]}{busy}"


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def trace(fn: Callable[[], None]) -> GpuActivity:
    """Runs ``fn`` under torch.profiler (CPU + CUDA activity) and returns the GPU-side events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return activity(events)


def activity(events: list[dict]) -> GpuActivity:
    """A chrome trace's events (torch.profiler's ``traceEvents``) as :class:`GpuActivity`."""
    act = GpuActivity()
    for e in events:
        cat, args = e.get("cat", ""), e.get("args", {})
        span = {"ts": float(e.get("ts", 0.0)), "dur": float(e.get("dur", 0.0))}
        if cat in ("kernel", "gpu_memcpy"):
            item = {"name": e.get("name", ""), "stream": int(args.get("stream", -1)), **span}
            item["correlation"] = int(args.get("correlation", -1))
            (act.kernels if cat == "kernel" else act.memcpys).append(item)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            act.launches[int(args["correlation"])] = {"tid": e.get("tid"), "ts": span["ts"]}
        elif cat == "cpu_op":
            act.host_ops.append({"name": e.get("name", ""), "tid": e.get("tid"), **span})
    return act
