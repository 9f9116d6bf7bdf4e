"""Pinned host buffers of the host relay, reused across exchanges.

Every exchange through the host relay (fscomm.host_relay) needs a host buffer for what leaves the GPU and one
for what comes back. Pinned (page-locked) memory lets the copy engines move it asynchronously, but allocating it
is slow (cudaHostAlloc takes milliseconds and synchronises the device), so buffers are kept in power-of-two size
classes and reused: after warm-up the number of allocations stays flat (``stats()`` shows it). On a machine
without CUDA the pool hands out ordinary memory, so the same code paths run in CPU tests.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

_MIN_CLASS = 4096


def _size_class(nbytes: int) -> int:
    n = _MIN_CLASS
    while n < nbytes:
        n <<= 1
    return n


class PinnedBuffer:
    """A block of the pool; ``view`` is its first ``nbytes`` bytes (uint8)."""

    __slots__ = ("block", "view")

    def __init__(self, block: torch.Tensor, nbytes: int):
        self.block = block
        self.view = block[:nbytes]


class PinnedPool:
    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._allocations = 0
        self._bytes_reserved = 0
        self._bytes_in_use = 0
        self._acquires = 0
        self._peak_in_use = 0

    def acquire(self, nbytes: int) -> PinnedBuffer:
        size = _size_class(max(int(nbytes), 1))
        with self._lock:
            self._acquires += 1
            free = self._free[size]
            block = free.pop() if free else None
            if block is None:
                self._allocations += 1
                self._bytes_reserved += size
            self._bytes_in_use += size
            self._peak_in_use = max(self._peak_in_use, self._bytes_in_use)
        if block is None:  # allocate outside the lock: pinning is slow
            block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return PinnedBuffer(block, int(nbytes))

    def reserve(self, nbytes: int, count: int) -> None:
        """Makes ``count`` blocks of ``nbytes``' class free in the pool now (at set-up), so that up to
        ``count`` exchanges of that size in flight at once allocate nothing later."""
        held = [self.acquire(nbytes) for _ in range(count)]
        for buf in held:
            self.release(buf)

    def release(self, buf: PinnedBuffer) -> None:
        size = buf.block.numel()
        with self._lock:
            self._free[size].append(buf.block)
            self._bytes_in_use -= size

    def stats(self) -> dict[str, int]:
        """allocations: blocks ever allocated (flat after warm-up); acquires: buffers handed out;
        bytes_reserved / bytes_in_use / peak_bytes_in_use: pool memory."""
        with self._lock:
            return {
                "allocations": self._allocations,
                "acquires": self._acquires,
                "bytes_reserved": self._bytes_reserved,
                "bytes_in_use": self._bytes_in_use,
                "peak_bytes_in_use": self._peak_in_use,
            }
