"""Prioritized updates (Algorithm 2) against the synchronous path: identical tables and losses, bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.fsembed.workload import loss_of, small_plan, step_features
from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 7


def _optimizer(name: str):
    from fsembed.optim import SGD, Adam, RowWiseAdagrad

    return {"sgd": SGD(lr=0.1), "rowwise_adagrad": RowWiseAdagrad(lr=0.1), "adam": Adam(lr=0.05)}[name]


def train(coll, feats, prefetch: bool, after_forward=None, schedules=None):
    """Trains over ``feats`` with a one-step lookahead; returns the losses. ``after_forward(coll)`` runs between
    every forward and its backward (where the embedding wrap's lookup ends); ``schedules``: the embedding
    schedule of every step (set before its forward, as the trainer does)."""
    ahead = (lambda f: coll.exchange_ids(f)) if prefetch else (lambda f: f)
    losses = []
    nxt = ahead(feats[0])
    for s in range(len(feats)):
        if schedules is not None:
            coll.set_schedule(schedules[s])
        cur = nxt
        nxt = ahead(feats[s + 1]) if s + 1 < len(feats) else None
        loss = loss_of(coll(cur, nxt))
        if after_forward is not None:
            after_forward(coll)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _misorder(prio) -> None:
    """Mutation injected into one collection: the exclusive gradients that lines 6-7 apply in the bulk chain's
    early work land after line 12's lookup instead of before it (line 12 then reads rows one update stale)."""
    import sys

    apply_rows = prio._apply_rows

    def apply_after_the_lookup(shard, pending, grads):
        if sys._getframe(1).f_code.co_name != "early":  # only the early work's update moves
            return apply_rows(shard, pending, grads)
        lookup = shard.lookup

        def lookup_then_apply(rows):
            out = lookup(rows)
            shard.__dict__.pop("lookup", None)  # back to the class's method (once, however many were stacked)
            apply_rows(shard, pending, grads)
            return out

        shard.lookup = lookup_then_apply

    prio._apply_rows = apply_after_the_lookup


def _pair(
    rank,
    world_size,
    opt,
    collision,
    empty_rank,
    misorder=False,
    prefetch=True,
    item_dtype=None,
    stale=False,
    chain=True,
    early_start="forward",
    hook=False,
    schedules=None,
    exclusive_start="backward",
):
    """``chain=False``: one transport for everything, so no collision group: the next forward runs the chain.
    ``early_start="backward"``: lines 6-7 and 12 held, started after the forward (``hook``) or by the backward.
    ``exclusive_start="forward"``: the deferred exclusive gradients held until the next forward sends them."""
    from fscomm import get_transport
    from fsembed.prioritized import PrioritizedEmbeddingCollection
    from fsembed.sharded import ShardedEmbeddingCollection
    from fsembed.transports import EmbeddingTransports

    plan = small_plan(world_size, item_dtype=item_dtype or torch.float32)
    feats = [step_features(plan, s, rank, collision, empty_rank=empty_rank) for s in range(STEPS)]
    sync = ShardedEmbeddingCollection(plan, rank, optimizer=_optimizer(opt), seed=1)
    transport = {} if chain else {"transport": EmbeddingTransports.single(get_transport("host"))}
    prio = PrioritizedEmbeddingCollection(
        plan,
        rank,
        optimizer=_optimizer(opt),
        seed=1,
        stale=stale,
        early_start=early_start,
        exclusive_start=exclusive_start,
        **transport,
    )
    if misorder:
        _misorder(prio)
    ls = train(sync, feats, prefetch)
    lp = train(
        prio, feats, prefetch, after_forward=(lambda c: c.start_early_rows()) if hook else None, schedules=schedules
    )
    ts, tp = sync.full_tables(), prio.full_tables()
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(ls, lp)),
        "tables_equal": all(torch.equal(ts[k], tp[k]) for k in ts),
        "collision_rates": prio.collision_rates,
        "row_counts": dict(prio.row_counts),
        "changed": any(
            not torch.equal(ts[k], PrioritizedEmbeddingCollection(plan, rank, seed=1).full_tables()[k]) for k in ts
        ),
    }


