"""Per-call times of a GPU or CPU callable, as the kernel and step benchmarks take them."""

from __future__ import annotations

import time
from typing import Callable

import torch


def call_times_ms(
    device: torch.device, fn: Callable[[], None], reps: int, warmup: int, *, wall: bool = False
) -> list[float]:
    """Each of ``reps`` calls' milliseconds after ``warmup`` calls: CUDA events on CUDA (the device's time of the
    call, without the host's launch gaps between calls), the wall clock elsewhere or with ``wall`` (on CUDA then
    up to the device's end of the call: what a first call's compiling and autotuning cost)."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if cuda and not wall:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times
