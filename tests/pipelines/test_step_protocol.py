"""The step contract (pipelines.models.step_protocol): every step implements Step with one signature, and the one
lookahead loop gives each item once, with the items after it."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from pipelines.api.step import TrainStep
from pipelines.models.step_protocol import Lookahead, Step
from pipelines.models.torchrec_baseline import TorchrecBaseline
from pipelines.models.torchrec_pec import TorchrecPEC

STEPS = (TrainStep, TorchrecBaseline, TorchrecPEC)


def test_every_step_declares_the_protocols_members_with_its_signature():
    wanted = {name: inspect.signature(getattr(Step, name)) for name in ("to_device", "train_on")}
    for cls in STEPS:
        for name, signature in wanted.items():
            assert inspect.signature(getattr(cls, name)) == signature, (cls.__name__, name)
        assert isinstance(cls.lookahead, int) and cls.lookahead >= 1, cls.__name__


def test_the_api_step_is_a_step_at_run_time():
    model = nn.Linear(2, 1)
    step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=0.1), rank=0, world_size=1)
    assert isinstance(step, Step)
    assert not isinstance(object(), Step)


def _items(n):
    it = iter(range(n))
    return it, lambda items: next(items, None)


def test_the_lookahead_gives_every_item_once_with_the_items_after_it():
    for depth in (1, 2):
        items, fetch = _items(5)
        loop = Lookahead(fetch, depth)
        seen = []
        while loop.has_next(items):
            seen.append(loop.advance(items))
        assert seen == [(i, list(range(i + 1, min(i + 1 + depth, 5)))) for i in range(5)], depth


def test_a_limited_lookahead_takes_no_item_beyond_its_limit_and_fetches_inside_the_hook():
    fetched, hooked = [], []
    items = iter(range(100))

    def fetch(it):
        fetched.append(next(it))
        return fetched[-1]

    class Hook:
        def __enter__(self):
            hooked.append(len(fetched))

        def __exit__(self, *exc):
            return False

    loop = Lookahead(fetch, 2, limit=4)
    loop.fill(items)
    assert fetched == [0, 1]
    got = [loop.advance(items, fetching=Hook) for _ in range(4)]
    assert got == [(0, [1, 2]), (1, [2, 3]), (2, [3]), (3, [])]
    assert fetched == [0, 1, 2, 3] and hooked == [2, 3, 4, 4]
    assert not loop.has_next(items)
