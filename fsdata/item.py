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

from dataclasses import dataclass, field
from typing import Any, Optional

from fsdata.batch import Batch


@dataclass
class LoaderItem:
    batch: Batch
    report: Optional[dict] = None
    prefetched: Any = None  # fsdata.id_prefetch.PrefetchedIds
    attention_plan: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
