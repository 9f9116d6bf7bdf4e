"""One step, one context: a batch's ids are computed once, by the loader's ID prefetch or, where none runs, by the
step's ``to_device``; they travel in one frozen StepContext to the lookup, and the softmax model's forward
computes none of them again."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from tests.harness import doing, run_ranks


def _id_calls_body(rank, world_size):
    """Counts SoftmaxModel.item_ids calls, in all and inside the model's forward, while TrainStep trains the
    softmax model over every batch of a small source, with and without the loader's ID prefetch."""
    from fsdata import LoaderConfig, build_loader, shutdown_loader
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from pipelines.api.step import TrainStep, wrap_model
    from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

    calls = {"all": 0, "in_forward": 0}
    # The loader's stage worker computes the next batch's ids while the training thread runs this batch's forward:
    # a call counts as the forward's only in the thread that is inside it.
    inside = threading.local()
    item_ids, forward = SoftmaxModel.item_ids, SoftmaxModel.forward

    counting = threading.Lock()

    def counted_item_ids(self, *args, **kwargs):
        with counting:
            calls["all"] += 1
            calls["in_forward"] += getattr(inside, "forward", False)
        return item_ids(self, *args, **kwargs)

    def flagged_forward(self, *args, **kwargs):
        inside.forward = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside.forward = False

    SoftmaxModel.item_ids, SoftmaxModel.forward = counted_item_ids, flagged_forward
    out = {}
    try:
        for mode in ("sync", "sdd", "freescale"):
            doing(mode)
            calls.update({"all": 0, "in_forward": 0})
            source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=48, seed=1, uih_max=16))
            probe = source.read(0, 0, 1)
            torch.manual_seed(0)
            config = SoftmaxConfig(
                num_items=20_000,
                dim=16,
                num_heads=2,
                max_uih=8,
                num_labels=probe.num_labels,
                dense_dim=probe.dense.shape[1],
            )
            model = SoftmaxModel(config)
            wrap = wrap_model(model, embeddings=["item_embedding"], mode=mode, features=model.embedding_ids)
            loader = build_loader(source, LoaderConfig(batch_size=4), rank, world_size, wrap.loader_stages(rank))
            step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=0.01), wrap=wrap)
            items, losses = iter(loader), []
            while step.has_next(items):
                losses.append(step.progress(items).loss)
            shutdown_loader(loader)
            try:  # a swapped module called outside a step's lookup reads no stale rows
                model.item_embedding(torch.arange(3))
                outside = None
            except ValueError as e:
                outside = str(e)
            out[mode] = (len(losses), dict(calls), losses, outside)
    finally:
        SoftmaxModel.item_ids, SoftmaxModel.forward = item_ids, forward
    return out


@pytest.mark.multiprocess
def test_a_batchs_ids_are_computed_once_and_never_in_the_models_forward():
    for out in run_ranks(_id_calls_body, 2, timeout=240):
        for mode, (steps, calls, _, outside) in out.items():
            assert steps == 6, mode
            assert calls == {"all": steps, "in_forward": 0}, (mode, calls)
            assert outside == (
                "embedding wrap: feature 'item_embedding' was looked up by no step: call the model inside "
                "wrap.lookup(context) (TrainStep does)"
            ), mode
        # the same batches, the same losses, whichever stage computed the ids
        assert out["sync"][2] == out["sdd"][2] == out["freescale"][2]


def test_the_step_context_is_frozen_and_takes_the_next_batchs_without_its_lookahead():
    from fsembed.context import StepContext

    first, second, third = (StepContext({"items": torch.arange(n)}) for n in (2, 3, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.ids = {}
    chained = first.with_upcoming(second.with_upcoming(third))
    assert chained.upcoming.ids is second.ids and chained.upcoming.upcoming is None
    assert first.upcoming is None  # a new context, the item's own unchanged
    assert chained.lookup_ids is chained.ids  # no exchange started: the collection exchanges the ids itself
    assert first.equals(StepContext({"items": torch.arange(2)})) and not first.equals(second)
