"""Prioritized updates across a checkpoint and around evaluation: the continuation is identical."""

from __future__ import annotations

import pytest
import torch

from tests.fsembed.workload import loss_of, small_plan, step_features
from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 8


def _run(coll, feats, start, stop, losses):
    """Steps [start, stop) with a one-step lookahead; the ids of step ``start`` are only needed when the context
    is empty (first step)."""
    nxt = feats[start]
    for s in range(start, stop):
        cur, nxt = nxt, (coll.exchange_ids(feats[s + 1]) if s + 1 < len(feats) else None)
        loss = loss_of(coll(cur, nxt))
        loss.backward()
        losses.append(loss.detach())


def _resume(rank, world_size, opt_name, cut):
    from fsembed.optim import SGD, RowWiseAdagrad
    from fsembed.prioritized import PrioritizedEmbeddingCollection
    from fsembed.sharded import ShardedEmbeddingCollection

    plan = small_plan(world_size)
    feats = [step_features(plan, s, rank, "zipf", seed=3) for s in range(STEPS)]
    make_opt = lambda: SGD(lr=0.1) if opt_name == "sgd" else RowWiseAdagrad(lr=0.1)

    doing("uninterrupted")
    ref, ref_losses = PrioritizedEmbeddingCollection(plan, rank, optimizer=make_opt(), seed=2), []
    _run(ref, feats, 0, STEPS, ref_losses)

    doing("stop")
    first, losses = PrioritizedEmbeddingCollection(plan, rank, optimizer=make_opt(), seed=2), []
    _run(first, feats, 0, cut, losses)
    first.flush()  # every rank: state_dict() itself issues no collective
    state = first.state_dict()
    in_flight = bool(state["_extra_state"]["in_flight"])

    doing("resume")
    resumed = PrioritizedEmbeddingCollection(plan, rank, optimizer=make_opt(), seed=7)  # other init: overwritten
    resumed.load_state_dict(state)
    for s in range(cut, STEPS):  # the context holds step `cut`: no ids needed for it
        nxt = resumed.exchange_ids(feats[s + 1]) if s + 1 < STEPS else None
        loss = loss_of(resumed(None, nxt))
        loss.backward()
        losses.append(loss.detach())

    doing("eval in the middle")
    sync, sync_losses = ShardedEmbeddingCollection(plan, rank, optimizer=make_opt(), seed=2), []
    _run(sync, feats, 0, STEPS, sync_losses)
    ev, ev_losses = PrioritizedEmbeddingCollection(plan, rank, optimizer=make_opt(), seed=2), []
    _run(ev, feats, 0, cut, ev_losses)
    ev.eval()
    with torch.no_grad():
        eval_out = ev(step_features(plan, 100, rank, "zipf"))
    ev.train()
    sync.eval()
    ev_state_keys = sorted(eval_out)
    for s in range(cut, STEPS):
        nxt = ev.exchange_ids(feats[s + 1]) if s + 1 < STEPS else None
        loss = loss_of(ev(None, nxt))
        loss.backward()
        ev_losses.append(loss.detach())

    t_ref, t_res, t_sync, t_ev = ref.full_tables(), resumed.full_tables(), sync.full_tables(), ev.full_tables()
    return {
        "in_flight": in_flight,
        "resume_losses": all(torch.equal(a, b) for a, b in zip(ref_losses, losses)) and len(losses) == STEPS,
        "resume_tables": all(torch.equal(t_ref[k], t_res[k]) for k in t_ref),
        "eval_losses": all(torch.equal(a, b) for a, b in zip(sync_losses, ev_losses)),
        "eval_tables": all(torch.equal(t_sync[k], t_ev[k]) for k in t_sync),
        "eval_keys": ev_state_keys,
    }


@pytest.mark.parametrize("opt_name,cut", [("sgd", 3), ("rowwise_adagrad", 5)])
def test_stop_and_resume_gives_identical_continuation(opt_name, cut):
    for r in run_ranks(_resume, 2, args=(opt_name, cut), timeout=90):
        assert r["in_flight"], "the checkpoint carried no state in flight"
        assert r["resume_losses"] and r["resume_tables"], r
        assert r["eval_losses"] and r["eval_tables"], r
        assert r["eval_keys"] == ["cand", "uih", "user"]