def _cases(rank, world_size, cases):
    out = []
    for case in cases:
        doing(f"case {case}")
        out.append(_pair(rank, world_size, *case))
    return out


CASES_2 = [
    (opt, collision, empty, False, prefetch)
    for opt in ("sgd", "rowwise_adagrad")
    for collision, empty, prefetch in (("none", -1, True), ("zipf", 1, True), ("all", -1, False), ("zipf", -1, False))
] + [("adam", "zipf", -1, False, True), ("rowwise_adagrad", "zipf", 0, False, True, torch.bfloat16)]


def test_parity_two_ranks():
    results = run_ranks(_cases, 2, args=(CASES_2,), timeout=120)
    for rank_res in results:
        for case, r in zip(CASES_2, rank_res):
            assert r["changed"], f"{case}: training did not change the tables"
            assert r["losses_equal"] and r["tables_equal"], f"{case}: prioritized differs from sync: {r}"
    for i, case in enumerate(CASES_2):
        counts = [res[i]["row_counts"] for res in results]
        if case[1] != "all":
            assert sum(c["early"] for c in counts) > 0 and sum(c["deferred"] for c in counts) > 0, f"{case}: {counts}"
        if case[1] != "none":
            assert sum(c["collision"] for c in counts) > 0, f"{case}: {counts}"
    rates = {c[1]: results[0][i]["collision_rates"] for i, c in enumerate(CASES_2)}
    assert all(x == 0.0 for x in rates["none"][:-1])
    assert all(x == 1.0 for x in rates["all"][:-1])
    assert any(0.0 < x < 1.0 for x in rates["zipf"])


def test_parity_four_ranks_with_empty_batches():
    cases = [("rowwise_adagrad", "zipf", 2, False, True), ("sgd", "none", 0, False, True)]
    for rank_res in run_ranks(_cases, 4, args=(cases,), timeout=120):
        for case, r in zip(cases, rank_res):
            assert r["losses_equal"] and r["tables_equal"], f"{case}: {r}"


def test_parity_when_the_schedule_switches_between_steps():
    """set_schedule: prioritized -> sdd flushes and drops the context, sdd -> prioritized starts again with a
    synchronous first step; every switch keeps the synchronous path's numbers bit for bit (with and without
    chains, prefetched ids or not, held early rows, an empty batch)."""
    p, d = "prioritized", "sdd"
    pattern = [p, p, d, d, p, d, p]
    cases = [
        (opt, "zipf", empty, False, prefetch, None, False, chain, early, early == "backward", pattern)
        for opt, empty, prefetch, chain, early in (
            ("sgd", -1, True, True, "forward"),
            ("rowwise_adagrad", 1, True, True, "backward"),
            ("adam", -1, False, False, "forward"),
        )
    ]
    for rank_res in run_ranks(_cases, 2, args=(cases,), timeout=90):
        for case, r in zip(cases, rank_res):
            assert r["changed"] and r["losses_equal"] and r["tables_equal"], f"{case[:5]}: {r}"


def test_parity_when_the_next_forward_runs_the_collision_chain():
    """Without a collision group (a single transport) the chain runs in the next forward: same numbers."""
    cases = [(opt, "zipf", -1, False, True, None, False, False) for opt in ("sgd", "rowwise_adagrad")]
    for rank_res in run_ranks(_cases, 2, args=(cases,), timeout=60):
        for case, r in zip(cases, rank_res):
            assert r["changed"] and r["losses_equal"] and r["tables_equal"], f"{case}: {r}"


def test_parity_when_early_rows_start_at_the_backward():
    """early_start="backward": the bulk chain's lines 6-7 and 12 wait for start_early_rows() after the forward,
    or for the backward: same numbers, also with an empty batch and without chains."""
    cases = [
        (opt, "zipf", empty, False, True, None, False, chain, "backward", hook)
        for opt, empty, chain, hook in (
            ("sgd", -1, True, True),
            ("rowwise_adagrad", 1, True, False),
            ("sgd", -1, False, True),
        )
    ]
    for rank_res in run_ranks(_cases, 2, args=(cases,), timeout=90):
        for case, r in zip(cases, rank_res):
            assert r["changed"] and r["losses_equal"] and r["tables_equal"], f"{case}: {r}"


