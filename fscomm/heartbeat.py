"""Which ranks did not arrive: a per-rank heartbeat in the job's store, read only after a collective failed.

A collective that times out tells its rank only that it waited too long, not for whom. Each rank's heartbeat
thread posts ``<wall time> <status>`` (the status is what the rank is doing, e.g. its step) to the job's
store every ``interval_s``; after a timeout, :meth:`Heartbeat.diagnose` reads the others': a rank whose last
post is old has stopped (SIGSTOP, a hung device call holding the process, a dead host), one whose post is fresh
is alive and elsewhere (its status says where). The cost is one small store write per rank per interval, off
the training thread.

Owned: ``close()`` (or leaving a ``with`` block) ends the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

_KEY = "freescale/heartbeat/{}"


class Heartbeat:
    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0, store: Optional[dist.Store] = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval_s}")
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        try:  # a client of its own: the training thread uses the store too, and one client is not for two threads
            store = store.clone()
        except (AttributeError, RuntimeError, NotImplementedError):
            pass
        self.store = store
        self.status: Callable[[], str] = lambda: "setting up"
        self._lock = threading.Lock()  # one store client, used by the thread and by set_status's caller
        self._stop = threading.Event()
        self._post()
        self._thread = threading.Thread(target=self._run, name=f"freescale-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def set_status(self, status: Callable[[], str]) -> None:
        """What this rank is doing, read at every post; posted at once."""
        self.status = status
        self._post()

    def _post(self) -> None:
        try:
            status = self.status()
        except Exception:  # the status reads another object's state: never let it end the heartbeat
            status = "unknown"
        with self._lock:
            self.store.set(_KEY.format(self.rank), f"{time.time():.3f} {status}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._post()
            except Exception:  # the store may be busy or gone; a rank that cannot post looks silent, as it is
                continue

    def diagnose(self) -> str:
        """One clause on the other ranks: those that stopped posting (did not arrive) and where the live ones are."""
        now = time.time()
        stopped, alive = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                key = _KEY.format(r)
                with self._lock:
                    posted = self.store.check([key])
                    value = self.store.get(key) if posted else b""
                if not posted:
                    stopped.append(f"rank {r} (never posted)")
                    continue
                stamp, _, status = value.decode().partition(" ")
                age = now - float(stamp)
            except Exception:
                return "the job's store is unreachable, so which ranks did not arrive is unknown"
            if age > 3 * self.interval_s:
                stopped.append(f"rank {r} (silent for {age:.0f} s, last at {status})")
            else:
                alive.append(f"rank {r} at {status}")
        parts = []
        if stopped:
            parts.append("did not arrive, stopped responding: " + ", ".join(stopped))
        if alive:
            parts.append("alive: " + ", ".join(alive))
        return "; ".join(parts) or "no other rank"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
