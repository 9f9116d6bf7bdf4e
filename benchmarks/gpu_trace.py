"""What a piece of code does on the GPU, read from a torch.profiler trace: kernels, copies, their streams, and
how much of the copies' time overlaps kernels of other streams.

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
    kernels: list[dict] = field(default_factory=list)  # {"name", "stream", "ts", "dur"} (microseconds)
    memcpys: list[dict] = field(default_factory=list)

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
    act = GpuActivity()
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy"):
            continue
        item = {
            "name": e.get("name", ""),
            "stream": int(e.get("args", {}).get("stream", -1)),
            "ts": float(e.get("ts", 0.0)),
            "dur": float(e.get("dur", 0.0)),
        }
        (act.kernels if cat == "kernel" else act.memcpys).append(item)
    return act