def test_parity_when_exclusive_gradients_leave_with_the_next_forward():
    """exclusive_start="forward": each backward's exclusive gradients are held until the next forward has waited
    for its collision rows: same numbers, with early rows started at once, by the forward's hook or by the
    backward, with an empty batch, through schedule switches, and without chains (where they leave at once)."""
    p, d = "prioritized", "sdd"
    cases = [
        (opt, "zipf", empty, False, True, None, False, chain, early, hook, pattern, "forward")
        for opt, empty, chain, early, hook, pattern in (
            ("sgd", -1, True, "forward", False, None),
            ("rowwise_adagrad", 1, True, "backward", True, None),
            ("adam", -1, True, "backward", False, None),
            ("sgd", -1, True, "backward", True, [p, p, d, p, p, d, p]),
            ("sgd", -1, False, "forward", False, None),
        )
    ]
    results = run_ranks(_cases, 2, args=(cases,), timeout=120)
    for rank_res in results:
        for case, r in zip(cases, rank_res):
            assert r["changed"] and r["losses_equal"] and r["tables_equal"], f"{case[:4]}: {r}"
    for i, case in enumerate(cases):  # exclusive gradients were deferred (held) in every case
        assert sum(res[i]["row_counts"]["deferred"] for res in results) > 0, f"{case[:4]}: nothing deferred"


def _held_collection(rank, world_size, steps, **option):
    """A prioritized collection (SGD) with one of its hand-over ``option``s, and ``steps`` steps' zipf features."""
    from fsembed.prioritized import PrioritizedEmbeddingCollection

    plan = small_plan(world_size)
    feats = [step_features(plan, s, rank, "zipf") for s in range(steps)]
    return PrioritizedEmbeddingCollection(plan, rank, optimizer=_optimizer("sgd"), seed=1, **option), feats


def _exclusive_held(rank, world_size):
    """exclusive_start="forward": backward 0's exclusive gradients reach the bulk chain only in forward 1."""
    prio, feats = _held_collection(rank, world_size, 3, exclusive_start="forward")
    loss_of(prio(feats[0], prio.exchange_ids(feats[1]))).backward()
    sends = [c.pending_ex[0] for c in prio.ctx.values()]
    held = all(s._future is None for s in sends)
    emb = prio(None, prio.exchange_ids(feats[2]))
    sent = all(s._future is not None for s in sends)
    loss_of(emb).backward()
    prio.flush()
    return held, sent


def test_held_exclusive_gradients_leave_with_the_next_forward():
    for held, sent in run_ranks(_exclusive_held, 2, timeout=60):
        assert held and sent


def _held_until_started(rank, world_size):
    """With early_start="backward" nothing of lines 6-7 and 12 reaches the bulk chain before start_early_rows()."""
    prio, feats = _held_collection(rank, world_size, 2, early_start="backward")
    emb = prio(feats[0], prio.exchange_ids(feats[1]))
    early = [c.nxt.fresh for c in prio.ctx.values()]
    held = all(f._future is None for f in early)
    prio.start_early_rows()
    sent = all(f.result(timeout=30)[0].wait() is not None for f in early)
    loss_of(emb).backward()
    prio.flush()
    return held, sent


def test_held_early_rows_wait_for_the_start():
    for held, sent in run_ranks(_held_until_started, 2, timeout=60):
        assert held and sent


@pytest.mark.parametrize("option", ["early_start", "exclusive_start"])
def test_an_unknown_start_is_refused(option):
    from fsembed.prioritized import PrioritizedEmbeddingCollection

    with pytest.raises(ValueError, match=f"{option} must be one of"):
        PrioritizedEmbeddingCollection(small_plan(1), 0, **{option: "later"})


