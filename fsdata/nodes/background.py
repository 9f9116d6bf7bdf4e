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
(the A/B is in docs/bench-notes.md). The sequence of items, and of collectives, is the same either way; only when the
worker runs changes.

State: the source's state captured by the worker right after it produced the last item handed out, i.e. the
position before the item in flight (or owed, when gated); a resumed node recomputes that item.

Bounded waits. Every wait on the worker is bounded by the job's communication timeout (fscomm.groups) plus a
margin: the worker's own collectives end in an error after that timeout, so a wait longer than that means the
worker itself is stuck, and the consumer gets an error naming the stages instead of hanging. An item in flight
that fails while it is discarded (reset, shutdown) is reported in one line on stderr, not swallowed.

Ownership. The worker thread lives while some Background node holds it: ``shutdown()`` (or ``close()``, or
leaving a ``with`` block) lets go, and the last node to let go ends the thread; a node used again takes it anew.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from typing import Any, Dict, Optional, TypeVar

from torchdata.nodes import BaseNode

from fscomm.groups import comm_timeout_s

T = TypeVar("T")
_END = object()
_WAIT_MARGIN_S = 5.0  # beyond the communication timeout: the worker's collectives fail first, with their own error
_lock = threading.Lock()
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_holders = 0


def _acquire() -> concurrent.futures.ThreadPoolExecutor:
    global _executor, _holders
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdata-stages")
        _holders += 1
        return _executor


def _release(wait: bool = True) -> None:
    global _executor, _holders
    with _lock:
        _holders -= 1
        done = _executor if _holders == 0 else None
        if done is not None:
            _executor = None
    if done is not None:
        done.shutdown(wait=wait)


def _describe(node: Any) -> str:
    names = []
    while node is not None and len(names) < 12:
        names.append(type(node).__name__)
        node = getattr(node, "source", None)
    return " <- ".join(names)


class Background(BaseNode[T]):
    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[T], gated: bool = False) -> None:
        super().__init__()
        self.source = source
        self.gated = gated
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
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

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = _acquire()
        return self._pool.submit(fn, *args)

    def _wait(self, future: concurrent.futures.Future, what: str) -> Any:
        limit = comm_timeout_s() + _WAIT_MARGIN_S
        try:
            return future.result(timeout=limit)  # an exception of the worker is re-raised here
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the loader's stage worker did not {what} within {limit:g} s (the communication timeout plus "
                f"{_WAIT_MARGIN_S:.0f} s); stages: {_describe(self.source)}"
            ) from None

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                self._wait(pending, "finish its item in flight")  # its collectives complete on every rank
            except Exception as exc:  # the item is discarded; a real fault recurs when it is recomputed
                print(
                    f"[freescale] warning: the loader's item in flight failed while it was discarded: "
                    f"{' '.join(str(exc).split())}",
                    file=sys.stderr,
                )
        self._owed = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._drain()
        source_state = initial_state[self.SOURCE_KEY] if initial_state is not None else None
        self._wait(self._submit(self.source.reset, source_state), "reset its stages")  # the worker owns the source
        self._state = self._wait(self._submit(self.source.state_dict), "return its stages' state")

    def next(self) -> T:
        if self._pending is None:
            self._owed = False
            self._pending = self._submit(self._pull)
        t0 = time.perf_counter()
        try:
            item, state = self._wait(self._pending, "hand over the next item")
        except BaseException:
            self._pending = None
            raise
        self.blocked_s += time.perf_counter() - t0
        self._pending = None
        if item is _END:
            raise StopIteration()
        self._state = state
        if self.gated:
            self._owed = True
        else:
            self._pending = self._submit(self._pull)
        return item

    def release(self) -> None:
        """Gated: start the item that the last ``next()`` left owed (nothing if none is owed)."""
        if self._owed:
            self._owed = False
            self._pending = self._submit(self._pull)

    def get_state(self) -> Dict[str, Any]:
        return {self.SOURCE_KEY: self._state}

    def shutdown(self, abandon: bool = False) -> None:
        """Waits for the item in flight (call before destroying the process groups) and lets the worker thread go.

        ``abandon``: for a process that ends on a failure. The item in flight is not waited for: its collectives
        wait on peers that may be gone, each up to the communication timeout, after the timeout that failed the
        step; the worker thread ends with the process."""
        if abandon:
            self._pending, self._owed = None, False
        self._drain()
        if self._pool is not None:
            self._pool = None
            _release(wait=not abandon)

    close = shutdown

    def __enter__(self) -> "Background[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
