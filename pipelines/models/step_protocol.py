"""The step contract: what `freescale train`'s trainer asks of a step, and the one lookahead loop that feeds it.

    Step         the protocol every step implements (the API's TrainStep, pipelines.api.step; the torchrec
                 baseline's and PEC's, pipelines.models.torchrec_baseline and torchrec_pec): ``lookahead`` items it
                 takes beyond the current one, ``to_device(item)``, ``train_on(item, upcoming) -> StepResult``
    Lookahead    the loop of current item and the ``lookahead`` items after it: TrainStep.progress runs it, and the
                 trainer drives it with its own fetch and a context around each fetch (its timings)

It lives below both kinds of step (a package imports only the ones below it), beside StepResult.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import (
    Any,
    Callable,
    ContextManager,
    Generic,
    Iterator,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    runtime_checkable,
)

from fsdata.item import LoaderItem
from pipelines.models.step_result import StepResult

T = TypeVar("T")


@runtime_checkable
class Step(Protocol):
    """One training step over the loader's items, whatever runs it."""

    #: items it takes beyond the current one (1: batch i+1's ids go to step i's forward; 2 for torchrec's pipeline)
    lookahead: int
    #: the dense optimizer (what a checkpoint saves)
    optimizer: Any
    #: the dense gradients' all-reduce (pipelines.api.dense_sync.DenseSync), None where the step's own DDP runs it
    dense_sync: Any

    def to_device(self, item: LoaderItem) -> LoaderItem:
        """The item with what the step reads moved to the step's device."""
        ...

    def train_on(self, item: LoaderItem, upcoming: Sequence[LoaderItem] = ()) -> StepResult:
        """One step on ``item``; ``upcoming``: the ``lookahead`` items after it (fewer at the end)."""
        ...


class Lookahead(Generic[T]):
    """The current item and the ``depth`` items after it, taken by ``fetch(items)`` (None: the items are exhausted).

    ``limit``: the most items it takes in all (the steps left to train), None: until ``fetch`` returns None."""

    def __init__(self, fetch: Callable[[Iterator], Optional[T]], depth: int, limit: Optional[int] = None) -> None:
        self.fetch, self.depth, self.limit = fetch, depth, limit
        self._ahead: Optional[deque[T]] = None
        self._taken = 0
        self._exhausted = False

    def _pull(self, items: Iterator) -> None:
        if self._exhausted or (self.limit is not None and self._taken >= self.limit):
            return
        item = self.fetch(items)
        if item is None:
            self._exhausted = True
            return
        self._taken += 1
        self._ahead.append(item)

    def fill(self, items: Iterator) -> None:
        """Takes the first items (the current one's lookahead), once."""
        if self._ahead is None:
            self._ahead = deque()
            for _ in range(max(self.depth, 1)):
                self._pull(items)

    def has_next(self, items: Iterator) -> bool:
        """Whether :meth:`advance` has an item to give (takes the first items on the first call)."""
        self.fill(items)
        return bool(self._ahead)

    def advance(
        self, items: Iterator, fetching: Callable[[], ContextManager] = contextlib.nullcontext
    ) -> tuple[T, list[T]]:
        """The next current item and the items after it, having taken one more inside ``fetching()``; raises
        StopIteration when there is none."""
        if not self.has_next(items):
            raise StopIteration
        current = self._ahead.popleft()
        with fetching():
            self._pull(items)
        return current, list(self._ahead)
