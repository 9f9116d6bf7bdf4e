"""Named time spans, for the exposed time of every exchange and wait.

    timer = Timer(device)
    with timer.span("ids_a2a_wait"):
        ids = handle.wait()
    timer.summary()   # {"ids_a2a_wait": {"total_s": ..., "count": ..., "mean_s": ...}}

On CPU a span is host wall clock. On CUDA it is the time between two events recorded on the current stream,
i.e. how long the GPU stream spent on (or stalled in) the span, which is what "exposed" means there: a
``wait()`` that only makes the stream wait on an event costs the host nothing but can stall the stream.
CUDA events are resolved lazily in ``summary()``, so a span never synchronises the device.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Union

import torch


class Timer:
    def __init__(self, device: Union[str, torch.device, None] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._totals: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._pending: list[tuple[str, "torch.cuda.Event", "torch.cuda.Event"]] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Timer.span: name must be a non-empty string, got {name!r}")
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end.record(torch.cuda.current_stream(self.device))
                self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Adds a duration measured elsewhere (e.g. a handle's ``wait_time_s``)."""
        self._add(name, float(seconds))

    def _add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds
        self._counts[name] = self._counts.get(name, 0) + 1

    def _resolve(self) -> None:
        pending, self._pending = self._pending, []
        for name, start, end in pending:
            end.synchronize()
            self._add(name, start.elapsed_time(end) / 1e3)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per span name: total_s, count, mean_s (waits for the GPU to pass the spans' end events)."""
        self._resolve()
        return {
            name: {"total_s": total, "count": self._counts[name], "mean_s": total / self._counts[name]}
            for name, total in self._totals.items()
        }

    def reset(self) -> None:
        self._totals.clear()
        self._counts.clear()
        self._pending.clear()
