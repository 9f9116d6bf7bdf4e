"""The batch stage: turns a source's global sample sequence into this rank's local batches.

Global step ``s`` of an epoch covers global samples ``[s*B*W, (s+1)*B*W)``; rank ``r`` reads the contiguous
slice ``[s*B*W + r*B, s*B*W + (r+1)*B)``, clipped to the epoch's end. The last global batch of an epoch may
therefore be short or empty on some ranks: nothing is dropped, and every rank takes the same number of steps
(so no rank waits forever in a collective). The state is ``{epoch, cursor}``, where the cursor counts the
global samples of the epoch consumed by *all* ranks: it does not depend on the world size, so a job stopped on
W ranks resumes on W' ranks at the same sample.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torchdata.nodes import BaseNode

from fsdata.batch import Batch
from fsdata.source import SampleSource


class GlobalBatchReader(BaseNode[Batch]):
    EPOCH_KEY = "epoch"
    CURSOR_KEY = "cursor"

    def __init__(
        self,
        source: SampleSource,
        batch_size: int,
        rank: int,
        world_size: int,
        start: Optional[Dict[str, int]] = None,
    ) -> None:
        """``start``: ``{epoch, cursor}`` to begin from (e.g. a checkpoint of a run on another world size)."""
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        self.source = source
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self._start = dict(start) if start is not None else {self.EPOCH_KEY: 0, self.CURSOR_KEY: 0}
        if set(self._start) != {self.EPOCH_KEY, self.CURSOR_KEY}:
            raise ValueError(
                f"GlobalBatchReader start must hold exactly 'epoch' and 'cursor', got {sorted(self._start)}"
            )
        self._epoch = int(self._start[self.EPOCH_KEY])
        self._cursor = int(self._start[self.CURSOR_KEY])
        self._started = False

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._epoch = int(initial_state[self.EPOCH_KEY])
            self._cursor = int(initial_state[self.CURSOR_KEY])
        elif self._started:  # a plain reset after a (possibly partial) epoch starts the next epoch
            self._epoch += 1
            self._cursor = 0
        else:
            self._epoch = int(self._start[self.EPOCH_KEY])
            self._cursor = int(self._start[self.CURSOR_KEY])
        self._started = True

    def next(self) -> Batch:
        n = self.source.num_samples(self._epoch)
        if self._cursor >= n:
            raise StopIteration()
        start = min(self._cursor + self.rank * self.batch_size, n)
        stop = min(start + self.batch_size, n)
        batch = self.source.read(self._epoch, start, stop)
        self._cursor = min(self._cursor + self.global_batch_size, n)
        return batch

    def get_state(self) -> Dict[str, Any]:
        return {self.EPOCH_KEY: self._epoch, self.CURSOR_KEY: self._cursor}
