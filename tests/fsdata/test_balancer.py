"""The balancer stages on real gloo ranks: exactly once, same plan everywhere (checked: one small AllGather per
step), three exchanges per step, resume; a partitioner that raises or differs between ranks is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import doing, run_ranks

NUM_SAMPLES = (
    45  # 45 = 3 full global steps of 2x6 + 9: the last global batch is uneven (and empty on some ranks at W=4)
)
BATCH = 6


class CountingTransport:
    """Wraps a transport and counts the collectives issued through it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def all_gather(self, tensor, sizes=None):
        self.calls.append("all_gather")
        return self.inner.all_gather(tensor, sizes)

    def all_to_all(self, tensor, send_splits, recv_splits):
        self.calls.append("all_to_all")
        return self.inner.all_to_all(tensor, send_splits, recv_splits)


def _loader(rank, world_size, partitioner, transport, prefetch=1, lookahead=True):
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=NUM_SAMPLES, seed=3, uih_max=200))
    stages = balancer_stages(BalancerConfig(partitioner=partitioner), transport, rank, world_size, capacity=BATCH)
    config = LoaderConfig(batch_size=BATCH, prefetch_depth=prefetch, stage_lookahead=lookahead)
    return build_loader(source, config, rank, world_size, stages), source


def _exactly_once_body(rank, world_size, partitioner, lookahead=True):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group

    transport = CountingTransport(get_transport("host", group=new_thread_group("balancer")))
    loader, source = _loader(rank, world_size, partitioner, transport, lookahead=lookahead)
    steps = []
    for item in loader:
        batch, info = item.batch, item.report
        doing(f"step {len(steps)}")
        steps.append((sorted(batch.sample_ids.tolist()), info, batch))
    return steps, transport.calls, len(steps)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "partitioner,world_size,lookahead",
    [("fbs", 2, True), ("fbs", 2, False), ("vbs", 3, True), ("kk", 4, True), ("fbs", 4, True)],
)
def test_exactly_once_and_same_plan(partitioner, world_size, lookahead):
    """``lookahead``: the stage worker starts each exchange one batch early (the default) or finishes it at once."""
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    results = run_ranks(_exactly_once_body, world_size, args=(partitioner, lookahead), timeout=90)
    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=NUM_SAMPLES, seed=3, uih_max=200))
    global_batch = BATCH * world_size
    num_steps = -(-NUM_SAMPLES // global_batch)
    for rank_steps, calls, n in results:
        assert n == num_steps
        # Stage I + Stage II + the plan check + Stage III: no size exchange.
        assert calls.count("all_gather") == 3 * num_steps and calls.count("all_to_all") == num_steps, calls
    for step in range(num_steps):
        expected = source.read(0, step * global_batch, min((step + 1) * global_batch, NUM_SAMPLES))
        got = [sid for rank_steps, _, _ in results for sid in rank_steps[step][0]]
        assert sorted(got) == sorted(expected.sample_ids.tolist()), f"step {step}: samples lost or repeated"
        # Same plan everywhere: every rank reports identical balance measures for the step.
        infos = [rank_steps[step][1] for rank_steps, _, _ in results]
        assert all(i == infos[0] for i in infos)
        # Whole samples moved intact: every balanced sample equals the source's sample with that id.
        by_id = {s.sample_id: s for s in expected.to_samples()}
        for rank_steps, _, _ in results:
            for s in rank_steps[step][2].to_samples():
                ref = by_id[s.sample_id]
                assert (s.uih_item_ids == ref.uih_item_ids).all() and (s.uih_timestamps == ref.uih_timestamps).all()
                assert (s.candidate_labels == ref.candidate_labels).all() and (s.dense == ref.dense).all()
                assert len(s.content_ids) == len(ref.content_ids)
                assert all((a == b).all() for a, b in zip(s.content_ids, ref.content_ids))


def _balance_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group

    transport = get_transport("host", group=new_thread_group("balancer"))
    loader, _ = _loader(rank, world_size, "fbs", transport)
    return [item.report for item in loader]


@pytest.mark.multiprocess
def test_fbs_does_not_worsen_imbalance():
    infos = run_ranks(_balance_body, 2, timeout=60)[0]
    full = [i for i in infos if i["global_samples"] == BATCH * 2]
    # Zig-zag is a heuristic: one step may come out worse, the steps on the whole must not.
    before = sum(i["imbalance_before"] for i in full) / len(full)
    after = sum(i["imbalance_after"] for i in full) / len(full)
    assert after < before, (before, after)


def _resume_body(rank, world_size, lookahead):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from tests.stateful import run_test_save_load_state

    transport = get_transport("host", group=new_thread_group("balancer"))
    run_test_save_load_state(lambda: _loader(rank, world_size, "vbs", transport, lookahead=lookahead)[0], midpoint=2)
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("lookahead", [True, False])
def test_resume_is_exact(lookahead):
    assert run_ranks(_resume_body, 2, args=(lookahead,), timeout=120) == [True, True]


_PLANNED_IDS: list = []  # per call of reversed_fbs in this process: every rank's sample ids in plan order


def reversed_fbs(lengths, runtime):
    """FBS with each rank's samples listed backwards: an order within a rank that is not source-major."""
    from fsdata.partition import Plan, get_partitioner

    plan = get_partitioner("fbs")(lengths, runtime)
    offs = plan.dest_offsets.tolist()
    order = torch.cat([plan.order[a:b].flip(0) for a, b in zip(offs[:-1], offs[1:])])
    reversed_plan = Plan(order, plan.dest_offsets.clone())
    source = torch.searchsorted(lengths.rank_offsets, order, right=True) - 1
    _PLANNED_IDS.append(
        (
            [lengths.sample_ids[reversed_plan.rank_samples(q)].tolist() for q in range(lengths.world_size)],
            any(bool((source[a:b].diff() < 0).any()) for a, b in zip(offs[:-1], offs[1:])),
        )
    )
    return reversed_plan


def _custom_order_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group

    transport = get_transport("host", group=new_thread_group("balancer"))
    loader, _ = _loader(rank, world_size, "tests.fsdata.test_balancer:reversed_fbs", transport)
    batches = []
    for item in loader:
        doing(f"step {len(batches)}")
        batches.append(item.batch)
    return batches, list(_PLANNED_IDS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_custom_order_within_rank(world_size):
    """A plan whose order within a rank is not source-major: samples arrive intact, in the plan's order."""
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    results = run_ranks(_custom_order_body, world_size, timeout=90)
    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=NUM_SAMPLES, seed=3, uih_max=200))
    global_batch = BATCH * world_size
    num_steps = -(-NUM_SAMPLES // global_batch)
    planned = results[0][1]
    assert len(planned) == num_steps
    assert any(not_source_major for _, not_source_major in planned), "the test plan never left source-major order"
    for rank, (batches, rank_planned) in enumerate(results):
        assert len(batches) == num_steps
        assert rank_planned == planned  # every rank computed the same plans
        for step, batch in enumerate(batches):
            assert batch.sample_ids.tolist() == planned[step][0][rank], f"rank {rank} step {step}: not in plan order"
            expected = source.read(0, step * global_batch, min((step + 1) * global_batch, NUM_SAMPLES))
            by_id = {s.sample_id: s for s in expected.to_samples()}
            for s in batch.to_samples():
                ref = by_id[s.sample_id]
                assert (s.uih_item_ids == ref.uih_item_ids).all() and (s.uih_timestamps == ref.uih_timestamps).all()
                assert s.user_id == ref.user_id and (s.uih_action_types is None) == (ref.uih_action_types is None)
                assert s.uih_action_types is None or (s.uih_action_types == ref.uih_action_types).all()
                assert (s.candidate_labels == ref.candidate_labels).all() and (s.dense == ref.dense).all()
                assert len(s.content_ids) == len(ref.content_ids)
                assert all((a == b).all() for a, b in zip(s.content_ids, ref.content_ids))


def _autotune_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader
    from fsdata.nodes.gather_lengths import StepFeedback
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=400, seed=5, uih_max=200))
    feedback = StepFeedback()
    transport = get_transport("host", group=new_thread_group("balancer"))
    stages = balancer_stages(BalancerConfig("vbs", autotune=True), transport, rank, world_size, BATCH, feedback)
    counts = []
    for step, item in enumerate(
        build_loader(source, LoaderConfig(batch_size=BATCH, prefetch_depth=0), rank, world_size, stages)
    ):
        batch = item.batch
        # Rank 1 is twice as slow per token: autotune must move work to rank 0.
        feedback.report(step, float(batch.uih_lengths.sum()) * (2.0 if rank == 1 else 1.0) * 1e-4)
        counts.append(int(batch.uih_lengths.sum()))
    return counts


