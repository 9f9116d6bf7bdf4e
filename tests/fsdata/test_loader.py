"""The reader node and the composed loader: global cursor, uneven last batch, exact resume, world-size change."""

from __future__ import annotations

import pytest

from fsdata.loader import LoaderConfig, build_loader
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from tests.stateful import run_test_save_load_state


def _source(n=50):
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=n, seed=7))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_resumes_exactly(prefetch):
    source = _source()
    run_test_save_load_state(lambda: build_loader(source, LoaderConfig(batch_size=4, prefetch_depth=prefetch), 1, 3), 2)


def test_every_rank_takes_the_same_steps_and_nothing_is_dropped():
    source, world, b = _source(50), 3, 4
    per_rank = [
        list(build_loader(source, LoaderConfig(batch_size=b, prefetch_depth=0), r, world)) for r in range(world)
    ]
    assert len({len(x) for x in per_rank}) == 1  # ceil(50 / 12) = 5 steps everywhere
    assert len(per_rank[0]) == 5
    ids = sorted(i for items in per_rank for item in items for i in item.batch.sample_ids.tolist())
    assert ids == sorted(source.read(0, 0, 50).sample_ids.tolist())
    assert [len(item.batch) for item in per_rank[2]][
        -1
    ] == 0  # the last global batch holds 2 samples: rank 2's is empty


def test_cursor_resumes_on_another_world_size():
    """Stop after 2 steps on 2 ranks, resume on 3: the union of what follows is the rest of the epoch."""
    source, b = _source(50), 4
    loaders = [build_loader(source, LoaderConfig(batch_size=b, prefetch_depth=0), r, 2) for r in range(2)]
    seen = []
    for loader in loaders:
        it = iter(loader)
        seen += [i for _ in range(2) for i in next(it).batch.sample_ids.tolist()]
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict()  # the cursor is global, not per rank
    rest = []
    for r in range(3):
        loader = build_loader(source, LoaderConfig(batch_size=b, prefetch_depth=0), r, 3)
        loader.load_state_dict(state)
        rest += [i for item in loader for i in item.batch.sample_ids.tolist()]
    assert sorted(seen + rest) == sorted(source.read(0, 0, 50).sample_ids.tolist())


def test_epochs_differ_and_count():
    source = _source(8)
    reader = GlobalBatchReader(source, batch_size=4, rank=0, world_size=1)
    loader = build_loader(source, LoaderConfig(batch_size=4, prefetch_depth=0), 0, 1)
    first, second = list(loader), list(loader)
    assert not first[0].batch.equals(second[0].batch)
    assert loader.state_dict()  # holds the epoch counter
    reader.reset()
    assert reader.get_state() == {"epoch": 0, "cursor": 0}


@pytest.mark.parametrize(
    "kwargs", [dict(batch_size=0), dict(batch_size=2, prefetch_depth=-1), dict(batch_size=2, worker_start="forward")]
)
def test_bad_loader_config(kwargs):
    with pytest.raises(ValueError):
        build_loader(_source(), LoaderConfig(**kwargs), 0, 1)


@pytest.mark.parametrize(
    "worker_start, pin_memory, gated",
    [
        (None, False, False),
        ("take", False, False),
        ("backward", False, True),
        ("backward", True, False),  # PinMemory's own thread takes the items: a gate would only race it
    ],
)
def test_which_stage_worker_is_gated(worker_start, pin_memory, gated, monkeypatch):
    import fsdata.loader
    from fsdata.loader import _workers

    monkeypatch.setattr(fsdata.loader, "PinMemory", lambda node: node)  # torchdata's needs a CUDA build
    config = LoaderConfig(batch_size=2, prefetch_depth=0, worker_start=worker_start, pin_memory=pin_memory)
    (worker,) = _workers(build_loader(_source(), config, 0, 1, stages=[lambda node: node]))
    assert worker.gated is gated


def test_bad_rank():
    with pytest.raises(ValueError, match="rank 3"):
        GlobalBatchReader(_source(), 2, rank=3, world_size=2)


def test_device_copy_needs_a_cuda_device():
    from fsdata.nodes.device_copy import DeviceCopy

    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        DeviceCopy(GlobalBatchReader(_source(), 2, rank=0, world_size=1), "cpu")


def test_the_loader_yields_loader_items_whatever_is_composed():
    from fsdata.item import LoaderItem, as_item

    source = _source(20)
    plain = list(build_loader(source, LoaderConfig(batch_size=4, prefetch_depth=1), 0, 2))
    staged = list(build_loader(source, LoaderConfig(batch_size=4, prefetch_depth=1), 0, 2, stages=[lambda node: node]))
    for items in (plain, staged):
        assert all(isinstance(item, LoaderItem) and item.report is None and item.context is None for item in items)
    assert all(a.equals(b) for a, b in zip(plain, staged)) and len(plain) == len(staged) == 3
    assert as_item(plain[0].batch).batch is plain[0].batch and as_item(plain[0]) is plain[0]
    with pytest.raises(ValueError, match="expected an fsdata LoaderItem or Batch"):
        as_item((plain[0].batch, {}))


@pytest.mark.parametrize("background", [False, True])
def test_shutdown_ends_every_thread_the_loader_started(background):
    """A read-ahead thread left running at exit can abort the process mid C++ op: none may outlive shutdown."""
    import threading

    from fsdata.loader import shutdown_loader

    before = set(threading.enumerate())
    config = LoaderConfig(batch_size=4, prefetch_depth=2, background_stages=background)
    loader = build_loader(_source(200), config, 0, 1)
    items = iter(loader)
    next(items), next(items)
    assert set(threading.enumerate()) - before, "the loader started no thread: nothing is tested"
    shutdown_loader(loader)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def test_a_trainer_runs_the_loader_with_its_worker_started_at_the_backward_and_pinned_batches_on_cuda():
    config = LoaderConfig(batch_size=4)
    cpu, cuda = config.for_trainer("cpu"), config.for_trainer("cuda")
    assert (cpu.worker_start, cpu.pin_memory) == ("backward", False)
    assert (cuda.worker_start, cuda.pin_memory) == ("backward", True)
    assert LoaderConfig(worker_start="take").for_trainer("cuda").worker_start == "take"  # what the job set, kept
    assert (config.worker_start, config.pin_memory) == (None, False)  # a copy: the job's section is left as it was
