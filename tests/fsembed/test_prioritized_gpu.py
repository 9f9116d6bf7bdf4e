"""Prioritized updates on CUDA: bit-exact with the synchronous path, with the side stream in use.

Both ranks share GPU 0 (one GPU suffices) and talk through the host transport. scripts/gpu_suite.sh runs this
file under TORCH_CUDA_SANITIZER=1, which turns an unordered access of one tensor from two streams (the side
stream's deferred update or early lookup against the compute stream's collision update) into an error in the
rank that made it, so the test fails."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fsembed.workload import loss_of, small_plan, step_features
from tests.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

STEPS = 6


def _parity(rank, world_size, collision, schedules=None, exclusive_start="backward"):
    """``schedules``: the prioritized collection's schedule per step (set_schedule between steps);
    ``exclusive_start``: the prioritized collection's (fsembed.prioritized)."""
    from fsembed.optim import RowWiseAdagrad
    from fsembed.prioritized import PrioritizedEmbeddingCollection
    from fsembed.sharded import ShardedEmbeddingCollection

    dev = torch.device("cuda", 0)
    plan = small_plan(world_size)
    feats = [{k: v.to(dev) for k, v in step_features(plan, s, rank, collision).items()} for s in range(STEPS)]
    runs = {}
    for name, cls in (("sync", ShardedEmbeddingCollection), ("prio", PrioritizedEmbeddingCollection)):
        extra = {"exclusive_start": exclusive_start} if cls is PrioritizedEmbeddingCollection else {}
        coll = cls(plan, rank, optimizer=RowWiseAdagrad(lr=0.1), seed=1, device=dev, **extra)
        assert cls is ShardedEmbeddingCollection or coll._stream is not None, "no side stream on CUDA"
        losses, nxt = [], coll.exchange_ids(feats[0])
        for s in range(STEPS):
            if schedules is not None and cls is PrioritizedEmbeddingCollection:
                coll.set_schedule(schedules[s])
            cur, nxt = nxt, (coll.exchange_ids(feats[s + 1]) if s + 1 < STEPS else None)
            loss = loss_of(coll(cur, nxt))
            loss.backward()
            losses.append(loss.detach())
        runs[name] = (losses, coll.full_tables(), dict(getattr(coll, "row_counts", {})))
    torch.cuda.synchronize()
    (ls, ts, _), (lp, tp, counts) = runs["sync"], runs["prio"]
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(ls, lp)),
        "tables_equal": all(torch.equal(ts[k], tp[k]) for k in ts),
        "row_counts": counts,
        "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER", ""),
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("collision", ["zipf", "none"])
def test_prioritized_matches_sync_on_cuda(collision):
    results = run_ranks(_parity, 2, args=(collision,), timeout=240)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["tables_equal"], f"rank {rank}: prioritized differs from sync on CUDA: {r}"
    counts = [r["row_counts"] for r in results]
    assert sum(c["early"] for c in counts) > 0 and sum(c["deferred"] for c in counts) > 0, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_schedule_switches_match_sync_on_cuda():
    """prioritized -> sdd (flush, the side stream joined) -> prioritized (a synchronous first step) on CUDA."""
    p, d = "prioritized", "sdd"
    results = run_ranks(_parity, 2, args=("zipf", [p, p, d, d, p, p]), timeout=240)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["tables_equal"], f"rank {rank}: a schedule switch differs from sync on CUDA: {r}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exclusive_gradients_held_for_the_next_forward_match_sync_on_cuda():
    """exclusive_start="forward": the deferred gradients leave on the side stream one forward later, through a
    schedule switch too."""
    p, d = "prioritized", "sdd"
    results = run_ranks(_parity, 2, args=("zipf", [p, p, p, d, p, p], "forward"), timeout=240)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["tables_equal"], f"rank {rank}: held exclusive gradients differ from sync: {r}"
