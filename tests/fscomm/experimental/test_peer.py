"""The peer transport's logic that needs no GPU: the copy plan, the buffer growth policy, and the refusals, the
last on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fscomm.experimental.peer import PeerTransport, check_same_host, check_table, grown_capacity, plan_exchange
from fscomm.transport import TransportUnavailableError
from tests.harness import run_ranks


def _apply(sent: list[list[int]], offsets: list[list[int]], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs every rank's plan on CPU byte tensors in one process: pushes into the peers' buffers, the own piece
    straight into the result, then each rank's copy out (what the GPU copies do, in the same order)."""
    world = len(sent)
    plans = [plan_exchange(sent, offsets[r], r) for r in range(world)]
    need = plans[0].need
    assert all(p.need == need for p in plans)  # every rank derives the same buffer sizes
    buffers = [torch.full((need[d],), 255, dtype=torch.uint8) for d in range(world)]
    outs = [torch.full((sum(sent[s][d] for s in range(world)),), 255, dtype=torch.uint8) for d in range(world)]
    for r, plan in enumerate(plans):
        for d, src, n, dst in plan.pushes:
            assert dst + n <= need[d]
            buffers[d][dst : dst + n] = inputs[r][src : src + n]
        src, n, dst = plan.own
        outs[r][dst : dst + n] = inputs[r][src : src + n]
    for r, plan in enumerate(plans):
        for b, n, o in plan.copy_out:
            outs[r][o : o + n] = buffers[r][b : b + n]
    return outs


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda w: st.lists(st.lists(st.integers(0, 9), min_size=w, max_size=w), min_size=w, max_size=w)
    )
)
def test_all_to_all_plan_delivers_every_piece_once_in_rank_order(sent):
    world = len(sent)
    inputs = [torch.randint(0, 200, (sum(sent[r]),), dtype=torch.uint8) for r in range(world)]
    offsets = [[sum(sent[r][:d]) for d in range(world)] for r in range(world)]
    outs = _apply(sent, offsets, inputs)
    for d in range(world):
        want = torch.cat([inputs[s][offsets[s][d] : offsets[s][d] + sent[s][d]] for s in range(world)])
        assert torch.equal(outs[d], want), (sent, d)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5))
def test_all_gather_plan_sends_the_whole_input_to_every_rank(nbytes):
    world = len(nbytes)
    sent = [[nbytes[s]] * world for s in range(world)]
    inputs = [torch.randint(0, 200, (n,), dtype=torch.uint8) for n in nbytes]
    outs = _apply(sent, [[0] * world for _ in range(world)], inputs)
    for d in range(world):
        assert torch.equal(outs[d], torch.cat(inputs))


def test_plan_keeps_the_own_piece_out_of_the_buffer_and_skips_empty_copies():
    sent = [[3, 0, 2], [4, 5, 0], [0, 1, 6]]
    plan = plan_exchange(sent, [0, 3, 3], rank=1)
    assert plan.need == (
        4,
        1,
        2,
    )  # rank 1's buffer: rank 0's 0 bytes + rank 2's 1 byte; its own 5 bytes go straight out
    assert plan.pushes == ((0, 0, 4, 0),)  # nothing to rank 2 (0 bytes)
    assert plan.own == (3, 5, 0)
    assert plan.copy_out == ((0, 1, 5),)  # rank 2's byte lands after the own piece


def test_plan_refuses_a_table_of_the_wrong_shape():
    with pytest.raises(ValueError, match="2x2 byte table"):
        plan_exchange([[1, 2], [3]], [0, 0], 0)


