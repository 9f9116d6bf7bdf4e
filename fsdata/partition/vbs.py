"""VBS, variable batch size (section 4.1): contiguous segments of the cost-sorted samples, equal total weight.

Weights are the cost model's per-sample cost (``L ** alpha`` by default). Samples are sorted by weight, largest
first (the same deterministic order as FBS), and cut into n contiguous segments; segment r goes to rank r, so
rank 0 gets the fewest, longest samples and the last rank the most, shortest ones. Similar lengths within a
rank mean little padding (low sparsity, Eq. 1), which is VBS's point.

Cuts. Segment r should weigh ``share_r * total`` (equal shares unless autotune says otherwise). Every cut is
placed at the sample boundary nearest to its ideal position on the prefix sum of weights, so each boundary is
off by at most half the weight of the sample it falls in, and each segment's weight is within the largest
single sample weight of its ideal (the bound the tests check). When ``G >= n``, cuts are then pushed apart so no
rank is left empty (``ensure_nonempty``, default on): an empty rank would still pay the step's fixed costs and
its gradient would be all zero. Pushing only happens where two ideal cuts round to the same boundary, i.e. where
a segment's ideal weight is below one sample's weight. With equal shares the bound survives the push (tested);
with unequal (autotuned) shares a chain of pushes can move a cut by several samples, so there the bound is only
promised when every ideal segment outweighs the largest sample (then nothing is pushed). With ``G < n`` some
ranks are necessarily empty; that is legal (Stage III handles empty batches) and cuts are left where they fall.

Memory budget (``RuntimeInfo.memory_budget``, budget.py). Equal weights are not equal tokens: a sample's weight
per token is ``L ** (alpha - 1)``, so the ranks of the shortest samples hold the most tokens (2.6x the mean on
kuairand-1k lengths, 64 ranks). When the cuts above break the budget, VBS first looks for contiguous cuts under
it that are no heavier than the heaviest segment it had (one greedy pass: every segment as long as its weight
cap, the token budget and the ranks still to fill allow; the longest-first greedy is optimal for such caps, so
if it fails no contiguous plan succeeds). Under a loose budget that keeps VBS's low sparsity at no cost in
balance. Under a tight one no contiguous plan can balance weight (a segment of short samples weighs too little
per token), and VBS deals instead: samples largest first, each to the rank of least weight / share with room for
its tokens (LPT under the cap). Batch sizes still vary, weight is balanced, tokens are capped; sparsity is then
FBS's, not VBS's. The deal meets any budget >= S/n + the largest sample's tokens (budget.py says why).

Autotune (:class:`AutoTune`) corrects the per-rank *weight budget share* ``share_r``: the fraction of the step's
total weight a rank is given. It does not change the weights themselves (that is the cost model's job, see
``cost.OnlineCostFit``); it absorbs whatever the weights get wrong per rank position (e.g. alpha too low makes
the long-sample segment slow) and per device (a slower GPU).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fsdata.partition.base import GatheredLengths, Plan, RuntimeInfo, as_numpy, cost_sort_order
from fsdata.partition.budget import honour
from fsdata.partition.cost import CostModel
from fsdata.partition.deal import deal_in_order


def weight_prefix(sorted_weights: np.ndarray) -> np.ndarray:
    """[G+1] running sum of the weights from 0: segment ``[a, b)`` weighs ``prefix[b] - prefix[a]``."""
    prefix = np.zeros(sorted_weights.size + 1)
    np.cumsum(sorted_weights, out=prefix[1:])
    return prefix


def segment_cuts(
    sorted_weights: np.ndarray, shares: np.ndarray, ensure_nonempty: bool = True, prefix: np.ndarray | None = None
) -> np.ndarray:
    """[n+1] cut positions of ``sorted_weights`` into n segments whose weights follow ``shares`` (sum 1).

    All-zero weights fall back to equal counts (every sample the same weight). ``prefix``: the weights' running
    sum from 0 (:func:`weight_prefix`), if the caller has it already.
    """
    count = sorted_weights.size
    world_size = shares.size
    if sorted_weights.sum() > 0:
        prefix = weight_prefix(sorted_weights) if prefix is None else prefix
    else:
        prefix = weight_prefix(np.ones(count))
    targets = prefix[-1] * np.cumsum(shares)[:-1]
    hi = np.searchsorted(prefix, targets, side="left")
    lo = np.maximum(hi - 1, 0)
    hi = np.minimum(hi, count)
    inner = np.where(targets - prefix[lo] <= prefix[hi] - targets, lo, hi)
    if ensure_nonempty and count >= world_size:
        # Strictly increasing cuts inside [r, G - (n - r)]: cummax of (cut - r) keeps the order and the gaps >= 1.
        r = np.arange(1, world_size)
        inner = np.minimum(np.maximum.accumulate(np.maximum(inner - r, 0)), count - world_size) + r
    cuts = np.empty(world_size + 1, dtype=np.int64)
    cuts[0], cuts[-1] = 0, count
    cuts[1:-1] = inner
    return cuts


def capped_cuts(
    sorted_weights: np.ndarray,
    sorted_tokens: np.ndarray,
    weight_caps: np.ndarray,
    limit: int,
    ensure_nonempty: bool = True,
    prefix: np.ndarray | None = None,
) -> np.ndarray | None:
    """[n+1] contiguous cuts with segment r weighing at most ``weight_caps[r]`` and holding at most ``limit``
    tokens, or None if there are none. Greedy: each segment takes as many samples as its caps allow (leaving one
    for each rank still to fill when ``ensure_nonempty``); a segment that ends no earlier than another plan's
    leaves the next segment a subset of that plan's to start from, so greedy fails only when every plan fails.

    The greedy stops as soon as its answer is None: when a segment it cut is over a cap (a forced one-sample
    segment), or when the tokens left exceed ``limit`` times the segments left (one of them, the last, would be
    over). A budget VBS's own cuts break usually fails here within the first tenth of the ranks; walking all of
    them costs 8 ms at 1,024 ranks. ``prefix``: :func:`weight_prefix` of ``sorted_weights``, if at hand."""
    count, world_size = sorted_weights.size, weight_caps.size
    weights_before = weight_prefix(sorted_weights) if prefix is None else prefix
    tokens_before = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(sorted_tokens, out=tokens_before[1:])
    slack = 1e-9 * max(weights_before[-1], 1e-300)  # float sums of the same weights in another order
    over = weight_caps + slack
    total_tokens = int(tokens_before[-1])
    # Before any segment over a cap, segment r starts no later than where caps 0..r-1 run out: if the tokens left
    # there already exceed the segments left, the loop below would return None at r or before.
    furthest = weights_before.searchsorted(np.cumsum(over + slack)[:-1], "right") - 1  # + slack: float sums
    left = world_size - np.arange(1, world_size)
    if bool((total_tokens - tokens_before[np.minimum(furthest, count)] > left * limit).any()):
        return None
    cuts = np.zeros(world_size + 1, dtype=np.int64)
    start = 0
    for r in range(world_size - 1):
        if total_tokens - int(tokens_before[start]) > (world_size - r) * limit:
            return None
        by_weight = int(weights_before.searchsorted(weights_before[start] + weight_caps[r] + slack, "right")) - 1
        by_tokens = int(tokens_before.searchsorted(tokens_before[start] + limit, "right")) - 1
        end = min(by_weight, by_tokens)
        if ensure_nonempty and count >= world_size:
            end = min(max(end, start + 1), count - (world_size - 1 - r))
        end = max(end, start)
        if tokens_before[end] - tokens_before[start] > limit or weights_before[end] - weights_before[start] > over[r]:
            return None
        cuts[r + 1] = start = end
    cuts[-1] = count
    weights, tokens = np.diff(weights_before[cuts]), np.diff(tokens_before[cuts])
    if tokens.max(initial=0) > limit or bool((weights > over).any()):
        return None
    return cuts


class VBSPartitioner:
    name = "vbs"

    def __init__(self, cost_model: Optional[CostModel] = None, ensure_nonempty: bool = True) -> None:
        self.cost_model = cost_model or CostModel()
        self.ensure_nonempty = ensure_nonempty

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        weights = self.cost_model.sample_costs(lengths, runtime)
        sorted_index = cost_sort_order(weights, lengths)
        sorted_weights = weights[sorted_index]
        prefix = weight_prefix(sorted_weights)
        shares = runtime.shares(lengths.world_size)
        cuts = segment_cuts(sorted_weights, shares, self.ensure_nonempty, prefix)
        ranks = np.arange(lengths.world_size, dtype=np.int64)
        dest = np.empty(lengths.num_samples, dtype=np.int64)
        dest[sorted_index] = np.repeat(ranks, np.diff(cuts))
        budget = runtime.memory_budget

        def contiguous(tokens: np.ndarray) -> np.ndarray | None:
            segment_weights = np.diff(prefix[cuts])
            heaviest = float((segment_weights / np.maximum(shares, 1e-300)).max())
            capped = capped_cuts(
                sorted_weights, tokens[sorted_index], heaviest * shares, budget.tokens, self.ensure_nonempty, prefix
            )
            if capped is None:
                return None
            out = np.empty_like(dest)
            out[sorted_index] = np.repeat(ranks, np.diff(capped))
            return out

        def dealt(tokens: np.ndarray) -> np.ndarray | None:
            dealt_ranks = deal_in_order(sorted_weights, tokens[sorted_index], shares, budget.tokens)
            if dealt_ranks is None:
                return None
            out = np.empty_like(dest)
            out[sorted_index] = dealt_ranks
            return out

        dest = honour(dest, lengths, budget, weights, [contiguous, dealt], False, "partitioner vbs")
        return Plan.from_destinations(dest, lengths.world_size)

    def rank_weights(self, lengths: GatheredLengths, runtime: RuntimeInfo, plan: Plan) -> np.ndarray:
        """[W] total weight each rank receives under ``plan`` (for ``AutoTune.record_weights``)."""
        weights = self.cost_model.sample_costs(lengths, runtime)
        return np.bincount(plan.destinations().numpy(), weights=weights, minlength=lengths.world_size)

    def __repr__(self) -> str:
        return f"VBSPartitioner({self.cost_model}, ensure_nonempty={self.ensure_nonempty})"


class AutoTune:
    """Moves each rank's weight budget share up or down from its measured compute time vs the global mean.

    Use, on every rank alike (the inputs are gathered, so every rank holds the same state)::

        shares = autotune.shares_for_step(j)      # when planning step j: RuntimeInfo(budget_shares=shares)
        autotune.record_weights(j, vbs.rank_weights(lengths, runtime, plan))   # optional, after planning j
        autotune.observe(i, step_times)           # once step i's per-rank times are gathered (i <= j - 2)

    ``step_times`` must be each rank's own busy time up to the gradient synchronisation (not including the wait
    there, which would make every rank look alike).

    Lag. Under the loader's lookahead the plan of step j is fixed before step j-1 finishes, so a measurement
    feeds a plan at least two steps later; a plain "share *= mean / time" rule would react to the same error
    twice (once per plan in flight) and oscillate. Instead every measurement is turned into an estimate of the
    balanced shares *against the shares that measured step actually used* (kept in a small history):
    ``target_r ∝ used_r * mean(t) / t_r``, which is independent of any update made since. The state then moves a
    damped step towards it, ``share = (1 - step_size) * share + step_size * target``: an exponential average of
    independent estimates, which cannot overshoot when time is proportional to weight, and converges
    (geometrically, no oscillation) when it is not, e.g. with a fixed per-step overhead. The first estimate is
    taken whole (the equal shares it replaces are no estimate at all). Per-update ratios are clipped to
    ``[1/max_ratio, max_ratio]`` so one hiccup does not starve a rank, and shares never fall below
    ``min_share_frac / n`` so no rank is starved for good.

    Cold start. Until the first measurement, two steps in, the shares are equal and the weights alone decide, and
    at many ranks they are far off: with ``L ** 1.5`` at 1,024 ranks x 128 samples the rank of the shortest samples
    takes ~4,800 of them, and the cost model's per-sample time makes it 2.5x the mean rank (60% straggler share,
    ``freescale simulate``). A clip of 1.5 then needed ~12 steps to converge (every other measurement still judged
    the equal shares); the whole first estimate and a clip of 4 bring it within ~6.
    """

    def __init__(
        self,
        world_size: int,
        step_size: float = 0.5,
        max_ratio: float = 4.0,
        min_share_frac: float = 0.1,
        history: int = 16,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"AutoTune world_size must be >= 1, got {world_size}")
        if not 0.0 < step_size <= 1.0:
            raise ValueError(f"AutoTune step_size must be in (0, 1], got {step_size}")
        if max_ratio < 1.0:
            raise ValueError(f"AutoTune max_ratio must be >= 1, got {max_ratio}")
        if not 0.0 <= min_share_frac < 1.0:
            raise ValueError(f"AutoTune min_share_frac must be in [0, 1), got {min_share_frac}")
        self.world_size = int(world_size)
        self.step_size = float(step_size)
        self.max_ratio = float(max_ratio)
        self.min_share_frac = float(min_share_frac)
        self.history = int(history)
        self._shares = np.full(self.world_size, 1.0 / self.world_size)
        self._used: dict[int, np.ndarray] = {}  # step -> shares its plan used, until that step is observed
        self._observed = 0

    def shares(self) -> torch.Tensor:
        """Current per-rank shares (float64 [W], sum 1)."""
        return torch.from_numpy(self._shares.copy())

    def shares_for_step(self, step: int) -> torch.Tensor:
        """The shares to plan ``step`` with; remembered so its measurement is judged against them."""
        self._used[int(step)] = self._shares.copy()
        while len(self._used) > self.history:
            del self._used[min(self._used)]
        return self.shares()

    def record_weights(self, step: int, rank_weights) -> None:
        """Remembers the weight each rank really received in ``step``'s plan (optional, after planning it).

        ``rank_weights`` [W]: ``VBSPartitioner.rank_weights(lengths, runtime, plan)``. The later measurement of
        ``step`` is then judged against these instead of the planned shares: see :meth:`observe`.
        """
        got = as_numpy(rank_weights, np.float64, "AutoTune rank_weights")
        if got.size != self.world_size or not np.all(np.isfinite(got)) or got.min() < 0:
            raise ValueError(f"AutoTune.record_weights: step {step} needs {self.world_size} finite weights >= 0")
        if got.sum() > 0:
            self._used[int(step)] = got / got.sum()
            while len(self._used) > self.history:
                del self._used[min(self._used)]

    def observe(self, measured_step: int, step_times, rank_weights=None) -> None:
        """Feeds the gathered per-rank busy times of ``measured_step``.

        ``rank_weights`` (optional, [W]): the weight each rank actually received in that step's plan, if not
        given to :meth:`record_weights` already. With it the estimate uses what the rank really got instead of its
        planned share, so the cut granularity (up to one sample's weight per rank) does not enter as noise; this
        matters when a rank holds few heavy samples.
        """
        times = as_numpy(step_times, np.float64, "AutoTune step_times")
        if times.size != self.world_size:
            raise ValueError(f"AutoTune.observe: {times.size} step times for world_size {self.world_size}")
        if not np.all(np.isfinite(times)) or times.min() < 0:
            raise ValueError(f"AutoTune.observe: step {measured_step} has non-finite or negative times {times[:8]}")
        used = self._used.pop(int(measured_step), None)
        for old in [s for s in self._used if s < measured_step]:  # never measured now: forget
            del self._used[old]
        if used is None:
            used = self._shares
        if rank_weights is not None:
            got = as_numpy(rank_weights, np.float64, "AutoTune rank_weights")
            if got.size != self.world_size or not np.all(np.isfinite(got)) or got.min() < 0:
                raise ValueError(f"AutoTune.observe: rank_weights must be {self.world_size} finite values >= 0")
            if got.sum() > 0:
                used = got / got.sum()
        mean = times.mean()
        if mean <= 0:
            return
        ratio = np.clip(mean / np.maximum(times, mean * 1e-6), 1.0 / self.max_ratio, self.max_ratio)
        target = used * ratio
        if target.sum() <= 0:
            return
        target /= target.sum()
        step = max(self.step_size, 1.0 / (1 + self._observed))
        shares = (1.0 - step) * self._shares + step * target
        shares = np.maximum(shares, self.min_share_frac / self.world_size)
        self._shares = shares / shares.sum()
        self._observed += 1

    def state_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "shares": self._shares.tolist(),
            "used": {int(k): v.tolist() for k, v in self._used.items()},
            "observed": self._observed,
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"AutoTune state is for world_size {state['world_size']}, this run has {self.world_size}: per-rank"
                " shares do not carry over to another world size (start from equal shares instead)"
            )
        self._shares = np.asarray(state["shares"], dtype=np.float64)
        self._used = {int(k): np.asarray(v, dtype=np.float64) for k, v in state["used"].items()}
        self._observed = int(state["observed"])
