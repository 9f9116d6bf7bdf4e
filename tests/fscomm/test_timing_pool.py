"""Timer spans and the relay pool's reuse (single process, no ranks)."""

from __future__ import annotations

import time

import pytest

from fscomm.pinned_pool import PinnedPool
from fscomm.timing import Timer


def test_timer_spans_sum_and_reset():
    timer = Timer("cpu")
    for _ in range(3):
        with timer.span("ids_a2a"):
            time.sleep(0.01)
    with timer.span("wait"):
        pass
    timer.add("wait", 0.5)
    s = timer.summary()
    assert s["ids_a2a"]["count"] == 3 and 0.03 <= s["ids_a2a"]["total_s"] < 0.5
    assert s["ids_a2a"]["mean_s"] == pytest.approx(s["ids_a2a"]["total_s"] / 3)
    assert s["wait"]["count"] == 2 and s["wait"]["total_s"] >= 0.5
    timer.reset()
    assert timer.summary() == {}
    with pytest.raises(ValueError):
        with timer.span(""):
            pass


def test_timer_records_span_even_when_body_raises():
    timer = Timer()
    with pytest.raises(KeyError):
        with timer.span("lookup"):
            raise KeyError("x")
    assert timer.summary()["lookup"]["count"] == 1


def test_pool_allocations_flat_after_warmup():
    pool = PinnedPool(pin=False)
    sizes = [100, 5000, 70_000, 0, 4096]
    for step in range(20):  # three buffers in flight at a time, like three outstanding handles
        held = [pool.acquire(sizes[(step + k) % len(sizes)]) for k in range(3)]
        assert [b.view.numel() for b in held] == [sizes[(step + k) % len(sizes)] for k in range(3)]
        for b in held:
            pool.release(b)
        if step == 4:
            warm = pool.stats()["allocations"]
    stats = pool.stats()
    assert stats["allocations"] == warm and stats["acquires"] == 60
    assert stats["bytes_in_use"] == 0 and stats["bytes_reserved"] >= stats["peak_bytes_in_use"] > 0


def test_pool_reserve_covers_that_many_buffers_in_flight():
    pool = PinnedPool(pin=False)
    pool.reserve(10_000, 3)
    assert pool.stats()["allocations"] == 3 and pool.stats()["bytes_in_use"] == 0
    held = [pool.acquire(9_000) for _ in range(3)]  # same size class: nothing new
    assert pool.stats()["allocations"] == 3
    for b in held:
        pool.release(b)