def test_growth_policy():
    assert grown_capacity(0, 0) == 0  # nothing exchanged yet, nothing allocated
    assert grown_capacity(10, 0) == 1 << 20  # the minimum
    assert grown_capacity(3 << 20, 1 << 20) == 4 << 20  # the next power of two
    assert grown_capacity(4 << 20, 4 << 20) == 4 << 20  # exactly fits: unchanged
    assert grown_capacity(5, 8 << 20) == 8 << 20  # never shrinks
    assert grown_capacity(5, 0, minimum=4) == 8
    sizes, cap, remaps = [1000 * k for k in range(1, 20_000, 7)], 0, 0
    for need in sizes:  # a slowly growing exchange re-maps a logarithmic number of times
        new = grown_capacity(need, cap)
        remaps += new != cap
        cap = new
    assert cap >= sizes[-1] and remaps <= 6
    with pytest.raises(ValueError, match="non-negative"):
        grown_capacity(-1, 0)


def test_table_mismatch_names_both_ranks():
    sent = [[1, 2], [3, 4]]
    check_table(sent, [[1, 3], [2, 4]], "all_to_all", 0)
    with pytest.raises(ValueError, match=r"rank 1 expects 7 bytes from rank 0, which sends 2") as err:
        check_table(sent, [[1, 3], [7, 4]], "all_to_all", 1)
    assert "\n" not in str(err.value)


def test_same_host_check():
    check_same_host([("a", "0,1", 2), ("a", "0,1", 2)], 0)
    with pytest.raises(TransportUnavailableError, match="2 hosts .*use 'host' or 'rdma'") as err:
        check_same_host([("a", "", 8), ("b", "", 8)], 1)
    assert "\n" not in str(err.value)
    with pytest.raises(TransportUnavailableError, match="see different GPUs"):
        check_same_host([("a", "0", 1), ("a", "1", 1)], 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal")
def test_unavailable_without_cuda():
    assert "no CUDA device" in PeerTransport.unavailable_reason()


# --- on real gloo ranks ----------------------------------------------------------------------------------


def _refusals(rank, world_size):
    import torch.distributed as dist

    out = {}
    t = PeerTransport(dist.new_group(backend="gloo"))
    for name, call in {
        "cpu": lambda: t.all_to_all(torch.zeros(4), [2, 2], [2, 2]),
        "splits": lambda: t.all_to_all(torch.zeros(4), [2, 1], [2, 2]),
        "gather": lambda: t.all_gather(torch.zeros(4)),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.multiprocess
def test_refusals_on_gloo_ranks():
    for rank, out in enumerate(run_ranks(_refusals, 2, timeout=60)):
        assert f"on rank {rank}: needs a CUDA tensor, got one on cpu" in out["cpu"]
        assert "send_splits sum to 3 but the tensor has 4 rows" in out["splits"]  # the shared checks come first
        assert "needs a CUDA tensor" in out["gather"]
        assert all("\n" not in msg for msg in out.values())


def _hosts(rank, world_size):
    import socket

    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    if rank == 1:
        socket.gethostname = lambda: "other-host"
    try:
        PeerTransport(group)
    except TransportUnavailableError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_ranks_on_different_hosts_are_refused_on_every_rank():
    for rank, msg in enumerate(run_ranks(_hosts, 2, timeout=60)):
        assert msg is not None and f"transport 'peer' on rank {rank}: the ranks are on 2 hosts" in msg


def _groups(rank, world_size):
    import torch.distributed as dist

    from fscomm import groups

    PeerTransport(dist.group.WORLD)  # any gloo group will do
    t = PeerTransport(PeerTransport.default_group())
    t.close()  # nothing mapped yet: a barrier, then refusals
    try:
        t.all_gather(torch.zeros(1))
        closed = None
    except RuntimeError as exc:
        closed = str(exc)
    return groups.group_state(t.group).name, groups.default_group("gloo") is t.group, closed


@pytest.mark.multiprocess
def test_its_own_default_group_and_close_before_use():
    for rank, (name, shared_with_host, closed) in enumerate(run_ranks(_groups, 2, timeout=60)):
        assert name == "fscomm-default-peer" and not shared_with_host
        assert closed == f"fscomm peer all_gather on rank {rank}: the transport is closed"
