"""Copies each batch to the GPU ahead of its step: pinned, on a copy stream of its own, in the stage worker.

Placed under ``Background`` (fsdata.loader does so when it trains on CUDA with the stages in the worker thread),
the host work of the copies (pinning, a dozen small copies to queue) happens while the previous step computes,
instead of between two steps, where the GPU idles until the training thread has queued them. The stage worker
already holds the next batch when the training thread asks for it.

Items: a Batch, or a tuple whose first element is the Batch (the balancer's metrics and the ID prefetch's
exchanges pass through untouched). The node returns a tuple: the batch on the device, the other parts, and a
:class:`DeviceReady` last.

Streams. The copies' device memory is allocated on the copy stream. Before the batch's first use the consumer
calls ``ready.wait()``: its stream waits for the copies, and every tensor is marked as used by that stream
(``record_stream``), so the allocator does not give the memory back to the copy stream while the step still
reads it.

State. The node keeps none and hands its source's state through unchanged (not nested under a key), so a loader
checkpointed on a CPU run resumes on a GPU run and back.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch
from torchdata.nodes import BaseNode

from fsdata.batch import Batch


class DeviceReady:
    """The copies of one batch: ``wait()`` orders the current stream after them (no host wait)."""

    def __init__(self, event: "torch.cuda.Event", tensors: list[torch.Tensor], device: torch.device) -> None:
        self.event, self.tensors, self.device = event, tensors, device

    def wait(self) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in self.tensors:
            t.record_stream(stream)


class DeviceCopy(BaseNode[tuple]):
    def __init__(self, source: BaseNode[Any], device: Union[str, torch.device]) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"DeviceCopy: copies batches to a CUDA device, got {self.device}")
        self.source = source
        self._stream = torch.cuda.Stream(self.device)

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> tuple:
        item = next(self.source)
        parts = item if isinstance(item, tuple) else (item,)
        batch = parts[0]
        if not isinstance(batch, Batch):
            raise ValueError(f"DeviceCopy: expected a Batch (or a tuple starting with one), got {type(batch).__name__}")
        with torch.cuda.stream(self._stream):
            moved = batch.pin_memory().to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return (moved, *parts[1:], DeviceReady(event, list(moved.tensors().values()), self.device))

    def get_state(self) -> Dict[str, Any]:
        return self.source.state_dict()
