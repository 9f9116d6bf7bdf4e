"""The loader's ID-prefetch stage (fsembed/id_prefetch.py) built from fsembed's sharding plan: it computes each
batch's ids once and they travel on the item, shard-major ids arrive on their owners, exactly once, and the stage
resumes exactly (the shared save/load check)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("torchdata")


def _plan(world_size):
    from fsembed.plan import ShardingPlan, TableConfig

    return ShardingPlan(
        [TableConfig("items", 500, 8, ("uih", "cand")), TableConfig("users", 50, 4, ("user",))], world_size
    )


def _ids(batch):
    return {"uih": batch.uih_item_ids % 500, "cand": batch.content_ids % 500, "user": batch.user_ids % 50}


def _features(batch):  # the stage's: counted
    _features.calls += 1
    return _ids(batch)


_features.calls = 0


def _make_loader(rank, world_size, transport):
    from torchdata.nodes import Loader, Mapper

    from fsdata.nodes.reader import GlobalBatchReader
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from fsembed.id_prefetch import id_prefetch_stages

    plan = _plan(world_size)
    source = SyntheticSource(SyntheticConfig(num_samples=37, seed=4, collision_block_size=8))
    node = GlobalBatchReader(source, 4, rank, world_size)
    for wrap in id_prefetch_stages(plan, transport, _features, rank):
        node = wrap(node)

    def settle(item):  # comparable items: the batch, its ids, and every key's shard-major ids and splits
        batch, context = item.batch, item.context
        keyed = {
            k: (s.wait(), s.send_splits, s.recv_splits, s.perm, s.recv_offsets)
            for k, s in context.exchange.keys.items()
        }
        return batch, context.ids, keyed

    return Loader(Mapper(node, settle))


def _body(rank, world_size):
    from fsembed.transports import embedding_transports
    from tests.stateful import run_test_save_load_state

    transport = embedding_transports().forward
    plan = _plan(world_size)
    doing("one epoch")
    sent = received = batches = 0
    owned = True
    for batch, features, keyed in _make_loader(rank, world_size, transport):
        batches += 1
        owned &= all(torch.equal(features[k], v) for k, v in _ids(batch).items())  # what the step hands on
        stacked = plan.stack_ids(features)
        for g in plan.groups:
            ids, send, recv, perm, recv_offsets = keyed[g.name]
            # the stage brings the receive offsets along, so the embedding exchanges need not build them per step
            owned &= recv_offsets.tolist() == [0, *torch.tensor(recv).cumsum(0).tolist()]
            sent += stacked[g.name][0].numel()
            received += ids.numel()
            lo, hi = int(g.boundaries[rank]), int(g.boundaries[rank + 1])
            owned &= bool(((ids >= lo) & (ids < hi)).all())
            # batch-major side: perm groups the ids by owning shard, send_splits counts them
            dest = torch.bucketize(stacked[g.name][0][perm], g.boundaries[1:], right=True)
            owned &= torch.equal(dest, torch.repeat_interleave(torch.arange(world_size), torch.tensor(send)))
    owned &= _features.calls == batches  # each batch's ids computed once, in the stage
    doing("save/load")
    run_test_save_load_state(lambda: _make_loader(rank, world_size, transport), midpoint=2)
    return sent, received, owned


def test_id_prefetch_delivers_ids_to_owners_and_resumes():
    results = run_ranks(_body, 2, timeout=90)
    assert sum(r[0] for r in results) == sum(r[1] for r in results) > 0
    assert all(r[2] for r in results)


def test_prefetched_ids_wait_keeps_the_results_for_the_later_copies():
    """What the device copy relies on: after ``wait()`` the results are held (waited once), listed by
    ``tensors()``, and travel with ``pin_memory``/``to``."""
    from fsembed.id_prefetch import PrefetchedIds, ShardedIds

    class _Handle:
        calls = 0

        def wait(self):
            _Handle.calls += 1
            return torch.arange(3)

    ids = PrefetchedIds({"g": ShardedIds("g", 2, [2], torch.tensor([1, 0]), [2], [3], _Handle())})
    assert len(ids.tensors()) == 1  # the permutation only: the result is still in flight
    assert ids.wait() is ids and _Handle.calls == 1
    held = ids.to("cpu")
    assert len(held.tensors()) == 2 and torch.equal(held["g"].wait(), torch.arange(3)) and _Handle.calls == 1
    # built without the stage's receive offsets (e.g. restored from a checkpoint): made on first use, then kept
    offsets = held["g"].recv_offsets_on("cpu")
    assert offsets.tolist() == [0, 3] and held["g"].recv_offsets_on("cpu") is offsets and len(held.tensors()) == 3