@pytest.mark.multiprocess
def test_vbs_autotune_moves_work_off_a_slow_rank():
    fast, slow = run_ranks(_autotune_body, 2, timeout=90)
    late = slice(len(fast) // 2, None)
    assert sum(fast[late]) > 1.3 * sum(slow[late]), (fast, slow)


def _gate_body(rank, world_size, lengths_matter):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader
    from fsdata.nodes.gather_lengths import StepFeedback
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=240, seed=5, uih_max=200))
    feedback = StepFeedback()
    transport = CountingTransport(get_transport("host", group=new_thread_group("balancer")))
    stages = balancer_stages(BalancerConfig("fbs", min_gain=0.05), transport, rank, world_size, BATCH, feedback)
    loader = build_loader(source, LoaderConfig(batch_size=BATCH, prefetch_depth=0), rank, world_size, stages)
    steps = []
    for step, item in enumerate(loader):
        batch, info = item.batch, item.report
        # The "measured" compute time: a launch-bound step (constant), or one that grows with sum(L^2).
        tokens = batch.uih_lengths.double() + batch.candidate_offsets.diff().double()
        feedback.report(step, 4e-3 + (1e-6 * float((tokens**2).sum()) if lengths_matter else 0.0))
        steps.append((batch.sample_ids.tolist(), info["exchanged"], info["predicted_gain"]))
    return steps, transport.calls


