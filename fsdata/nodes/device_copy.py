"""Copies each batch to the GPU ahead of its step: pinned, on a copy stream of its own, in the stage worker.

Placed under ``Background`` (fsdata.loader does so when it trains on CUDA with the stages in the worker thread),
the host work of the copies (pinning, a dozen small copies to queue, the stream bookkeeping) happens while the
previous step computes, instead of between two steps, where the GPU idles until the training thread has queued
them. The training thread does nothing with an item but use it.

Items: LoaderItems (fsdata.item); they come out with the batch on the device. The ID prefetch's exchanges
(``context``) are completed here, the worker waiting for them instead of the step's forward, and come out with
their send permutations and received ids on the device, by the same copies. The other fields (the balancer's
report, an attention plan, extras) pass through untouched.

Streams. The copies run on the copy stream, and the memory they fill is allocated there. Before handing an item
out, the node makes the consumer's stream wait for them (an event, no host wait) and marks every copied tensor
as used by that stream (``record_stream``), so the allocator does not give the memory back while the consumer
still reads it. The consumer's stream is the current stream of the thread that builds the node (the training
thread), unless ``consumer_stream`` names another; work queued on it after the item is handed out is ordered
after the copies. Doing the waits and the copies here, in the worker, keeps them off the training thread, which
would otherwise copy the permutations itself (pageable, on the compute stream) while the GPU waits.

State. The node keeps none and hands its source's state through unchanged (not nested under a key), so a loader
checkpointed on a CPU run resumes on a GPU run and back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Union

import torch
from torchdata.nodes import BaseNode

from fsdata.item import LoaderItem, as_item, moved


class DeviceCopy(BaseNode[Any]):
    def __init__(
        self,
        source: BaseNode[Any],
        device: Union[str, torch.device],
        consumer_stream: Optional["torch.cuda.Stream"] = None,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"DeviceCopy: copies batches to a CUDA device, got {self.device}")
        self.source = source
        self._stream = torch.cuda.Stream(self.device)
        self.consumer_stream = (
            consumer_stream if consumer_stream is not None else torch.cuda.current_stream(self.device)
        )

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> LoaderItem:
        item = as_item(next(self.source))
        with torch.cuda.stream(self._stream):
            batch = item.batch.pin_memory().to(self.device, non_blocking=True)
            # The attachments (fsdata.item): ids in flight are completed here, in the worker, then moved.
            context, plan = moved(item.context, self.device), moved(item.attention_plan, self.device)
        self.consumer_stream.wait_stream(self._stream)
        for t in batch.tensors().values():
            t.record_stream(self.consumer_stream)
        for attachment in (context, plan):
            if hasattr(attachment, "record_stream"):
                attachment.record_stream(self.consumer_stream)
        return replace(item, batch=batch, context=context, attention_plan=plan)

    def get_state(self) -> Dict[str, Any]:
        return self.source.state_dict()
