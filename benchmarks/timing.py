"""Per-call times of a GPU or CPU callable, as the kernel and step benchmarks take them."""

from __future__ import annotations

import time
from typing import Callable, Optional

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
    return kernel_and_range_times_ms(fn, calls)[0]


def kernel_and_range_times_ms(
    fn: Callable[[], None], calls: int = 3, within: Optional[str] = None
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`kernel_times_ms`'s per-name milliseconds, and from the same profile the part of them launched inside
    ``torch.profiler.record_function(within)`` ranges (and the ops under them): a part of a call that its kernels'
    names alone do not tell apart. Without ``within`` the second is empty and the host side goes unprofiled."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if within else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    inside: dict[str, float] = {}
    stack = []
    for event in prof.events():
        on_device = event.device_type == DeviceType.CUDA
        if within and event.name == within:
            if not on_device:  # the range's host side; its span on the device's timeline is no kernel
                stack.append(event)
        elif on_device and not getattr(event, "is_user_annotation", False):  # another range's device-side span
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3 / calls
    while stack:
        event = stack.pop()
        for kernel in event.kernels:
            inside[kernel.name] = inside.get(kernel.name, 0.0) + kernel.duration / 1e3 / calls
        stack.extend(event.cpu_children)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), inside