@pytest.mark.multiprocess
@pytest.mark.parametrize("lengths_matter", [False, True])
def test_balance_gate_skips_the_sample_exchange_only_where_it_cannot_pay(lengths_matter):
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    results = run_ranks(_gate_body, 2, args=(lengths_matter,), timeout=90)
    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=240, seed=5, uih_max=200))
    (steps0, calls0), (steps1, calls1) = results
    assert len(steps0) == len(steps1) == 240 // (2 * BATCH)
    exchanged = [e for _, e, _ in steps0]
    assert exchanged == [e for _, e, _ in steps1]  # every rank made the same decision
    assert [g for _, _, g in steps0] == [g for _, _, g in steps1]
    for calls in (calls0, calls1):  # Stages I, II and the plan check every step; Stage III only where samples move
        assert calls.count("all_gather") == 3 * len(exchanged) and calls.count("all_to_all") == sum(exchanged)
    gains = [g for _, _, g in steps0]
    # Moved exactly where there is no prediction yet, or one of at least min_gain.
    assert exchanged == [g is None or g >= 0.05 for g in gains], list(zip(exchanged, gains))
    # The loader's lookahead delays the first prediction (two measured steps are needed); from then on every step
    # has one.
    first = next((i for i, g in enumerate(gains) if g is not None), len(gains))
    assert 2 <= first <= 14 and all(g is not None for g in gains[first:]), gains
    predicted = gains[first:]
    if lengths_matter:  # FBS's plan pays on some steps (not all: on 2 x 6 short samples it can even lose)
        assert max(predicted) >= 0.05, gains
    else:  # the lengths do not matter: nothing to gain, every step after the first prediction kept local
        assert max(abs(g) for g in predicted) < 1e-9 and not any(exchanged[first:]), gains
    for step, ((ids0, e, _), (ids1, _, _)) in enumerate(zip(steps0, steps1)):
        expected = source.read(0, step * 2 * BATCH, (step + 1) * 2 * BATCH).sample_ids.tolist()
        assert sorted(ids0 + ids1) == sorted(expected), f"step {step}: samples lost or repeated"
        if not e:
            assert ids0 + ids1 == expected, f"step {step}: kept local, yet not the source's local batches"


def test_measurements_join_the_ranks_reports_across_items_and_resume():
    from fsdata.nodes.partition_stage import _Measurements

    m = _Measurements()
    t = lambda *x: torch.tensor(x, dtype=torch.float64)
    s = lambda *x: torch.tensor(x, dtype=torch.int64)
    assert m.add(s(-1, -1), t(0, 0)) == []  # nothing measured yet
    assert m.add(s(3, 2), t(0.3, 0.2)) == []  # rank 0 read its report of step 3, rank 1 still step 2
    saved = m.state_dict()
    for joined in (m, _Measurements()):
        if joined is not m:
            joined.load_state_dict(saved)
        done = joined.add(s(5, 3), t(0.5, 0.31))  # step 3 is whole now; step 2 never will be (rank 0 skipped it)
        assert [(step, times.tolist()) for step, times in done] == [(3, [0.3, 0.31])]
        assert joined.newest == 3 and list(joined.partial) == [5]
        assert joined.add(s(3, 3), t(9.0, 9.0)) == []  # a step already handed out is not handed out twice
    assert m.add(s(6, 6, 6), t(1, 1, 1))[0][0] == 6 and m.partial == {}  # another world size: old reports dropped


