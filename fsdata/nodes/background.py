"""Runs the stages below it one item ahead in a worker thread, so their CPU work leaves the training thread.

Unlike a free-running prefetcher, the worker is demand-driven: it computes exactly one item beyond what the
consumer has taken. Every rank's consumer takes the same number of items, so every rank's worker issues the same
collectives, and a reset (or the end of training) first waits for the one item in flight: a rank never stops
one collective earlier than another (which would hang both). One worker thread serves every Background node of
the process, in submission order: all loader-side collectives are issued from that one thread (each process group
keeps a single issuing thread, fscomm.groups), also when a loader is replaced by a new one (resume).

State: the source's state captured by the worker right after it produced the last item handed out, i.e. the
position before the item in flight; a resumed node recomputes that item.
"""

from __future__ import annotations

import concurrent.futures
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

    def __init__(self, source: BaseNode[T]) -> None:
        super().__init__()
        self.source = source
        self._pool = _worker()
        self._pending: Optional[concurrent.futures.Future] = None
        self._state: Optional[Dict[str, Any]] = None  # the source's state before the item in flight

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

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._drain()
        source_state = initial_state[self.SOURCE_KEY] if initial_state is not None else None
        self._pool.submit(self.source.reset, source_state).result()  # the worker thread owns the source
        self._state = self._pool.submit(self.source.state_dict).result()

    def next(self) -> T:
        if self._pending is None:
            self._pending = self._pool.submit(self._pull)
        item, state = self._pending.result()  # an exception of the worker is re-raised here
        if item is _END:
            self._pending = None
            raise StopIteration()
        self._state = state
        self._pending = self._pool.submit(self._pull)
        return item

    def get_state(self) -> Dict[str, Any]:
        return {self.SOURCE_KEY: self._state}

    def shutdown(self) -> None:
        """Waits for the item in flight (call before destroying the process groups)."""
        self._drain()
