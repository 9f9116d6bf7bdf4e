"""What the job asks of a model beyond ``forward``: the protocol the softmax model and HSTU implement, and any
model that declares it.

    SequenceRecommender
      .num_items                  rows of the item table (the job refuses or folds ids beyond it: fsdata.id_overflow)
      .embedding_ids(batch)       {module name: ids} of the forward's sharded lookups: the wrap's features, computed
                                  once per batch by the loader's ID-prefetch stage (or the step)
      .needs_plan(device)         whether its attention takes a host-built plan from the loader on ``device``
      .plan_function()            the pure function from a batch's host offsets to that plan
      .attention_impl(device)     its attention's kernel on ``device`` (kernels.impl.Impl; --deterministic checks it)
      forward(batch, attention_plan=None, embedding_ids=None)
                                  ``embedding_ids``: the step's, so the forward computes none of them again

A model without it (a user's own) is trained alike, with the job's defaults: no id range, no plan, and its own
lookup ids computed in its forward.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class SequenceRecommender(Protocol):
    @property
    def num_items(self) -> int: ...

    def embedding_ids(self, batch: Any) -> dict[str, torch.Tensor]: ...

    def needs_plan(self, device: torch.device) -> bool: ...

    def plan_function(self) -> Callable[[torch.Tensor, torch.Tensor], Any]: ...

    def attention_impl(self, device: torch.device) -> Any: ...

    def forward(
        self,
        batch: Any,
        attention_plan: Optional[Any] = None,
        embedding_ids: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> torch.Tensor: ...
