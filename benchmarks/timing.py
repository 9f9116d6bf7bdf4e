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


def kernel_times_ms(fn: Callable[[], None], calls: int = 3) -> dict[str, float]:
    """Per call of ``fn``, the milliseconds of GPU kernel time under each kernel name, costliest first, from
    torch.profiler over ``calls`` calls (a name launched several times a call sums its launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def range_kernel_times_ms(fn: Callable[[], None], name: str, calls: int = 3) -> dict[str, float]:
    """Per call of ``fn``, the milliseconds of GPU kernel time under each kernel name, of the kernels launched
    inside ``torch.profiler.record_function(name)`` ranges (and the ops under them), from torch.profiler over
    ``calls`` calls: a part of a step that its kernels' names alone do not tell apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    stack = [e for e in prof.events() if e.name == name and e.device_type == DeviceType.CPU]
    while stack:
        event = stack.pop()
        for kernel in event.kernels:
            totals[kernel.name] = totals.get(kernel.name, 0.0) + kernel.duration / 1e3 / calls
        stack.extend(event.cpu_children)
    return totals
