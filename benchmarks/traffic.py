"""What the contention benches run beside a compute kernel: a transport's exchanges from a thread of their own,
and the kernels whose slowdown they measure."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import torch

TRAFFIC_BLOCK = 16 << 20
"""Bytes per destination of one traffic exchange."""


class ExchangeTraffic:
    """n all_to_all exchanges of ``TRAFFIC_BLOCK`` bytes per rank, two in flight, from a thread of their own (as a
    loader's would be), on a side stream where the rank has a GPU. Timed on the host's monotonic clock, which every
    process of a host shares, so one rank's kernel end can be compared with another rank's traffic end."""

    def __init__(self, transport: Any, world_size: int, device: torch.device, name: str = "bench-traffic"):
        self.transport, self.device, self.name = transport, device, name
        self.x = torch.empty(TRAFFIC_BLOCK * world_size, dtype=torch.uint8, device=device)
        self.splits = [TRAFFIC_BLOCK] * world_size
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, n: int) -> "ExchangeTraffic":
        self.started, self.times, self.error = threading.Event(), {}, None
        self.thread = threading.Thread(target=self._loop, args=(n,), name=self.name)
        self.thread.start()
        self.started.wait()
        return self

    def _loop(self, n: int) -> None:
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.device)
                torch.cuda.set_stream(self.stream)
            self.times["start"] = time.monotonic()
            inflight: deque = deque()
            for i in range(n):
                inflight.append(self.transport.all_to_all(self.x, self.splits, self.splits))
                if i == 0:
                    self.started.set()
                if len(inflight) >= 2:
                    inflight.popleft().wait()
            while inflight:
                inflight.popleft().wait()
            if self.stream is not None:
                self.stream.synchronize()
            self.times["end"] = time.monotonic()
        except BaseException as exc:  # carried to join()
            self.error = exc
        finally:
            self.started.set()

    def join(self, kernel_end: Optional[float], kernel_end_event=None) -> bool:
        """Whether the traffic outlasted the kernel (``kernel_end``: its end on the monotonic clock; None: no
        kernel ran here)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return kernel_end is None or self.times["end"] >= kernel_end

    def seconds(self) -> float:
        return self.times["end"] - self.times["start"]


def traffic_units(kernel_s: float, unit_s: float) -> int:
    """How many traffic exchanges (``unit_s`` each) outlast a kernel of ``kernel_s`` alone by half again; at least 2."""
    return max(2, math.ceil(1.5 * kernel_s / max(unit_s, 1e-6)) + 1)


def contention_row(
    kernel: str, traffic: str, kernel_s: float, ratios: list[float], dropped: int, units: int, unit_s: float
) -> dict:
    """One record of a contention bench: the kernel's time alone, and its slowdown (overlapped / alone) over the
    pairs kept, with the pairs dropped because the traffic ended before the kernel."""
    return {
        "kernel": kernel,
        "traffic": traffic,
        "kernel_alone_ms": 1e3 * kernel_s,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
        "max_ratio": max(ratios) if ratios else None,
        "pairs": len(ratios),
        "pairs_dropped_traffic_too_short": dropped,
        "traffic_units": units,
        "unit_ms": 1e3 * unit_s,
    }


KERNELS = ("sdpa", "gemm")


def contention_kernel(name: str, device: torch.device, bench: str) -> Callable[[], torch.Tensor]:
    """20 causal SDPA calls (B8 H16 L4096 D128) or 20 GEMMs (8192^3), bf16: the compute whose slowdown is measured."""
    if name == "sdpa":
        q, k, v = (torch.randn(8, 16, 4096, 128, dtype=torch.bfloat16, device=device) for _ in range(3))
        f = torch.nn.functional.scaled_dot_product_attention
        return lambda: [f(q, k, v, is_causal=True) for _ in range(20)][-1]
    if name == "gemm":
        a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device=device) for _ in range(2))
        return lambda: [a @ b for _ in range(20)][-1]
    raise ValueError(f"bench {bench}: unknown kernel {name!r}; choose {' or '.join(KERNELS)}")
