"""The trainer's per-step accounting: what a step's record says beside its loss.

Per step: how long the training thread waited for the loader (``data_wait_s``) and the part of it that waited for
a late stage worker (``data_blocked_s``); the exposed communication by part, from the timer's spans
(``exposed_s``); the step's wall time; this process's garbage-collection pauses (``gc_s``); and, as clues to a
stalled step, the pinned blocks newly allocated by the embedding exchanges' relay pool and by torch's host
allocator. The trainer calls ``begin`` / ``fetching`` / ``finish`` around each step and reads nothing else here.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Any, Iterator, Optional

import torch

from fsdata.loader import loader_blocked_s
from fsdata.nodes.gather_lengths import GatherCandidateLengths, GatherLengths
from fsdata.nodes.shuffle import ShuffleSamples
from fsembed.sharded import EMB_A2A, GRAD_A2A, IDS_A2A

# Exposed-time spans (Timer names) per part: the embedding wrap's three exchanges, the balancer stages' waits.
EXPOSED_SPANS = {
    "ids_a2a": IDS_A2A,
    "emb_a2a": EMB_A2A,
    "grad_a2a": GRAD_A2A,
    "balancer": (GatherLengths.span_name, GatherCandidateLengths.span_name, ShuffleSamples.span_name),
    "label_count": "label_count",
}


class GcPauses:
    """Time this process spends in Python's garbage collections, per step (``gc_s``). Whichever thread triggers
    one, every Python thread of the rank waits, and the other ranks then wait at the next collective; a full
    collection over the objects tracked after set-up is long. Measured so that a pause in a timed step shows as
    what it is. The trainer leaves the collector as it is: in the timed steps the pauses are small beside the
    step, with or without ``gc.freeze()`` after set-up."""

    def __init__(self) -> None:
        self._start: Optional[float] = None
        self._total = 0.0
        self._lock = threading.Lock()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            with self._lock:
                self._total += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        """Seconds spent collecting since the last call."""
        with self._lock:
            total, self._total = self._total, 0.0
        return total

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def pinned_allocations() -> Optional[int]:
    """Pinned host blocks torch's caching host allocator has allocated so far (cudaHostAlloc calls), or None
    where this torch does not count them. Recorded per step on a GPU as a clue to a stalled step: a batch larger
    than any before needs a larger pinned block."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    return stats().get("num_host_alloc")


def stall_clues(history: list[dict]) -> dict[str, Optional[list]]:
    """Per step, on this rank, what can stall a step besides a late peer: its garbage-collection pauses and the
    pinned blocks newly allocated by the embedding exchanges' relay pool and by torch's host allocator
    (cudaHostAlloc takes milliseconds). Step 0's counts are those since set-up; None where not recorded (no
    embedding wrap, not on a GPU)."""

    def grown(key: str) -> Optional[list[int]]:
        counts = [r.get(key) for r in history]
        if not counts or any(c is None for c in counts):
            return None
        return [counts[0]] + [b - a for a, b in zip(counts, counts[1:])]

    return {
        "gc_s": [r["gc_s"] for r in history],
        "new_relay_blocks": grown("relay_allocations"),
        "new_pinned_blocks": grown("pinned_allocations"),
    }


class StepAccounting:
    """One per trainer. ``timer``: the trainer's (exposed spans); ``loader``: for the stage worker's lateness;
    ``wrap``: the embedding wrap (its relay pool), or None; ``device``: pinned blocks are counted on CUDA."""

    def __init__(self, timer: Any, loader: Any, wrap: Any, device: torch.device) -> None:
        self.timer, self.loader, self.wrap, self.device = timer, loader, wrap, device
        self.gc = GcPauses()
        self._t0 = 0.0
        self._before: dict[str, float] = {}
        self._blocked = 0.0
        self._data_wait = 0.0

    def begin(self) -> None:
        """At the top of a step. The timer's own bookkeeping (on a GPU it resolves the last step's CUDA events) and
        the last batch's frees count in the step, not in the loader's time: ``data`` is the fetch alone."""
        self._t0 = time.perf_counter()
        self._before = self.exposed_totals()
        self._blocked = loader_blocked_s(self.loader)

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """Around the training thread's taking of the next batch."""
        start = time.perf_counter()
        yield
        self._data_wait = time.perf_counter() - start
        self._blocked = loader_blocked_s(self.loader) - self._blocked

    def finish(self, record: Any) -> None:
        """Adds the step's accounting to its record (pipelines.job.run.record.StepRecord; after the step's work)."""
        record.data_wait_s = self._data_wait
        record.data_blocked_s = self._blocked  # the part of data_wait that waited for the stage worker
        record.exposed_s = self.exposed_delta(self._before, record)
        record.step_time_s = time.perf_counter() - self._t0
        record.gc_s = self.gc.take()
        if self.wrap is not None:  # cumulative: a step where it grows paid a pinned allocation
            record.relay_allocations = self.wrap.collection.transports.relay_allocations()
        if self.device.type == "cuda":  # torch's pinned blocks (the stage worker pins every batch)
            record.pinned_allocations = pinned_allocations()
        self.timer.add("data_wait", self._data_wait)

    def exposed_totals(self) -> dict[str, float]:
        totals = {name: s["total_s"] for name, s in self.timer.summary().items()}
        return {
            part: sum(totals.get(n, 0.0) for n in (spans if isinstance(spans, tuple) else (spans,)))
            for part, spans in EXPOSED_SPANS.items()
        }

    def exposed_delta(self, before: dict[str, float], record: Any) -> dict[str, float]:
        after = self.exposed_totals()
        out = {part: after[part] - before[part] for part in EXPOSED_SPANS}
        out["dense_allreduce"] = None  # filled in by _settle once every rank's compute time is known (torchrec: never)
        # The loader's own work on the critical path (the balancer's and ID prefetch's CPU work happens in the
        # loader's next(); their collective waits are the parts above, counted once).
        out["data"] = max(record.data_wait_s - out["balancer"], 0.0)
        for part in record.unmeasured:  # hidden inside torchrec's progress(): unknown, not zero
            out[part] = None
        return out

    def close(self) -> None:
        self.gc.close()
