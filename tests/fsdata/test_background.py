"""The demand-driven stage worker: exact resume, exactly one item ahead, errors re-raised in the consumer."""

from __future__ import annotations

import time

import pytest
from torchdata.nodes import BaseNode, Loader

from fsdata.nodes.background import Background
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from tests.stateful import run_test_save_load_state


class Counting(BaseNode):
    """Counts how many items were pulled from it; raises on item ``fail_at``."""

    def __init__(self, source, fail_at=None):
        super().__init__()
        self.source, self.fail_at, self.pulled = source, fail_at, 0

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        item = next(self.source)
        self.pulled += 1
        if self.pulled == self.fail_at:
            raise RuntimeError(f"stage failed on item {self.pulled}")
        return item

    def get_state(self):
        return self.source.state_dict()


def _reader():
    return GlobalBatchReader(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=40, seed=2)), 4, 0, 1)


def test_background_resumes_exactly():
    run_test_save_load_state(lambda: Loader(Background(_reader())), midpoint=4)


def test_worker_stays_exactly_one_item_ahead():
    counting = Counting(_reader())
    it = iter(Loader(Background(counting)))
    for taken in range(1, 4):
        next(it)
        time.sleep(0.05)  # give the worker time to run ahead, if it would
        assert counting.pulled == taken + 1


def test_worker_errors_reach_the_consumer():
    it = iter(Loader(Background(Counting(_reader(), fail_at=3))))
    next(it)
    with pytest.raises(RuntimeError, match="stage failed on item 3"):
        next(it)
        next(it)


def _pulled_soon(counting, n, timeout=10.0):
    """Waits (up to ``timeout``) until the worker has pulled ``n`` items; a loaded machine may be slow to."""
    deadline = time.monotonic() + timeout
    while counting.pulled < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return counting.pulled


def test_gated_worker_starts_the_next_item_only_when_released():
    counting = Counting(_reader())
    node = Background(counting, gated=True)
    it = iter(Loader(node))
    first = next(it)
    time.sleep(0.05)
    assert counting.pulled == 1  # nothing started ahead: the next item is owed
    node.release()
    assert _pulled_soon(counting, 2) == 2  # released: one item ahead
    node.release()  # nothing owed: no second item
    time.sleep(0.05)
    assert counting.pulled == 2
    second = next(it)  # not released: next() starts the owed item itself
    third = next(it)
    assert counting.pulled == 3
    ungated = iter(Loader(Background(_reader())))
    for gated_item in (first, second, third):
        assert gated_item.sample_ids.equal(next(ungated).sample_ids)


def test_gated_worker_resumes_exactly():
    run_test_save_load_state(lambda: Loader(Background(_reader(), gated=True)), midpoint=4)


def test_gated_worker_state_taken_with_a_released_item_in_flight():
    """The trainer's case: the state is saved while the released item is in flight; a resumed loader
    recomputes that item, so it continues with exactly the items the first one went on with."""
    node = Background(_reader(), gated=True)
    loader = Loader(node)
    it = iter(loader)
    for _ in range(3):
        next(it)
    node.release()
    state = loader.state_dict()
    rest = [next(it).sample_ids for _ in range(3)]
    resumed = Loader(Background(_reader(), gated=True))
    resumed.load_state_dict(state)
    again = iter(resumed)
    assert all(next(again).sample_ids.equal(ids) for ids in rest)


class Slow(Counting):
    """Takes ``delay`` seconds per item."""

    def __init__(self, source, delay):
        super().__init__(source)
        self.delay = delay

    def next(self):
        time.sleep(self.delay)
        return super().next()


def test_blocked_time_counts_only_the_waits_for_a_late_worker():
    from fsdata.loader import loader_blocked_s

    node = Background(Slow(_reader(), delay=0.2))
    loader = Loader(node)
    it = iter(loader)
    next(it)  # nothing computed ahead yet: waits for the whole item
    first = loader_blocked_s(loader)
    assert 0.15 < first == node.blocked_s
    deadline = time.monotonic() + 10.0  # the worker finishes the next item meanwhile (a loaded machine may be slow)
    while not node._pending.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    next(it)  # ready: taking it waits for nothing
    assert loader_blocked_s(loader) - first < 0.1
    assert loader_blocked_s(Loader(_reader())) == 0.0  # no stage worker: never blocked on one


class Blocking(Counting):
    """Blocks its second pull until ``go`` is set: an item in flight stuck on a peer that is gone."""

    def __init__(self, source, go):
        super().__init__(source)
        self.go = go

    def next(self):
        if self.pulled == 1:
            assert self.go.wait(timeout=60)
        return super().next()


def test_an_abandoned_worker_does_not_wait_for_its_item_in_flight():
    """A rank that ends on a failure: waiting for the item in flight would add its collectives' timeout."""
    import threading

    go = threading.Event()
    node = Background(Blocking(_reader(), go))
    node.reset()
    next(node)  # the second item is now in flight, and blocks
    t0 = time.monotonic()
    node.shutdown(abandon=True)
    assert time.monotonic() - t0 < 1
    go.set()  # the worker thread ends with its item, as it would with the process
