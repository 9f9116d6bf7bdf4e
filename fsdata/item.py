"""The loader's one item type: what every stage yields, whatever stages are composed.

    LoaderItem(batch)                                   the reader's local batch
      .report          the balancer's per-step report (Stage III): imbalance before/after, plan measures
      .context         the step's context, built by the ID-prefetch stages (fsembed.context.StepContext: the ids,
                       their exchange in flight, the model's arguments)
      .attention_plan  what the model's attention needs for this batch, built by the attention-plan stage
      .extras          anything a user's own stage attaches, by name

A stage that adds something returns ``dataclasses.replace(item, field=...)`` (or sets the field on the item it
owns), so a consumer reads the same fields however the loader was composed, and an absent stage leaves its
field ``None``.

Attachments. fsdata knows no embedding table and no model: what a stage attaches (``context``,
``attention_plan``) is carried by the later stages through the attachment's own methods, each used where the
attachment has it: ``wait()`` completes work in flight (the device-copy stage calls it in the loader's worker),
``pin_memory()``, ``to(device, non_blocking)`` and ``record_stream(stream)`` move it with its batch, and
``equals(other)`` says whether a resumed loader reproduced it: the :class:`Attachment` protocol, which the
context implements in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol, Union

import torch

from fsdata.batch import Batch


class Attachment(Protocol):
    """What the loader's later stages ask of an attachment they carry (the module's docstring)."""

    def wait(self) -> "Attachment": ...

    def pin_memory(self) -> "Attachment": ...

    def to(self, device: torch.device, non_blocking: bool = True) -> "Attachment": ...

    def record_stream(self, stream) -> None: ...

    def equals(self, other: Any) -> bool: ...


@dataclass
class LoaderItem:
    batch: Batch
    report: Optional[dict] = None
    context: Optional[Attachment] = None  # fsembed.context.StepContext, built by the ID-prefetch stage
    attention_plan: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    def equals(self, other: "LoaderItem") -> bool:
        """Exact equality of the batch and the report, and of the context by its own ``equals`` (for the ids'
        exchange, its layout, not the ids still in flight): what a resumed loader must reproduce."""
        if not isinstance(other, LoaderItem) or not self.batch.equals(other.batch) or self.report != other.report:
            return False
        a, b = self.context, other.context
        if a is None or b is None:
            return a is b
        return a.equals(b)

    def pin_memory(self) -> "LoaderItem":
        """The item with its batch (and the context's and the attention plan's host tensors, where they can be
        pinned) pinned: torchdata's PinMemory node calls this. The other fields pass through as they are."""
        return replace(
            self,
            batch=self.batch.pin_memory(),
            context=pinned(self.context),
            attention_plan=pinned(self.attention_plan),
        )


def pinned(attachment: Any) -> Any:
    """The attachment with its host tensors pinned, where it can be."""
    return attachment.pin_memory() if hasattr(attachment, "pin_memory") else attachment


def moved(attachment: Any, device: torch.device) -> Any:
    """The attachment completed (``wait``) and copied to ``device`` through pinned memory, where it can be."""
    if hasattr(attachment, "wait"):
        attachment = attachment.wait()
    if hasattr(attachment, "pin_memory") and hasattr(attachment, "to"):
        attachment = attachment.pin_memory().to(device, non_blocking=True)
    return attachment


def as_item(item: Union[Batch, LoaderItem]) -> LoaderItem:
    """The item a stage received, as a LoaderItem: a stage composed directly on a reader (which yields plain
    batches) accepts its batches too."""
    if isinstance(item, LoaderItem):
        return item
    if isinstance(item, Batch):
        return LoaderItem(item)
    raise ValueError(f"loader stage: expected an fsdata LoaderItem or Batch, got {type(item).__name__}")
