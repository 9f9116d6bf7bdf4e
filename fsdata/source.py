"""The source protocol: random access to an epoch's global sample sequence.

A source knows nothing of ranks. The loader's reader node (fsdata.nodes.reader) owns the cursor and asks each
source for the global index range a rank needs, so the saved position is world-size independent.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fsdata.batch import Batch


@runtime_checkable
class SampleSource(Protocol):
    def num_samples(self, epoch: int) -> int:
        """Number of global samples in ``epoch``."""

    def read(self, epoch: int, start: int, stop: int) -> Batch:
        """Global samples ``[start, stop)`` of ``epoch``, in order (an empty Batch when start == stop)."""

    def describe(self) -> str:
        """One line for logs: what this source reads."""
