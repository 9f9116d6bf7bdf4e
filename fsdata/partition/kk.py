"""KK: Karmarkar-Karp largest differencing, multiway, with equal counts per rank.

The method of NVIDIA recsys-examples' balanced shuffler and of verl's sequence balancing, written here from the
algorithm (Karmarkar & Karp 1982; the k-way generalisation of Michiels, Korst, Aarts, van Leeuwen 2003):

1. Sort samples by cost, largest first (the deterministic order FBS uses). Pad with zero-cost dummies up to a
   multiple of n, so the dummies (fewer than n) all land in the last chunk.
2. Every chunk of n consecutive samples is a *partial partition*: n subsets of one sample each. All subsets of a
   partial partition always hold the same number of samples, which is what makes the counts equal.
3. Repeatedly take the two partial partitions whose spread (max subset sum - min subset sum) is largest and merge
   them, pairing the heaviest subset of one with the lightest of the other (heaviest-with-lightest, then
   second-heaviest with second-lightest...). Their differences cancel, which is the "differencing".
4. The last one standing is the plan. Its subsets go to ranks by ascending dummy count, then descending sum, so
   with ``m = G % n != 0`` ranks ``0..m-1`` get the one extra sample (as in FBS's even case).

A partial partition is a dense [n, k] array of sample positions plus [n] sums, so a merge is a sort of n sums and
one concatenation: ``G/n - 1`` merges of O(n log n + size) numpy work each. Measured at G = 65,536 and n = 512
(128 chunks): see docs/balancer.md.

Memory budget (``RuntimeInfo.memory_budget``, budget.py). Every final subset holds one sample of each chunk, so
with chunks cut in token order a rank holds at most the largest sample's tokens plus S/n. The plan is first made
with chunks in cost order (the same chunks when the cost is monotone in tokens, as the default is); if it breaks
the budget, again with chunks in token order (the differencing still balances cost inside that structure), then
repaired by count-keeping swaps.
"""

from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from fsdata.partition.base import GatheredLengths, Plan, RuntimeInfo, cost_sort_order
from fsdata.partition.budget import honour, token_sort_order
from fsdata.partition.cost import CostModel


def kk_equal_count(sorted_costs: np.ndarray, world_size: int) -> np.ndarray:
    """[G] destination rank of each position of ``sorted_costs``, equal counts (+-1): every rank takes one
    position of each chunk of n consecutive positions. Descending costs make the chunks KK's own; any other order
    (the token order of a memory budget) is differenced inside its chunks just the same.

    Deterministic: ties in the heap are broken by creation order, and sums are added in a fixed order.
    """
    count = sorted_costs.size
    if world_size == 1 or count == 0:
        return np.zeros(count, dtype=np.int64)
    chunks = -(-count // world_size)
    padded = np.zeros(chunks * world_size)
    padded[:count] = sorted_costs
    positions = np.arange(chunks * world_size, dtype=np.int64).reshape(chunks, world_size)
    sums_by_chunk = padded.reshape(chunks, world_size)

    heap: list[tuple[float, int]] = []
    states: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id -> (members [n, k], sums [n] descending)
    for c in range(chunks):
        heaviest_first = np.argsort(-sums_by_chunk[c], kind="stable")  # identity for descending costs
        sums = sums_by_chunk[c][heaviest_first]
        states[c] = (positions[c][heaviest_first][:, None], sums)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), c))
    next_id = chunks
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        members_a, sums_a = states.pop(a)
        members_b, sums_b = states.pop(b)
        # a and b are stored heaviest-first: pair a's heaviest with b's lightest.
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


class KKPartitioner:
    name = "kk"

    def __init__(self, cost_model: Optional[CostModel] = None) -> None:
        self.cost_model = cost_model or CostModel()

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        costs = self.cost_model.sample_costs(lengths, runtime)
        sorted_index = cost_sort_order(costs, lengths)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = kk_equal_count(costs[sorted_index], lengths.world_size)

        def in_token_chunks(tokens: np.ndarray) -> np.ndarray:
            order = token_sort_order(tokens, costs, lengths)
            by_tokens = np.empty_like(dest)
            by_tokens[order] = kk_equal_count(costs[order], lengths.world_size)
            return by_tokens

        dest = honour(dest, lengths, runtime.memory_budget, costs, [in_token_chunks], True, "partitioner kk")
        return Plan.from_destinations(dest, lengths.world_size)

    def __repr__(self) -> str:
        return f"KKPartitioner({self.cost_model})"
