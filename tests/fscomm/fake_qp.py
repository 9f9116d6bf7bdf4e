"""An in-memory stand-in for a ring of RC queue pairs (one process, one thread per rank).

It keeps the semantics the ring relies on: receives complete in posting order; a send that finds no posted
receive waits for one (RC with infinite RNR retry); a message longer than the posted receive is an error
(IBV_WC_LOC_LEN_ERR on real hardware); completions carry the received byte count. ``silent`` ranks never send,
as a dead peer would not.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch


class _Endpoint:
    def __init__(self, ring: "FakeRing", rank: int):
        self.ring, self.rank = ring, rank
        self.posted: deque[torch.Tensor] = deque()  # receives waiting for a message
        self.inbox: deque[bytes] = deque()  # messages waiting for a receive
        self.sends_done = 0
        self.recvs_done: list[int] = []
        self.errors: list[str] = []
        self.sends_seen = 0
        self.recvs_seen = 0
        self.registered: list[torch.Tensor] = []

    # RingLink ---------------------------------------------------------------------------------------
    def register(self, block: torch.Tensor) -> None:
        self.registered.append(block)

    def post_recv(self, view: torch.Tensor) -> None:
        with self.ring.cv:
            self.posted.append(view)
            self._match()
            self.ring.cv.notify_all()

    def post_send(self, view: torch.Tensor) -> None:
        right = self.ring.endpoints[(self.rank + 1) % self.ring.world_size]
        with self.ring.cv:
            if self.rank not in self.ring.silent:
                right.inbox.append(bytes(view.numpy().tobytes()))
                right._match()
            self.sends_done += 1
            self.ring.cv.notify_all()

    def wait(self, sends: int, recvs: int, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        with self.ring.cv:
            want_s, want_r = self.sends_seen + sends, self.recvs_seen + recvs
            while self.sends_done < want_s or len(self.recvs_done) < want_r:
                if self.errors:
                    raise RuntimeError(self.errors.pop(0))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"fake ring: rank {self.rank} got no message from rank "
                        f"{(self.rank - 1) % self.ring.world_size} within {timeout_s} s"
                    )
                self.ring.cv.wait(left)
            got = self.recvs_done[self.recvs_seen : want_r]
            self.sends_seen, self.recvs_seen = want_s, want_r
            return got

    # internals ----------------------------------------------------------------------------------------
    def _match(self) -> None:
        while self.posted and self.inbox:
            view, msg = self.posted.popleft(), self.inbox.popleft()
            if len(msg) > view.numel():
                self.errors.append(f"local length error: {len(msg)} bytes into a {view.numel()}-byte receive")
                self.recvs_done.append(-1)
                continue
            if msg:
                view[: len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
            self.recvs_done.append(len(msg))


class FakeRing:
    def __init__(self, world_size: int, silent: tuple[int, ...] = ()):
        self.world_size = world_size
        self.silent = set(silent)
        self.cv = threading.Condition()
        self.endpoints = [_Endpoint(self, r) for r in range(world_size)]

    def run(self, fn, timeout_s: float = 20.0) -> list:
        """Runs ``fn(rank, link)`` on one thread per rank; returns results, or raises the first rank's error."""
        results: list = [None] * self.world_size
        errors: list = [None] * self.world_size

        def body(r: int) -> None:
            try:
                results[r] = fn(r, self.endpoints[r])
            except BaseException as exc:
                errors[r] = exc

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                raise TimeoutError("fake ring: a rank thread hung")
        for r, exc in enumerate(errors):
            if exc is not None:
                raise RuntimeError(f"rank {r}: {exc}") from exc
        return results
