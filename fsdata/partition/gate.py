"""The balance gate: a step's samples move only when moving them is predicted to pay.

Balancing has a price of its own: Stage III's sample AllToAll, and the loader's CPU time to pack and unpack it.
Where sequences are short, the step time hardly depends on them (kernel launches and fixed work dominate), so
the partitioner's ``L ** alpha`` guess promises a gain that the step never sees, and the exchange is pure cost.

The gate predicts instead from measurements. It regresses every rank's measured compute time on the per-rank
features of the plan that rank ran (:class:`~fsdata.partition.cost.OnlineCostFit`: ``a*sum(L) + b*sum(L^2) +
c*count + d``), then compares the slowest rank's predicted time under the partitioner's plan with that under
the identity plan (every sample stays where it is):

    gain = 1 - max_r t_r(plan) / max_r t_r(identity)

Below ``min_gain`` the step keeps the identity plan, and Stage III sends nothing (fsdata.nodes.shuffle). Until
``OnlineCostFit.min_updates`` steps are measured there is no prediction, and the partitioner's plan is used.

Determinism: the measurements are gathered with the lengths (Stage I), so the fit, the prediction and the
decision are identical on every rank, and every rank skips (or makes) the same exchange. The fit and the
features of the plans not yet measured are the gate's state, saved with the loader's, so a resumed job decides
as the stopped one would have.

What the fit sees: while the gate keeps balancing, the ranks' features are nearly equal within a step, so the
fit learns mostly from how step time follows the global step's totals; while it keeps identity plans, the ranks
differ and the fit sees the per-rank effect directly. Either way a step-time that follows the lengths shows up
as ``a`` or ``b`` and reopens the gate. The model gives every rank the same speed; where ranks differ (VBS
autotune's case), it would judge autotune's uneven plans by the wrong yardstick, so the balancer leaves the gate
out when autotune is on.

Memory budget: the identity plan is kept only if it meets the step's budget (``RuntimeInfo.memory_budget``); a
step whose unbalanced batches would put a rank over it is balanced whatever the predicted gain.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fsdata.partition.base import GatheredLengths, Plan
from fsdata.partition.budget import MemoryBudget
from fsdata.partition.cost import CostModel, OnlineCostFit, rank_features


class BalanceGate:
    """Chooses, per step, between the partitioner's plan and the identity plan (see the module docstring)."""

    def __init__(
        self,
        min_gain: float,
        cost_model: Optional[CostModel] = None,
        fit: Optional[OnlineCostFit] = None,
        history: int = 16,
    ) -> None:
        if not np.isfinite(min_gain) or not 0.0 <= min_gain < 1.0:
            raise ValueError(f"BalanceGate min_gain must be in [0, 1), got {min_gain}")
        if history < 1:
            raise ValueError(f"BalanceGate history must be >= 1, got {history}")
        self.min_gain = float(min_gain)
        self.cost_model = cost_model or CostModel()
        self.fit = fit or OnlineCostFit()
        self.history = int(history)
        self._features: dict[int, np.ndarray] = {}  # step -> [W, 4] features of the plan that step ran
        self._last_observed = -1

    def observe(self, measured_step: int, step_times) -> None:
        """Adds the gathered compute times of ``measured_step`` (once per step; older or unknown steps are ignored)."""
        features = self._features.get(measured_step)
        if measured_step <= self._last_observed or features is None or len(features) != len(step_times):
            return  # not planned here, or planned before a resume onto another world size
        self.fit.update(features, step_times)
        self._last_observed = measured_step
        for step in [s for s in self._features if s <= measured_step]:
            del self._features[step]

    def _features_of(self, lengths: GatheredLengths, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """[W, 4] features of ``plan`` and of the identity plan (every sample kept on its source rank)."""
        tokens = self.cost_model.token_lengths(lengths)
        w = lengths.world_size
        source = np.repeat(np.arange(w, dtype=np.int64), lengths.source_counts().numpy())
        return rank_features(tokens, plan.destinations().numpy(), w), rank_features(tokens, source, w)

    def _gain(self, moved: np.ndarray, kept: np.ndarray) -> Optional[float]:
        """``1 - max t(plan) / max t(identity)`` under the fitted cost, or None while there is no fit yet."""
        coefficients = self.fit.coefficients()
        if coefficients is None:
            return None
        coefficients = coefficients.numpy()
        slowest = float((kept @ coefficients).max())
        return 1.0 - float((moved @ coefficients).max()) / slowest if slowest > 0 else 0.0

    def choose(
        self, step: int, lengths: GatheredLengths, plan: Plan, budget: Optional[MemoryBudget] = None
    ) -> tuple[Plan, Optional[float]]:
        """The plan step ``step`` runs (``plan`` or the identity plan) and the predicted gain it was judged by."""
        moved, kept = self._features_of(lengths, plan)
        gain = self._gain(moved, kept)
        keep_local = gain is not None and gain < self.min_gain
        if keep_local and budget is not None:
            keep_local = budget.rank_tokens(lengths, Plan.identity(lengths)).max() <= budget.tokens
        if keep_local:
            plan, moved = Plan.identity(lengths), kept
        self._features[step] = moved  # the features of the plan this step runs
        while len(self._features) > self.history:  # measurements skipped (feedback keeps only the newest)
            del self._features[min(self._features)]
        return plan, gain

    def state_dict(self) -> dict:
        return {
            "fit": self.fit.state_dict(),
            "features": {int(s): f.tolist() for s, f in self._features.items()},
            "last_observed": self._last_observed,
        }

    def load_state_dict(self, state: dict) -> None:
        self.fit.load_state_dict(state["fit"])
        self._features = {int(s): np.asarray(f, dtype=np.float64) for s, f in state["features"].items()}
        self._last_observed = int(state["last_observed"])

    def __repr__(self) -> str:
        return f"BalanceGate(min_gain={self.min_gain}, {self.cost_model})"
