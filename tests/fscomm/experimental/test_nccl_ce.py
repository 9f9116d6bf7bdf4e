"""The copy-engine NCCL transport's logic that runs without GPUs: every rank takes the same buffer slot and
registers (a collective) at the same call, and the padded layout round-trips with plain byte-range copies."""

from __future__ import annotations

import random

import torch

from fscomm.experimental.nccl_ce import SLOTS, SlotPlan, pad_pieces


def _rank_calls(rank: int, world_size: int, n_calls: int) -> list[tuple[int, int]]:
    """The bytes each call of one rank needs: its splits differ from the other ranks', pad_to does not."""
    rng = random.Random(rank)  # per-rank splits
    shared = random.Random(7)  # what every rank knows: the largest split of the step (pad_to), the row size
    needs = []
    for _ in range(n_calls):
        pad_to, row_bytes = shared.choice([1, 8, 64, 512]), shared.choice([2, 8, 256])
        splits = [rng.randint(0, pad_to) for _ in range(world_size)]
        assert max(splits) <= pad_to
        needs.append(world_size * pad_to * row_bytes)
    return needs


def test_every_rank_registers_and_takes_slots_at_the_same_calls():
    W = 4
    decisions = []
    for rank in range(W):
        plan = SlotPlan()
        decisions.append([plan.next(n) for n in _rank_calls(rank, W, 200)])
        assert plan.capacity == max(_rank_calls(rank, W, 200))
    assert all(d == decisions[0] for d in decisions)
    grows = [g for _, g in decisions[0] if g is not None]
    assert len(grows) <= 1 + max(grows).bit_length()  # bounded: at most doubling, SLOTS pairs at a time
    assert [s for s, _ in decisions[0][:4]] == [i % SLOTS for i in range(4)]


def test_padded_layout_round_trips_with_byte_range_copies():
    rb, block_rows = 3, 5
    splits = [2, 0, 5, 1]
    packed = torch.arange(sum(splits) * rb, dtype=torch.uint8)
    padded = torch.full((len(splits) * block_rows * rb,), 255, dtype=torch.uint8)
    pieces = pad_pieces([n * rb for n in splits], block_rows * rb)
    assert len(pieces) == 3  # no copy for an empty block
    for src, dst in pieces:
        padded[dst].copy_(packed[src])
    back = torch.empty_like(packed)
    for src, dst in pieces:
        back[src].copy_(padded[dst])
    assert torch.equal(back, packed)
    assert padded[block_rows * rb : 2 * block_rows * rb].eq(255).all()  # rank 1's block is padding only
