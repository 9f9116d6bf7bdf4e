"""The attention-plan stage: runs the given plan function on each batch's host offsets, sets item.attention_plan,
keeps no state of its own (exact resume), refuses items that are not LoaderItems."""

from __future__ import annotations

import pytest
import torch
from torchdata.nodes import BaseNode, Loader

from fsdata.item import LoaderItem
from fsdata.nodes.attention_plan import AttentionPlanStage
from fsdata.nodes.background import Background
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from pipelines.models.softmax import attention_plan
from tests.stateful import run_test_save_load_state


class AsItems(BaseNode):
    """The reader's batches as LoaderItems (what every loader stage yields)."""

    def __init__(self, source):
        super().__init__()
        self.source = source

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        return LoaderItem(next(self.source))

    def get_state(self):
        return self.source.state_dict()


def _items():
    return AsItems(
        GlobalBatchReader(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=40, seed=3)), 4, 0, 1)
    )


def _plan_fn(uih_offsets, candidate_offsets):
    return attention_plan(uih_offsets, candidate_offsets, max_uih=64)


def test_each_item_carries_the_plan_of_its_own_batch():
    items = list(Loader(AttentionPlanStage(_items(), _plan_fn)))
    assert len(items) == 10
    for item in items:
        expected = _plan_fn(item.batch.uih_offsets, item.batch.candidate_offsets)
        for got, want in ((item.attention_plan.uih, expected.uih), (item.attention_plan.target, expected.target)):
            assert (got.num_q, got.num_kv) == (want.num_q, want.num_kv)
            assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(), want.tensors().values()))
        kept = (item.batch.uih_lengths.clamp(max=64)).sum()
        assert item.attention_plan.uih.num_q == int(kept)


def test_the_stage_resumes_exactly_under_the_stage_worker():
    run_test_save_load_state(lambda: Loader(Background(AttentionPlanStage(_items(), _plan_fn))), midpoint=4)


def test_a_source_of_bare_batches_is_refused():
    reader = GlobalBatchReader(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=8, seed=3)), 4, 0, 1)
    with pytest.raises(ValueError, match="expected a LoaderItem"):
        next(iter(Loader(AttentionPlanStage(reader, _plan_fn))))
    with pytest.raises(ValueError, match="plan_fn must be callable"):
        AttentionPlanStage(_items(), None)
