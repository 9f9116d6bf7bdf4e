"""Batch <-> samples <-> KeyedJaggedTensor round trips, and Batch movement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdata.batch import Batch, Sample


@st.composite
def samples(draw, with_side: bool = True):
    n = draw(st.integers(0, 6))
    labels = draw(st.integers(1, 3))
    dense = draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    out = []
    for i in range(n):
        length = int(rng.integers(0, 9))
        cands = int(rng.integers(0, 4))
        out.append(
            Sample(
                sample_id=1000 + i,
                user_id=int(rng.integers(0, 50)),
                uih_item_ids=rng.integers(0, 10**12, length),
                candidate_labels=rng.random((cands, labels), dtype=np.float32),
                content_ids=[rng.integers(0, 10**6, int(rng.integers(0, 4))) for _ in range(cands)],
                dense=rng.random(dense, dtype=np.float32),
                uih_action_types=rng.integers(0, 5, length) if with_side else None,
                uih_timestamps=np.sort(rng.integers(0, 10**9, length)) if with_side else None,
            )
        )
    return out, labels, dense


def _same_samples(a: list[Sample], b: list[Sample]) -> bool:
    def key(s: Sample):
        return (
            s.sample_id,
            s.user_id,
            s.uih_item_ids.tolist(),
            s.candidate_labels.tolist(),
            [c.tolist() for c in s.content_ids],
            s.dense.tolist(),
            None if s.uih_action_types is None else s.uih_action_types.tolist(),
            None if s.uih_timestamps is None else s.uih_timestamps.tolist(),
        )

    return [key(s) for s in a] == [key(s) for s in b]


@settings(max_examples=60, deadline=None)
@given(samples(), st.booleans())
def test_samples_round_trip(drawn, _):
    items, labels, dense = drawn
    batch = Batch.from_samples(items, num_labels=labels, dense_dim=dense)
    assert batch.batch_size == len(items)
    assert _same_samples(batch.to_samples(), items)
    assert batch.uih_lengths.tolist() == [s.uih_length for s in items]
    assert batch.num_candidates.tolist() == [s.num_candidates for s in items]


@settings(max_examples=60, deadline=None)
@given(samples(), st.booleans())
def test_kjt_round_trip_is_lossless(drawn, with_side):
    items, labels, dense = drawn
    if not with_side:
        for s in items:
            s.uih_action_types = s.uih_timestamps = None
    batch = Batch.from_samples(items, num_labels=labels, dense_dim=dense)
    kjt = batch.to_kjt()
    assert kjt.stride() == batch.batch_size
    back = Batch.from_kjt(
        kjt,
        sample_ids=batch.sample_ids,
        user_ids=batch.user_ids,
        candidate_labels=batch.candidate_labels,
        dense=batch.dense,
    )
    assert back.equals(batch)


def test_concat_and_move():
    rng = np.random.default_rng(0)
    items = [
        Sample(i, i, rng.integers(0, 9, i + 1), np.ones((1, 1), np.float32), [np.arange(2)], np.zeros(2, np.float32))
        for i in range(4)
    ]
    whole = Batch.from_samples(items)
    parts = Batch.concat([Batch.from_samples(items[:1]), Batch.from_samples(items[1:])])
    assert parts.equals(whole)
    assert whole.to("cpu").equals(whole)
    if torch.cuda.is_available():
        assert whole.pin_memory().to("cuda").to("cpu").equals(whole)


def test_side_features_must_be_all_or_none():
    a = Sample(1, 1, np.arange(2), np.ones((1, 1), np.float32), [np.arange(1)], np.zeros(1, np.float32), np.arange(2))
    b = Sample(2, 1, np.arange(2), np.ones((1, 1), np.float32), [np.arange(1)], np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="sample 2"):
        Batch.from_samples([a, b])


def test_extra_features_round_trip_through_samples_concat_kjt_and_devices():
    """A user's extra jagged and dense fields survive every form a batch takes."""
    from fsdata.batch import Jagged

    def sample(i):
        return Sample(
            i,
            i,
            np.arange(i + 1),
            np.zeros((2, 1), np.float32),
            [np.arange(2), np.arange(1)],
            np.zeros(3, np.float32),
            extra_jagged={"category_ids": np.arange(i, dtype=np.int64)},
            extra_dense={"age": np.array([float(i)], np.float32)},
        )

    batch = Batch.from_samples([sample(i) for i in range(4)])
    assert batch.extra_jagged["category_ids"].offsets.tolist() == [0, 0, 1, 3, 6]
    assert Batch.from_samples(batch.to_samples()).equals(batch)
    both = Batch.concat([batch, batch])
    assert both.extra_jagged["category_ids"].lengths.tolist() == [0, 1, 2, 3] * 2 and both.extra_dense["age"].shape == (
        8,
        1,
    )
    moved = batch._map(torch.clone)  # what to() / pin_memory() do to every tensor, the extras' included
    assert (
        moved.equals(batch)
        and moved.extra_jagged["category_ids"].values is not batch.extra_jagged["category_ids"].values
    )
    assert "extra_jagged.category_ids.values" in batch.tensors() and "extra_dense.age" in batch.tensors()
    with pytest.raises(ValueError, match="offsets must be int64"):
        Batch(
            **{
                **{
                    f: getattr(batch, f)
                    for f in (
                        "sample_ids",
                        "user_ids",
                        "uih_offsets",
                        "uih_item_ids",
                        "candidate_offsets",
                        "candidate_labels",
                        "content_offsets",
                        "content_ids",
                        "dense",
                    )
                },
                "extra_jagged": {"bad": Jagged(torch.arange(3), torch.tensor([0, 3]))},
            }
        )
    with pytest.raises(ValueError, match="differ from the first sample"):
        Batch.from_samples(
            [
                sample(0),
                Sample(1, 1, np.arange(2), np.zeros((1, 1), np.float32), [np.arange(1)], np.zeros(3, np.float32)),
            ]
        )


def test_extra_jagged_fields_are_kjt_keys():
    pytest.importorskip("torchrec")
    from fsdata.batch import Jagged

    batch = Batch.from_samples(
        [
            Sample(i, i, np.arange(i + 1), np.zeros((1, 1), np.float32), [np.arange(2)], np.zeros(2, np.float32))
            for i in range(3)
        ]
    )
    batch.extra_jagged = {"tags": Jagged.from_lengths(torch.arange(5), [2, 0, 3])}
    kjt = batch.to_kjt()
    assert "tags" in kjt.keys()
    back = Batch.from_kjt(
        kjt,
        sample_ids=batch.sample_ids,
        user_ids=batch.user_ids,
        candidate_labels=batch.candidate_labels,
        dense=batch.dense,
    )
    assert back.equals(batch)
