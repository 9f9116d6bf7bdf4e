"""One background thread per group that runs that group's host-side exchanges in issue order.

Why a thread: the host-relayed backends wait for the device-to-host copy, talk to the peers over the network
and queue the copy back; none of that may block the caller, which returns a handle at once. Why one per
group, shared by every transport on that group: the exchanges of a group must run in the order they were
issued, on every rank, or ranks would pair different operations.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch


def helper_event() -> "torch.cuda.Event":
    """A CUDA event that a helper thread (an exchange's worker, an embedding chain) waits on with ``synchronize()``:
    a blocking-sync event, so the thread sleeps until the GPU reaches it instead of spinning on a core, as CUDA's
    default wait does, beside the model's threads."""
    return torch.cuda.Event(blocking=True)


_lock = threading.Lock()


class SerialWorker:
    """``join_timeout_s``: how long :meth:`shutdown` waits for the queued jobs (the group's communication timeout:
    a job is an exchange, bounded by it)."""

    def __init__(self, name: str, join_timeout_s: float):
        self.name, self.join_timeout_s = name, join_timeout_s
        self._jobs: "queue.Queue[tuple[Future, Callable[[], Any]] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # carried to the waiting caller as a value
                fut.set_exception(exc)

    def shutdown(self) -> None:
        """Runs the jobs already queued, then ends the thread (bounded by the communication timeout)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.join_timeout_s)

    close = shutdown

    def __enter__(self) -> "SerialWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def worker_for(state) -> SerialWorker:
    """The exchange worker of ``state``'s group (a fscomm.groups.GroupState): it belongs to the group's record
    (made on first use, ended by ``groups.forget``), so a group made later can never inherit a dead group's thread
    or sequence number."""
    with _lock:
        w = getattr(state, "worker", None)
        if w is None:
            w = state.worker = SerialWorker(f"fscomm-{state.name}", join_timeout_s=state.timeout_s)
        return w


def close_worker(state) -> None:
    with _lock:
        w = getattr(state, "worker", None)
        state.worker = None
    if w is not None:
        w.shutdown()
