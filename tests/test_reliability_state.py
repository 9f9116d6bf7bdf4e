"""state_dict() is pure (no collective, no change): rank 0 alone may call it; ownership: a trainer built and
closed twice in one process leaves no thread or group behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.fsembed.workload import loss_of, small_plan, step_features
from tests.harness import doing, run_ranks


def _state_dict_on_rank_0_alone(rank, world_size):
    from fsembed.optim import SGD
    from fsembed.prioritized import PrioritizedEmbeddingCollection

    plan = small_plan(world_size)
    feats = [step_features(plan, s, rank, "zipf") for s in range(3)]
    prio = PrioritizedEmbeddingCollection(plan, rank, optimizer=SGD(lr=0.1), seed=1)
    for s in range(2):
        loss_of(prio(feats[s] if s == 0 else None, prio.exchange_ids(feats[s + 1]))).backward()
    refused = None
    if rank == 0:  # the other rank does not take part: a collective here would hang
        doing("state_dict before flush, rank 0 alone")
        try:
            prio.state_dict()
        except ValueError as e:
            refused = str(e)
    doing("flush on every rank")
    prio.flush()
    keys = None
    if rank == 0:
        doing("state_dict after flush, rank 0 alone")
        t0 = time.monotonic()
        state = prio.state_dict()
        extra = state["_extra_state"]
        keys = (sorted(extra), extra["rank"], extra["world_size"], time.monotonic() - t0)
        before = {k: v.clone() for k, v in extra["tables"].items()}
        again = prio.state_dict()["_extra_state"]["tables"]  # changes nothing: the same values twice
        keys += (all(torch.equal(before[k], again[k]) for k in before),)
    doing("barrier")
    torch.distributed.barrier()
    return refused, keys


@pytest.mark.multiprocess
def test_state_dict_on_rank_0_alone_does_not_hang():
    (refused, keys), _ = run_ranks(_state_dict_on_rank_0_alone, 2, timeout=60)
    assert refused is not None and "needs flush() first, called on every rank" in refused
    names, rank, world, seconds, unchanged = keys
    assert names == ["in_flight", "rank", "tables", "world_size"] and (rank, world) == (0, 2) and unchanged


def _build_and_close_twice(rank, world_size):
    from fscomm import groups
    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    before = {t.name for t in threading.enumerate()}
    seen = []
    for attempt in range(2):
        doing(f"attempt {attempt}")
        cfg = tiny_config("freescale", 3)
        with Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as trainer:
            trainer.train()
            seen.append(sorted(t.name for t in threading.enumerate() if t.name not in before))
        time.sleep(0.2)
        left = sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name not in before)
        seen.append((left, groups.live_groups()))
    return seen


@pytest.mark.multiprocess
def test_a_trainer_built_and_closed_twice_leaves_no_threads_or_groups():
    for seen in run_ranks(_build_and_close_twice, 2, timeout=120):
        during, after, during_again, after_again = seen
        assert during and during_again, "the trainer ran no threads of its own?"
        assert after == ([], []) and after_again == ([], []), seen
