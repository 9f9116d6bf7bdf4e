"""Per-sample cost: the partitioners' estimate of how long a sample takes in the forward and backward pass.

Default (the paper's VBS weight, section 4.1): ``L ** alpha`` with ``L`` the sample's token count as the
sequence model sees it, i.e. its UIH length plus its candidates (HSTU-style models append the candidates to the
sequence), plus a linear term for candidate content ids (embedding pooling, no attention).

A fitted model replaces the guess once there are measurements: :class:`OnlineCostFit` regresses every rank's
measured step time on the per-rank features of the plan it ran,

    time_r ~ a * sum(L) + b * sum(L^2) + c * count + d,

a least-squares fit with non-negative coefficients and exponential forgetting, so it follows slow drift (e.g.
a warming cache) and ignores one noisy step. Its coefficients travel in ``RuntimeInfo.cost_coefficients``
(gathered, identical everywhere); a sample then costs ``a*L + b*L^2 + c`` (``d`` is per rank, not per sample).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fsdata.partition.base import GatheredLengths, RuntimeInfo, as_numpy

NUM_FEATURES = 4  # sum(L), sum(L^2), count, 1


@dataclass(frozen=True)
class CostModel:
    """Sample cost from lengths; uses the fitted coefficients of R when present and ``use_fitted`` is set."""

    alpha: float = 1.5  # between linear layers (1) and attention (2); tune with --alpha or let the fit decide
    candidate_weight: float = 1.0  # tokens one candidate adds to the sequence length L
    content_weight: float = 0.0  # cost per candidate content id, added linearly
    use_fitted: bool = True  # prefer RuntimeInfo.cost_coefficients over L^alpha when they are there

    def __post_init__(self) -> None:
        for name in ("alpha", "candidate_weight", "content_weight"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {value}")

    def token_lengths(self, lengths: GatheredLengths) -> np.ndarray:
        """[G] float64 sequence length L of every sample (UIH plus weighted candidates)."""
        return lengths.uih_lengths.numpy().astype(np.float64) + self.candidate_weight * lengths.num_candidates.numpy()

    def sample_costs(self, lengths: GatheredLengths, runtime: Optional[RuntimeInfo] = None) -> np.ndarray:
        """[G] float64 cost of every sample, >= 0."""
        coefficients = None if runtime is None or not self.use_fitted else runtime.cost_coefficients
        if coefficients is not None:
            a, b, c, _ = _check_coefficients(coefficients)
            tokens = self.token_lengths(lengths)
            cost = a * tokens + b * tokens * tokens + c
        else:
            cost = self._powers(lengths)
        if self.content_weight:
            cost = cost + self.content_weight * lengths.content_lengths_per_sample()
        return cost

    def _powers(self, lengths: GatheredLengths) -> np.ndarray:
        """``token_lengths ** alpha``. A pow costs ~20 ns, 2.5 ms for a step of 1,024 ranks x 128 samples; with a
        whole candidate weight the lengths are whole numbers, mostly fewer distinct ones than samples, so the
        powers of 0..max length are taken once and looked up (the same pow of the same float, so the same bits)."""
        weight = self.candidate_weight
        if not float(weight).is_integer():
            return np.power(self.token_lengths(lengths), self.alpha)
        whole = lengths.uih_lengths.numpy() + int(weight) * lengths.num_candidates.numpy()  # = token_lengths
        if whole.size and int(whole.max()) < whole.size:
            return np.power(np.arange(int(whole.max()) + 1, dtype=np.float64), self.alpha)[whole]
        return np.power(whole.astype(np.float64), self.alpha)


def _check_coefficients(coefficients) -> np.ndarray:
    values = as_numpy(coefficients, np.float64, "RuntimeInfo.cost_coefficients")
    if values.size != NUM_FEATURES or not np.all(np.isfinite(values)) or values.min() < 0:
        raise ValueError(f"RuntimeInfo.cost_coefficients must be 4 finite values >= 0 (a, b, c, d), got {values}")
    return values


def rank_features(token_lengths: np.ndarray, dest: np.ndarray, world_size: int) -> np.ndarray:
    """[W, 4] per-rank (sum L, sum L^2, count, 1) of a plan, from per-sample L and destination ranks."""
    out = np.ones((world_size, NUM_FEATURES), dtype=np.float64)
    out[:, 0] = np.bincount(dest, weights=token_lengths, minlength=world_size)
    out[:, 1] = np.bincount(dest, weights=token_lengths * token_lengths, minlength=world_size)
    out[:, 2] = np.bincount(dest, minlength=world_size)
    return out


class OnlineCostFit:
    """Non-negative least squares of per-rank step time on (sum L, sum L^2, count, 1), updated every step.

    Keeps only the normal equations (4x4, plus y'y), decayed by ``forgetting`` per update: memory and time are
    constant per step, and the state is three small arrays (``state_dict``) for exact resume. Columns are scaled
    by the root of their Gram diagonal before solving, since sum(L^2) is ~1e9 times the count column.
    """

    def __init__(self, forgetting: float = 0.98, min_updates: int = 2) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"OnlineCostFit forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = float(forgetting)
        self.min_updates = int(min_updates)
        self._gram = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._rhs = np.zeros(NUM_FEATURES)
        self._yy = 0.0
        self._updates = 0

    def update(self, features: np.ndarray, step_times) -> None:
        """Adds one step: ``features`` [W, 4] from :func:`rank_features`, ``step_times`` [W] seconds."""
        x = np.asarray(features, dtype=np.float64)
        y = as_numpy(step_times, np.float64, "step_times")
        if x.ndim != 2 or x.shape[1] != NUM_FEATURES or x.shape[0] != y.size:
            raise ValueError(
                f"OnlineCostFit.update: features {x.shape} and step_times {y.shape} do not match [W, 4], [W]"
            )
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise ValueError("OnlineCostFit.update: features and step times must be finite")
        f = self.forgetting
        self._gram = f * self._gram + x.T @ x
        self._rhs = f * self._rhs + x.T @ y
        self._yy = f * self._yy + float(y @ y)
        self._updates += 1

    def coefficients(self) -> Optional[torch.Tensor]:
        """float64 [4] (a, b, c, d), all >= 0; None until ``min_updates`` steps were seen.

        Exact NNLS over the 16 subsets of the 4 columns (solve each, keep the feasible one of least residual):
        cheaper and more predictable than an iterative solver at this size.
        """
        if self._updates < self.min_updates:
            return None
        scale = np.sqrt(np.maximum(np.diag(self._gram), 1e-300))
        gram = self._gram / np.outer(scale, scale)
        rhs = self._rhs / scale
        best, best_residual = np.zeros(NUM_FEATURES), self._yy
        for size in range(1, NUM_FEATURES + 1):
            for subset in itertools.combinations(range(NUM_FEATURES), size):
                idx = list(subset)
                sub = gram[np.ix_(idx, idx)] + 1e-12 * np.eye(size)
                try:
                    solution = np.linalg.solve(sub, rhs[idx])
                except np.linalg.LinAlgError:
                    continue
                if solution.min() < 0:
                    continue
                residual = self._yy - 2 * solution @ rhs[idx] + solution @ sub @ solution
                if residual < best_residual - 1e-15 * max(1.0, abs(best_residual)):
                    best = np.zeros(NUM_FEATURES)
                    best[idx] = solution
                    best_residual = residual
        return torch.from_numpy(best / scale)

    def state_dict(self) -> dict:
        return {
            "gram": self._gram.tolist(),
            "rhs": self._rhs.tolist(),
            "yy": self._yy,
            "updates": self._updates,
            "forgetting": self.forgetting,
        }

    def load_state_dict(self, state: dict) -> None:
        gram = np.asarray(state["gram"], dtype=np.float64)
        rhs = np.asarray(state["rhs"], dtype=np.float64)
        if gram.shape != (NUM_FEATURES, NUM_FEATURES) or rhs.shape != (NUM_FEATURES,):
            raise ValueError(f"OnlineCostFit state has gram {gram.shape} and rhs {rhs.shape}, expected (4, 4) and (4,)")
        self._gram, self._rhs = gram, rhs
        self._yy = float(state["yy"])
        self._updates = int(state["updates"])
        self.forgetting = float(state.get("forgetting", self.forgetting))
