"""The capped deal of a memory budget (budget.py, VBS): LPT under a per-rank token cap, a round of ranks at a time.

The rule, one sample at a time: samples in the given (cost-descending) order, each to the rank of least ``load /
share`` (ties: the lower rank) among the ranks with room for its tokens. Taken literally that is a heap pop per
sample, plus a pop and push per full rank it passes over: 170 ms at 1,024 ranks x 128 samples, and seconds when
autotuned shares fill some ranks early (every later sample passes over them).

The same plan comes out of rounds. Sort the ranks by ``(load / share, rank)`` and give the next ``m`` samples to
the first ``m`` ranks with room for all of them, in that order. That is what the one-at-a-time rule does as long
as (1) every rank that received a sample earlier in the round now weighs more than the rank next in line, and (2)
no rank ahead in line with room for some but not all of the round's samples has room for the sample at hand;
a round stops before its first sample where either fails. On heavy-tailed steps nearly every round is a whole
round of ranks (128 rounds for 131,072 samples on 1,024 ranks), each a sort of ``W`` keys. Where rounds come out
short (ties in ``load / share``, few ranks), a stretch of samples goes through the heap instead, whose full ranks
wait in a second heap by their room until a sample small enough for them comes (so passing over them costs
nothing). Both paths compute ``load / share`` with the same float operations, so the plan is the same bit for bit.
"""

from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

# A round costs ~75 us at 1,024 ranks, as much as ~50 samples on the heap: with fewer ranks than this, the heap
# only; a round that deals fewer samples than this hands the next W samples to the heap before rounds resume.
ROUND_MIN_RANKS = 64
SHORT_ROUND = 64


def deal_with_room(
    order: np.ndarray, costs: np.ndarray, tokens: np.ndarray, shares: np.ndarray, limit: int
) -> Optional[np.ndarray]:
    """[G] ranks: each sample of ``order`` (cost-descending) to the rank of least ``load / share`` that has room
    for its tokens (LPT under a cap); None if a sample finds no room (impossible for ``limit >=
    guaranteed_tokens``). The first ``W`` samples go to distinct ranks, so none is left empty when ``G >= W``."""
    ranks = deal_in_order(costs[order], tokens[order], shares, limit)
    if ranks is None:
        return None
    dest = np.empty(order.size, dtype=np.int64)
    dest[order] = ranks
    return dest


def deal_in_order(sorted_costs: np.ndarray, needs: np.ndarray, shares: np.ndarray, limit: int) -> Optional[np.ndarray]:
    """[G] the rank of each sample of :func:`deal_with_room`, the samples given already in its order: their costs
    and their tokens (``needs``)."""
    state = _DealState(sorted_costs, needs.astype(np.int64, copy=False), shares, int(limit))
    start, count, world = 0, sorted_costs.size, shares.size
    if world < ROUND_MIN_RANKS:
        return state.rank if state.on_heap(0, count) is not None else None
    while start < count:
        taken = state.round(start)
        start += taken
        if taken < SHORT_ROUND and start < count:  # short rounds: a stretch on the heap, then rounds again
            stretch = state.on_heap(start, min(count, start + world))
            if stretch is None:
                return None
            start = stretch
    return state.rank


class _DealState:
    """Per-rank load, tokens held and ``load / share`` key; ``rank[j]`` for every sample dealt so far."""

    def __init__(self, costs: np.ndarray, needs: np.ndarray, shares: np.ndarray, limit: int) -> None:
        self.costs, self.needs, self.limit = costs, needs, limit
        self.inverse = 1.0 / np.maximum(shares, 1e-300)
        self.load = np.zeros(shares.size)
        self.held = np.zeros(shares.size, dtype=np.int64)
        self.key = np.zeros(shares.size)  # load * inverse, as the heap holds it
        self.rank = np.empty(costs.size, dtype=np.int64)
        # Keys of loads >= 0 are floats >= 0 (never -0.0), whose bits as int64 sort as the floats do, and an
        # int64 stable sort is a quarter faster; NaN or negative costs sort as floats.
        self.sort_key = self.key.view(np.int64) if costs.size and bool((costs >= 0).all()) else self.key

    def round(self, start: int) -> int:
        """Deals samples ``start, start + 1, ...`` in one round as far as that equals dealing them one at a time
        (module docstring); returns how many it dealt."""
        stop = min(start + self.key.size, self.costs.size)
        needs, costs = self.needs[start:stop], self.costs[start:stop]
        in_line = np.argsort(self.sort_key, kind="stable")  # by (key, rank)
        most_room_ahead = None
        if int(self.held.max()) + int(needs.max()) > self.limit:  # else every rank has room for every sample
            room_in_line = (self.limit - self.held)[in_line]
            fits_all = room_in_line >= needs.max()
            places = np.flatnonzero(fits_all)[: needs.size]  # where in line the ranks that take the round stand
            if places.size == 0:
                return 0
            in_line, needs, costs = in_line[places], needs[: places.size], costs[: places.size]
            fits_some = ~fits_all & (room_in_line >= needs.min())
            if fits_some.any():  # (2): the most room among such ranks ahead in line must be too little
                most_room_ahead = np.maximum.accumulate(np.where(fits_some, room_in_line, -1))[places]
        ranks = in_line[: needs.size]
        new_load = self.load[ranks] + costs
        new_key = new_load * self.inverse[ranks]
        ok = np.empty(ranks.size, dtype=bool)  # (1): the ranks served earlier in the round now weigh more
        ok[0] = True
        np.greater(np.minimum.accumulate(new_key[:-1]), self.key[ranks[1:]], out=ok[1:])
        if most_room_ahead is not None:
            ok &= most_room_ahead < needs
        taken = ranks.size if ok.all() else int(ok.argmin())
        ranks = ranks[:taken]
        self.load[ranks] = new_load[:taken]
        self.held[ranks] += needs[:taken]
        self.key[ranks] = new_key[:taken]
        self.rank[start : start + taken] = ranks
        return taken

    def on_heap(self, start: int, stop: int) -> Optional[int]:
        """Deals samples ``start:stop`` one at a time; returns ``stop``, or None if a sample finds no room."""
        limit, inverse = self.limit, self.inverse.tolist()
        load, held, key = self.load.tolist(), self.held.tolist(), self.key.tolist()
        ready = [(k, r) for r, k in enumerate(key)]  # ranks that had room for the last sample, by key
        heapq.heapify(ready)
        full: list[tuple[int, int]] = []  # the others, by room (largest first): (held - limit, rank)
        ranks = []
        for cost, need in zip(self.costs[start:stop].tolist(), self.needs[start:stop].tolist()):
            while full and -full[0][0] >= need:
                r = heapq.heappop(full)[1]
                heapq.heappush(ready, (key[r], r))
            while ready and held[ready[0][1]] + need > limit:
                r = heapq.heappop(ready)[1]
                heapq.heappush(full, (held[r] - limit, r))
            if not ready:
                return None
            r = heapq.heappop(ready)[1]
            held[r] += need
            load[r] += cost
            key[r] = load[r] * inverse[r]
            heapq.heappush(ready, (key[r], r))
            ranks.append(r)
        self.rank[start:stop] = ranks
        self.load[:], self.held[:], self.key[:] = load, held, key
        return stop