def _chain_without_model_thread(rank, world_size):
    """Forward 0 alone sends step 1's fresh rows (bulk chain). Every row of step 0 is used again by step 1, so
    after backward 0 all its updates are collision updates: once the collision chains are done, with no call
    from the model thread, the tables equal sync's after step 0."""
    from fsembed.prioritized import PrioritizedEmbeddingCollection
    from fsembed.sharded import ShardedEmbeddingCollection

    plan = small_plan(world_size)
    feats = [step_features(plan, s, rank, "all") for s in range(2)]
    sync = ShardedEmbeddingCollection(plan, rank, optimizer=_optimizer("sgd"), seed=1)
    train(sync, feats[:1], prefetch=False)
    prio = PrioritizedEmbeddingCollection(plan, rank, optimizer=_optimizer("sgd"), seed=1)
    ran = []  # (what, the thread that ran it), observed as the work runs
    for shard in prio.shards.values():
        lookup = shard.lookup
        shard.lookup = lambda rows, lookup=lookup: (
            ran.append(("lookup", threading.current_thread().name)) or lookup(rows)
        )
    apply = prio.optimizer.apply
    prio.optimizer.apply = lambda *a: ran.append(("update", threading.current_thread().name)) or apply(*a)
    emb = prio(feats[0], prio.exchange_ids(feats[1]))
    # line 12 is already on its way before the backward: the bulk chain sent the next step's fresh rows
    early = [c.nxt.fresh for c in prio.ctx.values()]
    early_sent = all(f.result(timeout=30)[0].wait() is not None for f in early)
    after_forward = list(ran)
    loss_of(emb).backward()
    chains = [c.pending_co for c in prio.ctx.values()]
    for f in chains:
        f.result(timeout=30)
    updated = all(torch.equal(prio.shards[n].weight, sync.shards[n].weight) for n in prio.shards)
    in_backward = ran[len(after_forward) :]
    prio.flush()
    return early_sent, after_forward, in_backward, updated


def test_chains_run_off_the_model_thread():
    """The first step's lookup is the model thread's; line 12's lookup ran on the bulk chain's thread, and the
    collision updates with line 21's lookups on the collision chain's: seen from inside the work itself."""
    for early_sent, after_forward, in_backward, updated in run_ranks(_chain_without_model_thread, 2, timeout=60):
        assert early_sent and updated
        groups = len(after_forward) // 2  # per group: its first step's lookup, then its line 12's
        expected = [("lookup", "MainThread"), ("lookup", "fsembed-bulk-chain")] * groups  # threads interleave
        assert groups and sorted(after_forward) == sorted(expected), after_forward
        assert in_backward and all(thread == "fsembed-collision-chain" for _, thread in in_backward), in_backward
        assert {what for what, _ in in_backward} == {"update", "lookup"}


def test_misordered_exclusive_update_breaks_parity():
    """Applying step i-1's exclusive gradients after line 12's lookup reads stale rows: parity must fail.
    With "none" every row of step i-1 is exclusive and step i+1 reads it again."""
    cases = [
        ("sgd", "none", -1, True, True),  # exclusive gradients sent from the backward
        ("sgd", "none", -1, True, True, None, False, True, "forward", False, None, "forward"),
    ]  # the default
    results = run_ranks(_cases, 2, args=(cases,), timeout=60)
    for i, case in enumerate(cases):
        assert not all(r[i]["tables_equal"] and r[i]["losses_equal"] for r in results), case
    unmutated = [case[:3] + (False,) + case[4:] for case in cases]  # the same cases without the mutation: parity
    for rank_res in run_ranks(_cases, 2, args=(unmutated,), timeout=60):
        assert all(r["tables_equal"] and r["losses_equal"] for r in rank_res)


def test_semisync_baseline_is_stale_exactly_where_batches_collide():
    """The semi-synchronous baseline (stale=True) fetches every next row early: with no collisions it equals
    sync bit for bit; with every row colliding it must not (those rows miss one update), which is the cost
    FreeScale's prioritized updates avoid. Collisions are still measured."""
    cases = [("sgd", collision, -1, False, True, None, True) for collision in ("none", "all")]
    none, every = zip(*run_ranks(_cases, 2, args=(cases,), timeout=60))
    assert all(r["losses_equal"] and r["tables_equal"] for r in none)
    assert not all(r["losses_equal"] and r["tables_equal"] for r in every)
    assert all(r["row_counts"]["collision"] == 0 for r in every)  # nothing waited for an update
    assert all(x == 1.0 for x in every[0]["collision_rates"][:-1])
