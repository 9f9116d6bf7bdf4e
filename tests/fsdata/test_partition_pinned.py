"""The built-in partitioners' plans are pinned: the vectorized FBS, KK and VBS (budget included) give, on the same
input, exactly the plans of the plain algorithms they replaced.

``_Frozen`` below is the earlier code, kept verbatim in its logic: a lexsort for the cost order, KK merging
materialized member arrays, VBS's capped cuts one rank at a time and its deal under a budget one sample at a time
on a heap. Every test compares whole plans (order and offsets), or the same error, on random steps with ties,
sample ids out of index order or repeated, empty ranks, fewer samples than ranks, fitted and content costs,
autotuned shares and budgets from loose to tight.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdata.partition import (
    BudgetSpec,
    CostModel,
    GatheredLengths,
    MemoryBudget,
    Plan,
    RuntimeInfo,
    get_partitioner,
    guaranteed_tokens,
)
from fsdata.partition.base import cost_sort_order
from fsdata.partition.budget import honour, token_sort_order
from fsdata.partition.deal import deal_with_room
from fsdata.partition.fbs import zigzag_ranks
from fsdata.partition.kk import kk_equal_count
from fsdata.partition.vbs import capped_cuts, segment_cuts
from tests.fsdata.test_partition import gathered

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COSTS = {
    "default": CostModel(),
    "alpha0": CostModel(alpha=0.0),  # every sample costs 1: the order is the sample ids'
    "alpha2": CostModel(alpha=2.0),
    "content": CostModel(content_weight=50.0),
}


class _Frozen:
    """The plain algorithms, as they were before vectorizing."""

    @staticmethod
    def cost_sort_order(costs, lengths):
        return np.lexsort((lengths.sample_ids.numpy(), -costs))

    @staticmethod
    def kk_equal_count(sorted_costs, world_size):
        count = sorted_costs.size
        if world_size == 1 or count == 0:
            return np.zeros(count, dtype=np.int64)
        chunks = -(-count // world_size)
        padded = np.zeros(chunks * world_size)
        padded[:count] = sorted_costs
        positions = np.arange(chunks * world_size, dtype=np.int64).reshape(chunks, world_size)
        sums_by_chunk = padded.reshape(chunks, world_size)
        heap, states = [], {}
        for c in range(chunks):
            heaviest_first = np.argsort(-sums_by_chunk[c], kind="stable")
            sums = sums_by_chunk[c][heaviest_first]
            states[c] = (positions[c][heaviest_first][:, None], sums)
            heapq.heappush(heap, (-(sums[0] - sums[-1]), c))
        next_id = chunks
        while len(heap) > 1:
            _, a = heapq.heappop(heap)
            _, b = heapq.heappop(heap)
            members_a, sums_a = states.pop(a)
            members_b, sums_b = states.pop(b)
            members = np.concatenate([members_a, members_b[::-1]], axis=1)
            sums = sums_a + sums_b[::-1]
            resort = np.argsort(-sums, kind="stable")
            states[next_id] = (members[resort], sums[resort])
            heapq.heappush(heap, (-(sums[resort[0]] - sums[resort[-1]]), next_id))
            next_id += 1
        members, sums = states[heap[0][1]]
        dummies = (members >= count).sum(axis=1)
        rank_of_subset = np.empty(world_size, dtype=np.int64)
        rank_of_subset[np.lexsort((np.arange(world_size), -sums, dummies))] = np.arange(world_size)
        dest_padded = np.empty(chunks * world_size, dtype=np.int64)
        dest_padded[members.ravel()] = np.repeat(rank_of_subset, members.shape[1])
        return dest_padded[:count]

    @staticmethod
    def capped_cuts(sorted_weights, sorted_tokens, weight_caps, limit, ensure_nonempty=True):
        count, world_size = sorted_weights.size, weight_caps.size
        weight_prefix = np.zeros(count + 1)
        np.cumsum(sorted_weights, out=weight_prefix[1:])
        token_prefix = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(sorted_tokens, out=token_prefix[1:])
        slack = 1e-9 * max(weight_prefix[-1], 1e-300)
        cuts = np.zeros(world_size + 1, dtype=np.int64)
        start = 0
        for r in range(world_size - 1):
            by_weight = int(np.searchsorted(weight_prefix, weight_prefix[start] + weight_caps[r] + slack, "right")) - 1
            by_tokens = int(np.searchsorted(token_prefix, token_prefix[start] + limit, "right")) - 1
            end = min(by_weight, by_tokens)
            if ensure_nonempty and count >= world_size:
                end = min(max(end, start + 1), count - (world_size - 1 - r))
            cuts[r + 1] = start = max(end, start)
        cuts[-1] = count
        weights, tokens = np.diff(weight_prefix[cuts]), np.diff(token_prefix[cuts])
        if tokens.max(initial=0) > limit or bool((weights > weight_caps + slack).any()):
            return None
        return cuts

    @staticmethod
    def deal_with_room(order, costs, tokens, shares, limit):
        world = shares.size
        dest = np.empty(order.size, dtype=np.int64)
        held = [0] * world
        heap = [(0.0, r) for r in range(world)]
        inverse = (1.0 / np.maximum(shares, 1e-300)).tolist()
        load = [0.0] * world
        for g, cost, need in zip(order.tolist(), costs[order].tolist(), tokens[order].tolist()):
            full = []
            while heap and held[heap[0][1]] + need > limit:
                full.append(heapq.heappop(heap))
            if not heap:
                return None
            _, r = heapq.heappop(heap)
            dest[g] = r
            held[r] += need
            load[r] += cost
            heapq.heappush(heap, (load[r] * inverse[r], r))
            for entry in full:
                heapq.heappush(heap, entry)
        return dest

    @classmethod
    def fbs(cls, cost_model, lengths, runtime):
        costs = cost_model.sample_costs(lengths, runtime)
        sorted_index = cls.cost_sort_order(costs, lengths)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = zigzag_ranks(lengths.num_samples, lengths.world_size)

        def in_token_order(tokens):
            by_tokens = np.empty_like(dest)
            by_tokens[token_sort_order(tokens, costs, lengths)] = zigzag_ranks(lengths.num_samples, lengths.world_size)
            return by_tokens

        dest = honour(dest, lengths, runtime.memory_budget, costs, [in_token_order], True, "partitioner fbs")
        return Plan.from_destinations(dest, lengths.world_size)

    @classmethod
    def kk(cls, cost_model, lengths, runtime):
        costs = cost_model.sample_costs(lengths, runtime)
        sorted_index = cls.cost_sort_order(costs, lengths)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = cls.kk_equal_count(costs[sorted_index], lengths.world_size)

        def in_token_chunks(tokens):
            order = token_sort_order(tokens, costs, lengths)
            by_tokens = np.empty_like(dest)
            by_tokens[order] = cls.kk_equal_count(costs[order], lengths.world_size)
            return by_tokens

        dest = honour(dest, lengths, runtime.memory_budget, costs, [in_token_chunks], True, "partitioner kk")
        return Plan.from_destinations(dest, lengths.world_size)

    @classmethod
    def vbs(cls, cost_model, lengths, runtime, ensure_nonempty=True):
        weights = cost_model.sample_costs(lengths, runtime)
        sorted_index = cls.cost_sort_order(weights, lengths)
        shares = runtime.shares(lengths.world_size)
        cuts = segment_cuts(weights[sorted_index], shares, ensure_nonempty)
        ranks = np.arange(lengths.world_size, dtype=np.int64)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = np.repeat(ranks, np.diff(cuts))
        budget = runtime.memory_budget

        def contiguous(tokens):
            segment_weights = np.diff(np.concatenate([[0.0], np.cumsum(weights[sorted_index])])[cuts])
            heaviest = float((segment_weights / np.maximum(shares, 1e-300)).max())
            capped = cls.capped_cuts(
                weights[sorted_index], tokens[sorted_index], heaviest * shares, budget.tokens, ensure_nonempty
            )
            if capped is None:
                return None
            out = np.empty_like(dest)
            out[sorted_index] = np.repeat(ranks, np.diff(capped))
            return out

        def dealt(tokens):
            return cls.deal_with_room(sorted_index, weights, tokens, shares, budget.tokens)

        dest = honour(dest, lengths, budget, weights, [contiguous, dealt], False, "partitioner vbs")
        return Plan.from_destinations(dest, lengths.world_size)


def _plan_or_error(fn):
    try:
        return fn()
    except ValueError as error:
        return str(error)


def assert_same(new, old):
    if isinstance(old, str) or isinstance(new, str):
        assert new == old
        return
    assert torch.equal(new.dest_offsets, old.dest_offsets), (new.dest_offsets, old.dest_offsets)
    assert torch.equal(new.order, old.order)


def with_ids(lengths: GatheredLengths, kind: str, rng: np.random.Generator) -> GatheredLengths:
    """The same step with sample ids in index order, shuffled, or drawn from few values (repeats)."""
    g = lengths.num_samples
    ids = {
        "drawn": lengths.sample_ids.numpy(),
        "ascending": np.arange(g) * 3 + 7,
        "repeated": rng.integers(0, max(1, g // 4), g),
        "descending": -np.arange(g),
    }[kind]
    return GatheredLengths(
        lengths.uih_lengths,
        lengths.num_candidates,
        lengths.candidate_lengths,
        ids,
        lengths.rank_offsets,
        lengths.world_size,
    )


def runtime_for(lengths, rng, shares_kind, budget_kind, fitted) -> RuntimeInfo:
    w = lengths.world_size
    shares = None
    if shares_kind == "random":
        shares = torch.from_numpy(rng.uniform(0.05, 3.0, w))
    elif shares_kind == "zeros":  # some ranks given nothing
        raw = rng.uniform(0.0, 1.0, w) * (rng.random(w) < 0.7)
        shares = torch.from_numpy(raw if raw.sum() > 0 else np.ones(w))
    budget = None
    if budget_kind != "none" and lengths.num_samples:
        tokens = MemoryBudget(1).sample_tokens(lengths)
        mean = int(tokens.sum()) / w
        limit = {
            "guaranteed": guaranteed_tokens(tokens, w),
            "1.05x": int(np.ceil(1.05 * mean)),
            "mean": int(np.ceil(mean)),
            "tight": max(1, int(0.8 * mean)),
        }[budget_kind]
        budget = MemoryBudget(max(1, limit))
    coefficients = None
    if fitted is not None:
        coefficients = torch.tensor(fitted, dtype=torch.float64)
    return RuntimeInfo(budget_shares=shares, memory_budget=budget, cost_coefficients=coefficients)


# ---------------------------------------------------------------------------------------------- whole plans
@SETTINGS
@given(
    lengths=gathered(max_world=48, max_local=40),
    cost=st.sampled_from(sorted(COSTS)),
    ids=st.sampled_from(["drawn", "ascending", "repeated", "descending"]),
    shares=st.sampled_from(["equal", "random", "zeros"]),
    budget=st.sampled_from(["none", "guaranteed", "1.05x", "mean", "tight"]),
    fitted=st.sampled_from([None, (1.0, 1e-3, 2.0, 0.5), (0.0, 0.0, 1.0, 0.0)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_plans_equal_the_frozen_algorithms(lengths, cost, ids, shares, budget, fitted, seed):
    rng = np.random.default_rng(seed)
    lengths = with_ids(lengths, ids, rng)
    runtime = runtime_for(lengths, rng, shares, budget, fitted)
    model = COSTS[cost]
    for name in ("fbs", "kk", "vbs"):
        new = _plan_or_error(lambda: get_partitioner(name, cost_model=model)(lengths, runtime))
        old = _plan_or_error(lambda: getattr(_Frozen, name)(model, lengths, runtime))
        assert_same(new, old)
    new = _plan_or_error(lambda: get_partitioner("vbs", cost_model=model, ensure_nonempty=False)(lengths, runtime))
    old = _plan_or_error(lambda: _Frozen.vbs(model, lengths, runtime, ensure_nonempty=False))
    assert_same(new, old)


def kuairand(world: int, local: int, seed: int, ids: str = "ascending") -> GatheredLengths:
    rng = np.random.default_rng(seed)
    uih = np.minimum(rng.lognormal(np.log(3379), 0.89, world * local), 21000).astype(np.int64)
    lengths = GatheredLengths.from_rank_lengths(np.split(uih, world), np.split(np.ones_like(uih), world))
    return with_ids(lengths, ids, rng)


@pytest.mark.parametrize(
    "world,local,seed,ids",
    [(1024, 128, 0, "ascending"), (1024, 37, 1, "drawn"), (256, 128, 2, "repeated"), (333, 50, 3, "descending")],
)
def test_plans_at_many_ranks_equal_the_frozen_algorithms(world, local, seed, ids):
    lengths = kuairand(world, local, seed, ids)
    rng = np.random.default_rng(seed)
    budget = BudgetSpec.parse("1.05x").for_step(lengths)
    shares = torch.from_numpy(rng.uniform(0.95, 1.05, world))  # as autotune moves them
    for runtime in (RuntimeInfo(), RuntimeInfo(memory_budget=budget), RuntimeInfo(budget_shares=shares)):
        for name in ("fbs", "kk", "vbs"):
            new = get_partitioner(name)(lengths, runtime)
            assert_same(new, getattr(_Frozen, name)(CostModel(), lengths, runtime))
    runtime = RuntimeInfo(memory_budget=budget, budget_shares=shares)
    assert_same(get_partitioner("vbs")(lengths, runtime), _Frozen.vbs(CostModel(), lengths, runtime))


# ---------------------------------------------------------------------------------------------- the pieces
@SETTINGS
@given(lengths=gathered(max_world=64, max_local=40), ids=st.sampled_from(["drawn", "ascending", "repeated"]))
def test_cost_order_equals_the_lexsort(lengths, ids):
    lengths = with_ids(lengths, ids, np.random.default_rng(lengths.num_samples))
    for model in COSTS.values():
        costs = model.sample_costs(lengths)
        assert np.array_equal(cost_sort_order(costs, lengths), _Frozen.cost_sort_order(costs, lengths))
    rounded = np.round(CostModel().sample_costs(lengths), -3)  # many ties, and zeros
    assert np.array_equal(cost_sort_order(rounded, lengths), _Frozen.cost_sort_order(rounded, lengths))


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.5, 7.0, 1e6, 3.3e-7]), min_size=0, max_size=200),
    world=st.integers(1, 40),
)
def test_kk_on_tied_and_unsorted_costs_equals_the_frozen_merges(costs, world):
    c = np.asarray(costs, dtype=np.float64)
    assert np.array_equal(kk_equal_count(c, world), _Frozen.kk_equal_count(c, world))
    descending = np.sort(c)[::-1].copy()
    assert np.array_equal(kk_equal_count(descending, world), _Frozen.kk_equal_count(descending, world))


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 1.0, 3.0, 50.0, 400.0]), min_size=1, max_size=120),
    tokens=st.lists(st.integers(1, 60), min_size=120, max_size=120),
    world=st.integers(1, 30),
    limit=st.integers(1, 600),
    nonempty=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_capped_cuts_equal_the_frozen_greedy(weights, tokens, world, limit, nonempty, seed):
    w = np.sort(np.asarray(weights, dtype=np.float64))[::-1].copy()
    t = np.asarray(tokens[: w.size], dtype=np.int64)
    caps = np.random.default_rng(seed).uniform(0.0, 2.0, world) * w.sum() / world
    new = capped_cuts(w, t, caps, limit, nonempty)
    old = _Frozen.capped_cuts(w, t, caps, limit, nonempty)
    assert (new is None and old is None) or np.array_equal(new, old)


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 8.0, 30.0, 1e3]), min_size=0, max_size=700),
    world=st.one_of(st.integers(1, 24), st.integers(64, 150)),
    slack=st.integers(-20, 60),
    shares=st.sampled_from(["equal", "random", "skewed"]),
    order=st.sampled_from(["cost", "tokens"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_deal_with_room_equals_the_frozen_heap(costs, world, slack, shares, order, seed):
    """Rounds and the heap (ranks >= 64 and fewer), ties in cost, ranks full early (skewed shares), and token
    counts that rise and fall along the order."""
    rng = np.random.default_rng(seed)
    c = np.asarray(costs, dtype=np.float64)
    tokens = rng.integers(1, 30, c.size)
    keys = -c if order == "cost" else -tokens
    sort = np.lexsort((np.arange(c.size), keys))
    s = {
        "equal": np.full(world, 1.0 / world),
        "random": rng.uniform(0.1, 2.0, world),
        "skewed": rng.uniform(0.1, 2.0, world) ** 4,
    }[shares]
    limit = max(1, int(-(-int(tokens.sum()) // world)) + slack)
    new = deal_with_room(sort, c, tokens, s, limit)
    old = _Frozen.deal_with_room(sort, c, tokens, s, limit)
    assert (new is None and old is None) or np.array_equal(new, old)
