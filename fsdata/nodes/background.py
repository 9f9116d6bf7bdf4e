"""Runs the stages below it one item ahead in a worker thread, so their CPU work leaves the training thread.

Unlike a free-running prefetcher, the worker is demand-driven: it computes exactly one item beyond what the
consumer has taken. Every rank's consumer takes the same number of items, so every rank's worker issues the same
collectives, and a reset (or the end of training) first waits for the one item in flight: a rank never stops
one collective earlier than another (which would hang both). One worker thread serves every Background node of
the process, in submission order: all loader-side collectives are issued from that one thread (each process group
keeps a single issuing thread, fscomm.groups), also when a loader is replaced by a new one (resume).

Gated (``gated=True``): the next item is not started when an item is handed out but when the consumer calls
``release()`` (or, at the latest, its next ``next()``; both from the consumer's thread). The trainer releases it
as its backward starts: on a host-bound model the forward is the training thread's busiest stretch of Python and
kernel launches, and a worker running its stages beside it would take the GIL from it after every torch op
(the A/B is in BENCHMARKS.md). The sequence of items, and of collectives, is the same either way; only when the
worker runs changes.

State: the source's state captured by the worker right after it produced the last item handed out, i.e. the
position before the item in flight (or owed, when gated); a resumed node recomputes that item.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Dict, Optional, TypeVar

from torchdata.nodes import BaseNode

T = TypeVar("T")
_END = object()
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdata-stages")
    return _executor


class Background(BaseNode[T]):
    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[T], gated: bool = False) -> None:
        super().__init__()
        self.source = source
        self.gated = gated
        self._pool = _worker()
        self._pending: Optional[concurrent.futures.Future] = None
        self._owed = False  # gated: the next item is due but not started (waits for release())
        self._state: Optional[Dict[str, Any]] = None  # the source's state before the item in flight
        self.blocked_s = 0.0  # how long the consumer's next() calls have waited for the worker, in all

    def _pull(self) -> tuple[Any, Dict[str, Any]]:
        try:
            item = next(self.source)
        except StopIteration:
            item = _END
        return item, self.source.state_dict()

    def _drain(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()  # let the item in flight finish its collectives on every rank
            except Exception:
                pass  # it is discarded: the error, if real, recurs when the item is recomputed
            self._pending = None
        self._owed = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._drain()
        source_state = initial_state[self.SOURCE_KEY] if initial_state is not None else None
        self._pool.submit(self.source.reset, source_state).result()  # the worker thread owns the source
        self._state = self._pool.submit(self.source.state_dict).result()

    def next(self) -> T:
        if self._pending is None:
            self._owed = False
            self._pending = self._pool.submit(self._pull)
        t0 = time.perf_counter()
        item, state = self._pending.result()  # an exception of the worker is re-raised here
        self.blocked_s += time.perf_counter() - t0
        self._pending = None
        if item is _END:
            raise StopIteration()
        self._state = state
        if self.gated:
            self._owed = True
        else:
            self._pending = self._pool.submit(self._pull)
        return item

    def release(self) -> None:
        """Gated: start the item that the last ``next()`` left owed (nothing if none is owed)."""
        if self._owed:
            self._owed = False
            self._pending = self._pool.submit(self._pull)

    def get_state(self) -> Dict[str, Any]:
        return {self.SOURCE_KEY: self._state}

    def shutdown(self) -> None:
        """Waits for the item in flight (call before destroying the process groups)."""
        self._drain()
