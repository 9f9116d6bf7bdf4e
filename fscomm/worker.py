"""One background thread per group that runs that group's host-side exchanges in issue order.

Why a thread: the host-staged backends wait for the device-to-host copy, talk to the peers over the network
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

from fscomm import groups


def helper_event() -> "torch.cuda.Event":
    """A CUDA event that a helper thread (an exchange's worker, an embedding chain) waits on with ``synchronize()``:
    a blocking-sync event, so the thread sleeps until the GPU reaches it instead of spinning on a core, as CUDA's
    default wait does, beside the model's threads."""
    return torch.cuda.Event(blocking=True)


_workers: dict[int, "SerialWorker"] = {}
_lock = threading.Lock()


class SerialWorker:
    def __init__(self, name: str):
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
        self._jobs.put(None)
        self._thread.join(timeout=5)


def worker_for(state: "groups.GroupState") -> SerialWorker:
    with _lock:
        w = _workers.get(id(state))
        if w is None:
            w = _workers[id(state)] = SerialWorker(f"fscomm-{state.name}")
        return w
