"""FBS, fixed batch size (section 4.1): global sort by cost, zig-zag assignment, equal counts per rank.

Samples are sorted by cost, largest first (ties: sample id, then global index, so every rank sorts alike).
With n ranks, rank i takes sorted positions

    i, 2n-1-i, 2n+i, 4n-1-i, 4n+i, ...

i.e. round k of n positions is dealt left to right when k is even and right to left when k is odd. The paper
writes the list as ``[i, 2n-i, 2n+i, 4n-i, ...]``; taken literally (0-based) rank 0 would take position 2n twice
(as ``2n-i`` and as ``2n+i``) and position n (and 3n, ...) would go to no rank. We use ``2n-1-i``, the mirror of
``i`` in the second round, which is what a zig-zag deal means.

Counts: every rank gets ``G // n`` samples, and the ``m = G % n`` positions of the last, partial round (the
cheapest samples) go to ranks ``0..m-1`` when that round is even-numbered and to ranks ``n-m..n-1`` when it is
odd, following the zig-zag; counts therefore differ by at most one. A rank's samples are listed in ascending
global index (source order), which is the order an AllToAll delivers them in.

Memory budget (``RuntimeInfo.memory_budget``, budget.py). The deal gives every rank one sample of each round of n
sorted positions, so when the cost order is the token order (the default cost is monotone in L) the plan meets
any budget >= S/n + the largest sample's tokens already. Where it does not (a fitted or content-weighted cost
can order otherwise, or the budget is below that bound) the same deal is made in token order, which meets the
bound whatever the costs, and then repaired by count-keeping swaps.
"""

from __future__ import annotations

import numpy as np

from fsdata.partition.base import GatheredLengths, Plan, RuntimeInfo, cost_sort_order
from fsdata.partition.budget import honour, token_sort_order
from fsdata.partition.cost import CostModel


def zigzag_ranks(num_positions: int, world_size: int) -> np.ndarray:
    """[num_positions] rank that takes each sorted position under the zig-zag deal: two rounds, one left to
    right and one back, repeated."""
    ranks = np.arange(world_size, dtype=np.int64)
    return np.resize(np.concatenate([ranks, ranks[::-1]]), num_positions)


class FBSPartitioner:
    name = "fbs"

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model or CostModel()

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        costs = self.cost_model.sample_costs(lengths, runtime)
        sorted_index = cost_sort_order(costs, lengths)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = zigzag_ranks(lengths.num_samples, lengths.world_size)

        def in_token_order(tokens: np.ndarray) -> np.ndarray:
            by_tokens = np.empty_like(dest)
            by_tokens[token_sort_order(tokens, costs, lengths)] = zigzag_ranks(lengths.num_samples, lengths.world_size)
            return by_tokens

        dest = honour(dest, lengths, runtime.memory_budget, costs, [in_token_order], True, "partitioner fbs")
        return Plan.from_destinations(dest, lengths.world_size)

    def __repr__(self) -> str:
        return f"FBSPartitioner({self.cost_model})"