def _expected_stats(values, offsets):
    """Per rank: token sum and Eq. 1 sparsity, one segment at a time (fsdata.balance_measures.sparsity)."""
    from fsdata.balance_measures import sparsity

    return (
        [int(sum(values[lo:hi])) for lo, hi in zip(offsets[:-1], offsets[1:])],
        [sparsity(np.asarray(values[lo:hi], dtype=np.int64)) for lo, hi in zip(offsets[:-1], offsets[1:])],
    )


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=12))
def test_per_rank_stats_match_the_per_segment_definition(segments):
    from fsdata.nodes.shuffle import _per_rank_stats

    values = [v for seg in segments for v in seg]
    offsets = np.cumsum([0] + [len(seg) for seg in segments])
    tokens, sparse = _per_rank_stats(np.asarray(values, dtype=np.int64), offsets)
    want_tokens, want_sparse = _expected_stats(values, offsets.tolist())
    assert tokens == want_tokens
    assert sparse == pytest.approx(want_sparse, abs=1e-12)


def test_partition_stage_resumes_from_a_state_saved_before_the_join():
    """Checkpoints of earlier versions: no joined measurements, autotune's state wrapped with its last step."""
    from fsdata.nodes.partition_stage import PartitionStage
    from fsdata.partition import AutoTune, get_partitioner

    class _Source:
        def reset(self, state):
            self.state = state

    tuned = AutoTune(2)
    tuned.observe(0, torch.tensor([1.0, 2.0], dtype=torch.float64))
    stage = PartitionStage(_Source(), get_partitioner("vbs"), AutoTune(2))
    stage.reset({"source": {"x": 1}, "step": 5, "autotune": {"state": tuned.state_dict(), "last_observed": 0}})
    assert stage.autotune.state_dict() == tuned.state_dict() and stage._step == 5 and stage._measured.newest == -1


class ExtraFeatureSource:
    """The tiny synthetic source with a user's extra features, each a function of the sample id: two jagged
    fields (ids of variable length, some samples empty; float scores) and two dense ones (a scalar, an id pair)."""

    def __init__(self, num_samples):
        from fsdata.synthetic import SyntheticConfig, SyntheticSource

        self.inner = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=num_samples, seed=3, uih_max=200))

    def num_samples(self, epoch):
        return self.inner.num_samples(epoch)

    def describe(self):
        return "tiny synthetic with extra features"

    def read(self, epoch, start, stop):
        from fsdata.batch import Jagged

        batch = self.inner.read(epoch, start, stop)
        sid = batch.sample_ids
        lengths = sid % 4
        categories = torch.cat(
            [s * 10 + torch.arange(int(n)) for s, n in zip(sid.tolist(), lengths.tolist())]
            or [torch.zeros(0, dtype=torch.int64)]
        )
        batch.extra_jagged = {
            "category_ids": Jagged.from_lengths(categories, lengths),
            "scores": Jagged.from_lengths(sid.repeat_interleave(2).float() / 7, torch.full_like(sid, 2)),
        }
        batch.extra_dense = {"age": sid.float() * 0.5, "pair": torch.stack([sid, -sid], 1)}
        return batch


def _extras_body(rank, world_size, partitioner):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader

    transport = get_transport("host", group=new_thread_group("balancer"))
    stages = balancer_stages(BalancerConfig(partitioner=partitioner), transport, rank, world_size, capacity=BATCH)
    loader = build_loader(
        ExtraFeatureSource(NUM_SAMPLES), LoaderConfig(batch_size=BATCH, prefetch_depth=1), rank, world_size, stages
    )
    return [(item.batch.to_samples(), item.report["exchanged"]) for item in loader]


@pytest.mark.multiprocess
@pytest.mark.parametrize("partitioner,world_size", [("fbs", 2), ("tests.fsdata.test_balancer:reversed_fbs", 3)])
def test_shuffle_moves_the_users_extra_features(partitioner, world_size):
    """Every extra jagged and dense field travels with its sample through Stage III, whatever the plan's order."""
    results = run_ranks(_extras_body, world_size, args=(partitioner,), timeout=90)
    expected = {s.sample_id: s for s in ExtraFeatureSource(NUM_SAMPLES).read(0, 0, NUM_SAMPLES).to_samples()}
    seen = []
    for steps in results:
        for samples, _ in steps:
            for s in samples:
                ref = expected[s.sample_id]
                assert sorted(s.extra_jagged) == ["category_ids", "scores"] and sorted(s.extra_dense) == ["age", "pair"]
                for k in ref.extra_jagged:
                    assert (
                        s.extra_jagged[k].dtype == ref.extra_jagged[k].dtype
                        and (s.extra_jagged[k] == ref.extra_jagged[k]).all()
                    )
                for k in ref.extra_dense:
                    assert (
                        s.extra_dense[k].dtype == ref.extra_dense[k].dtype
                        and (s.extra_dense[k] == ref.extra_dense[k]).all()
                    )
                assert (s.uih_item_ids == ref.uih_item_ids).all() and (s.dense == ref.dense).all()
                seen.append(s.sample_id)
    assert sorted(seen) == sorted(expected)
    assert any(moved for steps in results for _, moved in steps)


