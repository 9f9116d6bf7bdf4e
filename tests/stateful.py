"""The shared save/load check that every stateful loader stage passes (the torchdata test pattern).

``run_test_save_load_state(make_loader, midpoint)`` checks that a loader built by ``make_loader()`` resumes
exactly: from a midpoint of the first epoch, from a midpoint of a later epoch, from the initial state, and from
the end of an epoch. "Exactly" means every following item is equal field by field (Batch.equals, torch.equal).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fsdata.batch import Batch


def items_equal(a: Any, b: Any) -> bool:
    if isinstance(a, Batch) and isinstance(b, Batch):
        return a.equals(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(items_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(items_equal(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        return all(items_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def assert_items_equal(got: list, expected: list, what: str) -> None:
    assert len(got) == len(expected), f"{what}: {len(got)} items, expected {len(expected)}"
    for i, (x, y) in enumerate(zip(got, expected)):
        assert items_equal(x, y), f"{what}: item {i} differs"


def run_test_save_load_state(make_loader: Callable[[], Any], midpoint: int) -> None:
    first = make_loader()
    epoch0, epoch1 = list(first), list(first)
    assert 0 < midpoint < len(epoch0), f"midpoint {midpoint} must lie inside an epoch of {len(epoch0)} items"

    # 1. Midpoint of the first epoch; the resumed loader then continues into the next epoch.
    loader = make_loader()
    it = iter(loader)
    head = [next(it) for _ in range(midpoint)]
    state = loader.state_dict()
    assert_items_equal(head + list(it), epoch0, "uninterrupted epoch 0")
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert_items_equal(list(resumed), epoch0[midpoint:], "resume at midpoint of epoch 0")
    assert_items_equal(list(resumed), epoch1, "epoch 1 after resuming in epoch 0")

    # 2. Midpoint of a later epoch.
    loader = make_loader()
    list(loader)
    it = iter(loader)
    for _ in range(midpoint):
        next(it)
    state = loader.state_dict()
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert_items_equal(list(resumed), epoch1[midpoint:], "resume at midpoint of epoch 1")

    # 3. The initial state.
    state = make_loader().state_dict()
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert_items_equal(list(resumed), epoch0, "resume from the initial state")

    # 4. The end of an epoch: the resumed loader starts the next epoch.
    loader = make_loader()
    list(loader)
    state = loader.state_dict()
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert_items_equal(list(resumed), epoch1, "resume at the end of epoch 0")
