"""The loader's one item type: what every stage yields, whatever stages are composed.

    LoaderItem(batch)                                   the reader's local batch
      .report          the balancer's per-step report (Stage III): imbalance before/after, plan metrics
      .prefetched      the ID-prefetch stage's exchange in flight (fsdata.id_prefetch.PrefetchedIds)
      .attention_plan  what the model's attention needs for this batch, built by the attention-plan stage
      .extras          anything a user's own stage attaches, by name

A stage that adds something returns ``dataclasses.replace(item, field=...)`` (or sets the field on the item it
owns), so a consumer reads the same fields however the loader was composed, and an absent stage leaves its
field ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch

from fsdata.batch import Batch


@dataclass
class LoaderItem:
    batch: Batch
    report: Optional[dict] = None
    prefetched: Any = None  # fsdata.id_prefetch.PrefetchedIds
    attention_plan: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    def equals(self, other: "LoaderItem") -> bool:
        """Exact equality of the batch and the report, and of the prefetched exchanges' layout (keys, splits,
        permutations; not the ids still in flight): what a resumed loader must reproduce."""
        if not isinstance(other, LoaderItem) or not self.batch.equals(other.batch) or self.report != other.report:
            return False
        a, b = self.prefetched, other.prefetched
        if a is None or b is None:
            return a is b
        return a.keys.keys() == b.keys.keys() and all(
            a[k].send_splits == b[k].send_splits and a[k].recv_splits == b[k].recv_splits
            and torch.equal(a[k].perm.cpu(), b[k].perm.cpu()) for k in a.keys
        )

    def pin_memory(self) -> "LoaderItem":
        """The item with its batch (and the prefetched ids' and the attention plan's host tensors, where they can
        be pinned) pinned: torchdata's PinMemory node calls this. The other fields pass through as they are."""
        prefetched = self.prefetched.pin_memory() if hasattr(self.prefetched, "pin_memory") else self.prefetched
        plan = self.attention_plan.pin_memory() if hasattr(self.attention_plan, "pin_memory") else self.attention_plan
        return replace(self, batch=self.batch.pin_memory(), prefetched=prefetched, attention_plan=plan)


def as_item(item: Union[Batch, LoaderItem]) -> LoaderItem:
    """The item a stage received, as a LoaderItem: a stage composed directly on a reader (which yields plain
    batches) accepts its batches too."""
    if isinstance(item, LoaderItem):
        return item
    if isinstance(item, Batch):
        return LoaderItem(item)
    raise ValueError(f"loader stage: expected an fsdata LoaderItem or Batch, got {type(item).__name__}")
