"""The attention-plan stage: runs the model's plan function on each batch's offsets, and attaches the result.

A jagged attention needs, per batch, the block masks of its samples (kernels.flex.block_mask): O(blocks) host work
that depends only on the batch's offsets, known once the shuffle has fixed the local batch. Placed after the
balancer's and ID prefetch's stages, under the stage worker (fsdata.nodes.background), it builds the plan for a
batch ahead while the current step computes, so the training thread never builds a mask.

fsdata does not import the model: the stage runs the function it is given, ``plan_fn(uih_offsets,
candidate_offsets)`` (host int64 tensors), for instance ``SoftmaxModel.plan_function()``, and sets
``item.attention_plan`` to what it returns. The result travels to the device with the batch: the device-copy stage
pins it and copies it on its copy stream when it has ``pin_memory()`` and ``to(device, non_blocking)`` (the
softmax model's ``AttentionPlan`` is a dataclass of tensors that has both, and ``record_stream``).

State. The stage keeps none: a plan is a pure function of its batch, so the source's state passes through
unchanged (not nested under a key) and a resumed loader builds the same plans.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional

import torch
from torchdata.nodes import BaseNode

from fsdata.item import LoaderItem

PlanFn = Callable[[torch.Tensor, torch.Tensor], Any]


class AttentionPlanStage(BaseNode[LoaderItem]):
    def __init__(self, source: BaseNode[LoaderItem], plan_fn: PlanFn) -> None:
        super().__init__()
        if not callable(plan_fn):
            raise ValueError(f"AttentionPlanStage: plan_fn must be callable, got {type(plan_fn).__name__}")
        self.source = source
        self.plan_fn = plan_fn

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> LoaderItem:
        item = next(self.source)
        if not isinstance(item, LoaderItem):
            raise ValueError(f"AttentionPlanStage: expected a LoaderItem from its source, got {type(item).__name__}")
        batch = item.batch
        plan = self.plan_fn(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets"))
        return dataclasses.replace(item, attention_plan=plan)

    def get_state(self) -> Dict[str, Any]:
        return self.source.state_dict()
