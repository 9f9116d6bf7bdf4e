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

    A merge keeps only its subsets' sums and the order it sorted them in; which samples a final subset holds is
    read back once at the end, from the last merge down to the chunks (each merge's rows are its two inputs'
    rows). Carrying the member arrays through every merge instead copies ``n * k`` positions per merge, ``n *
    chunks^2 / 2`` in all: half of KK's time at 1,024 ranks x 128 samples.
    """
    count = sorted_costs.size
    if world_size == 1 or count == 0:
        return np.zeros(count, dtype=np.int64)
    chunks = -(-count // world_size)
    padded = np.zeros(chunks * world_size)
    padded[:count] = sorted_costs
    sums_by_chunk = padded.reshape(chunks, world_size)
    heaviest_first = _heaviest_first(sums_by_chunk)  # [chunks, n] each chunk's positions heaviest first, or None
    chunk_sums = sums_by_chunk if heaviest_first is None else np.take_along_axis(sums_by_chunk, heaviest_first, 1)
    spreads = (chunk_sums[:, 0] - chunk_sums[:, -1]).tolist()
    heap = [(-spread, c) for c, spread in enumerate(spreads)]
    heapq.heapify(heap)  # (spread, id) pairs are distinct, so the heap pops them in the order pushes would
    sums: dict[int, np.ndarray] = dict(enumerate(chunk_sums))  # id -> [n] subset sums, descending
    merges: list[tuple[int, int, np.ndarray]] = []  # id chunks + i: (a, b, resort) of merge i
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        # a and b are stored heaviest-first: pair a's heaviest with b's lightest.
        merged = sums.pop(a) + sums.pop(b)[::-1]
        resort = np.argsort(-merged, kind="stable")
        merged = merged[resort]
        sums[chunks + len(merges)] = merged
        merges.append((a, b, resort))
        heapq.heappush(heap, (-(merged[0] - merged[-1]), chunks + len(merges) - 1))

    root = heap[0][1]
    rows = _chunk_rows(root, merges, chunks, world_size)  # [chunks, n]: final subset i's row in each chunk
    members = rows if heaviest_first is None else np.take_along_axis(heaviest_first, rows, 1)
    members += world_size * np.arange(chunks)[:, None]  # [chunks, n] padded positions of final subset i
    dummies = members[-1] >= count  # only the last chunk holds padding, one position per subset at most
    rank_of_subset = np.empty(world_size, dtype=np.int64)
    rank_of_subset[np.lexsort((np.arange(world_size), -sums[root], dummies))] = np.arange(world_size)
    dest_padded = np.empty(chunks * world_size, dtype=np.int64)
    dest_padded[members] = rank_of_subset
    return dest_padded[:count]


def _heaviest_first(sums_by_chunk: np.ndarray) -> np.ndarray | None:
    """[chunks, n] stable descending argsort of every chunk, or None when every chunk is already descending (the
    costs came sorted): the identity, which needs no sort."""
    unsorted = np.nonzero((sums_by_chunk[:, 1:] > sums_by_chunk[:, :-1]).any(axis=1))[0]
    if not unsorted.size:
        return None
    chunks, world_size = sums_by_chunk.shape
    order = np.broadcast_to(np.arange(world_size), (chunks, world_size)).copy()
    order[unsorted] = np.argsort(-sums_by_chunk[unsorted], axis=1, kind="stable")
    return order


def _chunk_rows(root: int, merges: list, chunks: int, world_size: int) -> np.ndarray:
    """[chunks, n]: for each subset of the final partial partition, the row of each chunk's heaviest-first order
    it holds. A merge's row i is its input a's row resort[i] and its input b's row n-1-resort[i]; merges are
    undone newest first, so every merge's rows are known before its inputs'."""
    rows = np.empty((chunks, world_size), dtype=np.int64)
    merged_rows = {root: np.arange(world_size)}
    if root < chunks:
        rows[root] = merged_rows[root]
    for i in range(len(merges) - 1, -1, -1):
        a, b, resort = merges[i]
        picked = resort[merged_rows.pop(chunks + i)]
        for child, child_rows in ((a, picked), (b, world_size - 1 - picked)):
            if child < chunks:
                rows[child] = child_rows
            else:
                merged_rows[child] = child_rows
    return rows


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
