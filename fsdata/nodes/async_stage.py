"""A loader stage whose exchange runs one step ahead: started on one ``next()``, finished on the following one.

Each call pulls a new item from the source and *starts* its exchange (an asynchronous collective), then
*finishes* the item started on the previous call and returns it. A collective therefore has a whole training
step of compute to complete under, and the wait in ``finish`` is (nearly) free. Chaining stages chains the
lookahead: Stage I, II and III of Algorithm 1 each start one step before the next stage needs them.

Why not a thread per stage: every rank must issue its collectives in the same order. Issued from the one
consumer thread, the order is the program order, identical everywhere; a background thread stopped for a
checkpoint could stop one collective earlier on one rank than on another and hang both.

State: the saved state is the source's state from *before* the pending item was pulled, so a resumed stage
pulls that item again and restarts its exchange: the same items follow, none lost, none repeated.
"""

from __future__ import annotations

from typing import Any, Dict, Generic, Optional, TypeVar

from torchdata.nodes import BaseNode

from fscomm.timing import Timer

In = TypeVar("In")
Started = TypeVar("Started")
Out = TypeVar("Out")


class AsyncStage(BaseNode[Out], Generic[In, Started, Out]):
    SOURCE_KEY = "source"
    #: span name under which ``finish`` (the exposed part of this stage) is timed
    span_name = "stage"

    def __init__(self, source: BaseNode[In], timer: Optional[Timer] = None) -> None:
        super().__init__()
        self.source = source
        self.timer = timer
        #: False: finish each exchange in the call that started it (no item held back). Right when the stage
        #: already runs ahead of the model in a worker thread (fsdata.nodes.background), which absorbs the wait.
        self.lookahead = True
        self._pending: Optional[Started] = None
        self._state_before_pending: Optional[Dict[str, Any]] = None

    def start(self, item: In) -> Started:
        """Issues this stage's exchange for ``item``; must not wait for it."""
        raise NotImplementedError

    def finish(self, started: Started) -> Out:
        """Waits for the exchange of ``started`` and builds the stage's output."""
        raise NotImplementedError

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._pending = None
        self._state_before_pending = None
        self.source.reset(initial_state[self.SOURCE_KEY] if initial_state is not None else None)

    def get_state(self) -> Dict[str, Any]:
        if self._pending is not None:
            return {self.SOURCE_KEY: self._state_before_pending}
        return {self.SOURCE_KEY: self.source.state_dict()}

    def _pull(self) -> tuple[Optional[Started], Dict[str, Any]]:
        before = self.source.state_dict()
        try:
            return self.start(next(self.source)), before
        except StopIteration:
            return None, before

    def next(self) -> Out:
        if not self.lookahead:
            return self._finish(self.start(next(self.source)))
        if self._pending is None:  # first call after a reset: nothing in flight yet
            self._pending, self._state_before_pending = self._pull()
            if self._pending is None:
                raise StopIteration()
        current = self._pending
        self._pending, self._state_before_pending = self._pull()
        return self._finish(current)

    def _finish(self, started: Started) -> Out:
        if self.timer is None:
            return self.finish(started)
        with self.timer.span(self.span_name):
            return self.finish(started)
