"""The per-rank memory budget: the guaranteed bound (property-tested), what cannot fit, the refusal of plans that
break it (built-in or user's), the gate's keep-local path, the spelling of --memory-budget and the auto model.

All in one process except the last test: a plan is a pure function of the gathered lengths and the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdata.partition import (
    BalanceGate,
    BudgetSpec,
    CostModel,
    GatheredLengths,
    MemoryBudget,
    MemoryModel,
    Plan,
    RuntimeInfo,
    get_partitioner,
    guaranteed_tokens,
    kept_tokens,
    rank_features,
)
from tests.fsdata.test_partition import gathered

BALANCING = ["fbs", "vbs", "kk"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Costs whose order is not the token order: the partitioners' cost-ordered plans may then break the bound, and
# the token-ordered fallbacks must still meet it.
COSTS = {
    "default": CostModel(),
    "alpha0": CostModel(alpha=0.0),  # every sample costs 1: sorted by sample id, not by tokens
    "content": CostModel(content_weight=50.0),
    "no_candidates": CostModel(candidate_weight=0.0, alpha=2.0),
}


def held(lengths: GatheredLengths, plan: Plan, budget: MemoryBudget) -> np.ndarray:
    return budget.rank_tokens(lengths, plan)


# ---------------------------------------------------------------------------------------------- the guarantee
@SETTINGS
@given(
    lengths=gathered(),
    name=st.sampled_from(BALANCING),
    cost=st.sampled_from(sorted(COSTS)),
    above=st.sampled_from([0, 0, 1, 7, 1000]),
    max_uih=st.sampled_from([None, 3, 2000]),
    per_sample=st.sampled_from([0, 0, 5]),
    data=st.data(),
)
def test_no_plan_exceeds_a_budget_at_or_above_the_guaranteed_bound(
    lengths, name, cost, above, max_uih, per_sample, data
):
    """Bound: ceil(S / W) + the largest sample's tokens, for any lengths, world size and cost; counts stay equal
    (+-1) for FBS and KK; VBS also under autotuned shares."""
    tokens = kept_tokens(lengths, max_uih, per_sample)
    budget = MemoryBudget(max(1, guaranteed_tokens(tokens, lengths.world_size) + above), max_uih, per_sample)
    shares = None
    if name == "vbs" and data.draw(st.booleans()):
        shares = torch.tensor(
            data.draw(st.lists(st.floats(0.05, 3.0), min_size=lengths.world_size, max_size=lengths.world_size)),
            dtype=torch.float64,
        )
    plan = get_partitioner(name, cost_model=COSTS[cost])(
        lengths, RuntimeInfo(memory_budget=budget, budget_shares=shares)
    )
    plan.validate(lengths.num_samples, lengths.world_size, lengths=lengths, budget=budget)
    assert held(lengths, plan, budget).max(initial=0) <= budget.tokens
    if name != "vbs":
        counts = plan.counts()
        assert int(counts.max() - counts.min()) <= 1


@SETTINGS
@given(lengths=gathered(max_world=16), name=st.sampled_from(BALANCING), fraction=st.floats(0.0, 1.0))
def test_below_the_bound_a_plan_meets_the_budget_or_the_step_fails_with_the_figures(lengths, name, fraction):
    """Between S / W and the bound nothing is promised, but nothing is silent: a plan within the budget, or a
    ValueError that gives the budget and the bound."""
    tokens = kept_tokens(lengths)
    if tokens.sum() == 0:
        return
    least = -(-int(tokens.sum()) // lengths.world_size)
    budget = MemoryBudget(max(1, int(least + fraction * (guaranteed_tokens(tokens, lengths.world_size) - least))))
    try:
        plan = get_partitioner(name)(lengths, RuntimeInfo(memory_budget=budget))
    except ValueError as error:
        assert str(budget.tokens) in str(error) and "--memory-budget" in str(error), error
        return
    assert held(lengths, plan, budget).max(initial=0) <= budget.tokens


@SETTINGS
@given(lengths=gathered(), name=st.sampled_from(BALANCING + ["none"]))
def test_a_budget_that_does_not_bind_leaves_the_plan_as_it_was(lengths, name):
    tokens = kept_tokens(lengths)
    loose = MemoryBudget(max(1, int(tokens.sum())))
    partition = get_partitioner(name)
    unconstrained, constrained = partition(lengths, RuntimeInfo()), partition(lengths, RuntimeInfo(memory_budget=loose))
    assert torch.equal(unconstrained.order, constrained.order)
    assert torch.equal(unconstrained.dest_offsets, constrained.dest_offsets)


@pytest.mark.parametrize("name", BALANCING)
def test_the_same_inputs_give_the_same_plan(name):
    """Every rank computes the plan alone: a fresh partitioner on a copy of the lengths must agree exactly."""
    rng = np.random.default_rng(5)
    uih = np.minimum(rng.lognormal(np.log(3379), 0.89, 32 * 64), 21000).astype(np.int64)
    lengths = GatheredLengths.from_rank_lengths(np.split(uih, 32))
    budget = MemoryBudget(int(1.05 * kept_tokens(lengths).sum() / 32))
    plans = [
        get_partitioner(name)(
            GatheredLengths.from_rank_lengths(np.split(uih.copy(), 32)), RuntimeInfo(memory_budget=budget)
        )
        for _ in range(2)
    ]
    assert torch.equal(plans[0].order, plans[1].order) and torch.equal(plans[0].dest_offsets, plans[1].dest_offsets)


def test_vbs_keeps_contiguous_cuts_under_a_loose_budget_and_deals_under_a_tight_one():
    rng = np.random.default_rng(0)
    uih = np.minimum(rng.lognormal(np.log(3379), 0.89, 64 * 128), 21000).astype(np.int64)
    lengths = GatheredLengths.from_rank_lengths(np.split(uih, 64))
    mean = kept_tokens(lengths).sum() / 64
    vbs = get_partitioner("vbs")
    plain = vbs(lengths, RuntimeInfo())
    weights = vbs.cost_model.sample_costs(lengths)

    def heaviest(plan):
        return np.bincount(plan.destinations().numpy(), weights=weights, minlength=64).max()

    assert held(lengths, plain, MemoryBudget(1)).max() > 2.0 * mean  # what the budget is for
    loose = vbs(lengths, RuntimeInfo(memory_budget=MemoryBudget(int(2.0 * mean))))
    assert held(lengths, loose, MemoryBudget(1)).max() <= 2.0 * mean
    assert heaviest(loose) <= heaviest(plain) * (1 + 1e-9)  # contiguous and no heavier than before
    rank_of = loose.destinations().numpy()[np.lexsort((np.arange(uih.size), -weights))]
    assert (np.diff(rank_of) >= 0).all()  # rank 0 the longest samples, and so on: still segments
    tight = vbs(lengths, RuntimeInfo(memory_budget=MemoryBudget(int(1.05 * mean))))
    assert held(lengths, tight, MemoryBudget(1)).max() <= 1.05 * mean
    assert heaviest(tight) <= heaviest(plain)  # the capped deal balances weight at least as well


# ---------------------------------------------------------------------------------------------- what cannot fit
def test_a_sample_over_the_budget_and_a_batch_over_the_worlds_fail_naming_the_figures():
    lengths = GatheredLengths.from_rank_lengths([[10, 20], [30, 40]], sample_ids=[7, 8, 9, 12])
    with pytest.raises(ValueError, match=r"sample 12 \(source rank 1\) keeps 40 tokens, over the budget of 39"):
        get_partitioner("fbs")(lengths, RuntimeInfo(memory_budget=MemoryBudget(39)))
    with pytest.raises(
        ValueError,
        match=r"global batch keeps 100 tokens, over the world's budget of 2 ranks x 45 = 90"
        r" \(--memory-budget\); raise the budget to at least 90",
    ):
        get_partitioner("kk")(lengths, RuntimeInfo(memory_budget=MemoryBudget(45)))


def everything_to_rank_zero(lengths, runtime):
    return np.zeros(lengths.num_samples, dtype=np.int64)


def test_plan_validate_refuses_a_plan_over_the_budget_and_so_does_a_users_partitioner():
    lengths = GatheredLengths.from_rank_lengths([[10, 20], [30, 40]])
    plan = Plan.from_destinations([0, 0, 0, 1], 2)
    with pytest.raises(ValueError, match=r"mine: rank 0 holds 60 tokens in 3 samples, over the memory budget of 55"):
        plan.validate(4, 2, who="mine", lengths=lengths, budget=MemoryBudget(55))
    plan.validate(4, 2, lengths=lengths, budget=MemoryBudget(60))
    user = get_partitioner("tests.fsdata.test_memory_budget:everything_to_rank_zero")
    user(lengths, RuntimeInfo())  # no budget: any exactly-once plan goes
    with pytest.raises(
        ValueError,
        match=r"custom partitioner .*everything_to_rank_zero.*: rank 0 holds 100 tokens in 4"
        r" samples, over the memory budget of 70",
    ):
        user(lengths, RuntimeInfo(memory_budget=MemoryBudget(70)))


def test_the_gate_keeps_a_step_local_only_if_the_local_batches_fit():
    lengths = GatheredLengths.from_rank_lengths([[100, 100, 100], [1, 1, 1]])
    gate = BalanceGate(min_gain=0.5)
    tokens = kept_tokens(lengths).astype(np.float64)
    for step in range(3):  # step times that do not follow the lengths: balancing is predicted not to pay
        features = rank_features(tokens, Plan.identity(lengths).destinations().numpy(), 2)
        gate.fit.update(features, np.array([0.1, 0.1]))
    plan = get_partitioner("fbs")(lengths, RuntimeInfo())
    kept, gain = gate.choose(0, lengths, plan)
    assert kept.is_identity(lengths) and gain is not None and gain < 0.5
    balanced, _ = gate.choose(1, lengths, plan, MemoryBudget(250))  # rank 0 would hold 300 tokens where it is
    assert torch.equal(balanced.order, plan.order)


# ---------------------------------------------------------------------------------------------- --memory-budget
def test_the_spellings_of_memory_budget():
    lengths = GatheredLengths.from_rank_lengths([[10, 20], [30, 41]])
    assert BudgetSpec.parse(None) is None and BudgetSpec.parse("") is None
    assert BudgetSpec.parse("600000").for_step(lengths).tokens == 600000
    assert BudgetSpec.parse(600000).for_step(lengths).tokens == 600000
    assert BudgetSpec.parse("1e6").tokens == 1_000_000
    assert BudgetSpec.parse("1x").for_step(lengths).tokens == 51  # ceil(101 / 2): 1x always holds the batch
    assert BudgetSpec.parse("1.5X", max_uih=20).for_step(lengths).tokens == 53  # ceil(1.5 * 70 / 2)
    spec = BudgetSpec.parse("auto:bytes_per_token=1000, headroom=0.2")
    assert spec.auto == MemoryModel(bytes_per_token=1000.0, headroom=0.2)
    assert spec.for_step(lengths, tokens=77).tokens == 77  # the least the ranks sent
    for bad, message in (
        ("lots", "token count, Nx or auto"),
        ("0.9x", "factor must be >= 1"),
        ("0", ">= 1 token"),
        ("12.5", "whole number"),
        ("auto:speed=1", "unknown key 'speed'"),
        ("auto:headroom=1.5", "headroom must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            BudgetSpec.parse(bad)


def test_a_bad_memory_budget_fails_where_the_config_is_made():
    from fsdata.balancer import BalancerConfig

    assert BalancerConfig(memory_budget="1.05x").memory_budget == "1.05x"
    with pytest.raises(ValueError, match="--memory-budget"):
        BalancerConfig(memory_budget="half")


def test_the_auto_model_and_its_device(monkeypatch):
    model = MemoryModel(bytes_per_token=1000.0, fixed_bytes=1e6, headroom=0.1)
    assert model.tokens_for(11e6) == 8900  # (0.9 * 11e6 - 1e6) / 1000
    with pytest.raises(ValueError, match="leave no room for one token"):
        model.tokens_for(1e6)
    spec = BudgetSpec.parse("auto:bytes_per_token=1000,fixed_bytes=1e6,headroom=0.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="auto needs a CUDA device"):
        spec.rank_limit()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10e6, 80e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3e6)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2e6)
    assert spec.rank_limit() == (8900, 0.0)  # 10 MB free + 1 MB cached unused
    with pytest.raises(ValueError, match="this rank trains on cpu"):
        spec.rank_limit("cpu")


# ---------------------------------------------------------------------------------------------- on gloo ranks
def _budget_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    transport = get_transport("host", group=new_thread_group("balancer"))

    def loader(budget):
        source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=45, seed=3, uih_max=200))
        stages = balancer_stages(
            BalancerConfig(partitioner="vbs", memory_budget=budget), transport, rank, world_size, capacity=6
        )
        return build_loader(source, LoaderConfig(batch_size=6, prefetch_depth=1), rank, world_size, stages)

    # each rank its own limit (as auto gives): the step takes the least, the same on both
    steps = [
        (sorted(item.batch.sample_ids.tolist()), int((item.batch.uih_lengths + item.batch.num_candidates).sum()))
        for item in loader(["1.6x", "1.1x"][rank])
    ]
    unbudgeted = [int((item.batch.uih_lengths + item.batch.num_candidates).sum()) for item in loader(None)]
    try:
        next(iter(loader(["1.1x", None][rank])))
        refused = None
    except ValueError as error:
        refused = str(error)
    return steps, unbudgeted, refused


@pytest.mark.multiprocess
def test_ranks_agree_on_the_least_budget_and_hold_no_more():
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from tests.harness import run_ranks

    results = run_ranks(_budget_body, 2, timeout=90)
    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=45, seed=3, uih_max=200))
    (steps0, plain0, refused0), (steps1, plain1, refused1) = results
    assert max(max(a, b) / ((a + b) / 2) for a, b in zip(plain0, plain1)) > 1.2  # unbudgeted VBS goes over 1.1x
    for step, ((ids0, tokens0), (ids1, tokens1)) in enumerate(zip(steps0, steps1)):
        expected = source.read(0, step * 12, min((step + 1) * 12, 45))
        assert sorted(ids0 + ids1) == sorted(expected.sample_ids.tolist()), f"step {step}: samples lost or repeated"
        assert max(tokens0, tokens1) <= -(-11 * (tokens0 + tokens1) // 20), step  # 1.1x the mean: rank 1's limit
    assert all(r is not None and "set --memory-budget otherwise" in r for r in (refused0, refused1)), results