def _mismatched_extras_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader

    source = ExtraFeatureSource(NUM_SAMPLES)
    if rank == 1:  # one rank's reader lacks a field
        read = source.read
        source.read = lambda *a: (lambda b: (b.extra_dense.pop("age"), b)[1])(read(*a))
    transport = get_transport("host", group=new_thread_group("balancer"))
    stages = balancer_stages(BalancerConfig(partitioner="fbs"), transport, rank, world_size, capacity=BATCH)
    loader = build_loader(source, LoaderConfig(batch_size=BATCH, prefetch_depth=0), rank, world_size, stages)
    try:
        next(iter(loader))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
def test_ranks_with_other_extra_features_are_refused():
    messages = run_ranks(_mismatched_extras_body, 2, timeout=60)
    assert all(m is not None and "extra features differ" in m for m in messages), messages


def _extras_resume_body(rank, world_size):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.balancer import BalancerConfig, balancer_stages
    from fsdata.loader import LoaderConfig, build_loader
    from tests.stateful import run_test_save_load_state

    transport = get_transport("host", group=new_thread_group("balancer"))

    def make():
        stages = balancer_stages(BalancerConfig(partitioner="kk"), transport, rank, world_size, capacity=BATCH)
        return build_loader(
            ExtraFeatureSource(NUM_SAMPLES), LoaderConfig(batch_size=BATCH, prefetch_depth=1), rank, world_size, stages
        )

    run_test_save_load_state(make, midpoint=2)
    return True


@pytest.mark.multiprocess
def test_resume_with_extra_features_is_exact():
    assert run_ranks(_extras_resume_body, 2, timeout=120) == [True, True]


def raises_on_rank_1_at_step_1(lengths, runtime):
    import torch.distributed as dist

    if runtime.step == 1 and dist.get_rank() == 1:
        raise RuntimeError("no plan for this step")
    return np.arange(lengths.num_samples) % lengths.world_size


def differs_on_rank_1_at_step_1(lengths, runtime):
    import torch.distributed as dist

    dest = np.arange(lengths.num_samples) % lengths.world_size
    return (dest + 1) % lengths.world_size if runtime.step == 1 and dist.get_rank() == 1 else dest


def local_on_rank_0_at_step_1(lengths, runtime):
    """Rank 0 keeps every sample where it is, so it would skip the Stage III exchange that rank 1 waits in."""
    import torch.distributed as dist

    if runtime.step == 1 and dist.get_rank() == 0:
        return np.repeat(np.arange(lengths.world_size), lengths.source_counts().numpy())
    return np.arange(lengths.num_samples) % lengths.world_size


def _partitioner_fault_body(rank, world_size, partitioner):
    from fscomm import get_transport
    from fscomm.groups import new_thread_group
    from fsdata.loader import shutdown_loader

    loader, _ = _loader(rank, world_size, partitioner, get_transport("host", group=new_thread_group("balancer")))
    try:
        for _ in loader:
            pass
    except ValueError as error:
        return str(error), error.root
    finally:
        shutdown_loader(loader)
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name", ["raises_on_rank_1_at_step_1", "differs_on_rank_1_at_step_1", "local_on_rank_0_at_step_1"]
)
def test_a_partitioner_that_raises_or_differs_between_ranks_is_named_on_every_rank(name):
    """Every rank stops at the step with a line naming the partitioner: the rank where it raised as the cause, the
    others as following it; plans that differ (one of them an identity plan that would skip Stage III) alike."""
    spec = f"{__name__}:{name}"
    (line0, root0), (line1, root1) = run_ranks(_partitioner_fault_body, 2, args=(spec,), timeout=90)
    if name.startswith("raises"):
        assert (line1, root1) == (f"partitioner {spec} raised RuntimeError at step 1: no plan for this step", True)
        assert (line0, root0) == (f"partitioner {spec} failed on rank(s) [1] at step 1; rank 0 stops with it", False)
        return
    expected = (
        f"partitioner {spec} returned different plans on ranks 0 and 1 at step 1 (a plan must be a pure function of"
        " the gathered lengths)"
    )
    assert (line0, root0) == (line1, root1) == (expected, True)
