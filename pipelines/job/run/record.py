"""A step's record in `freescale train`: what its metrics line and the run summary say about it.

Built from what the step returned (``StepRecord.of``: pipelines.models.step_result.StepResult, whichever kind of
step ran), completed by the trainer's accounting (pipelines.job.run.accounting: data wait, exposed parts, wall time)
and, one step later, settled with every rank's compute time of that step (``settle``: straggler wait, the
all-reduce's exposed part, bubbles), which the next step's bookkeeping block brings. ``as_dict`` is the line
written per step and kept in the trainer's history.

The block rides in the dense all-reduce's last bucket (pipelines.api.dense_sync), launched as soon as the backward
is queued (unless ``--dense-sync.allreduce-start compute``): per-rank slots (each rank writes only its own) with
tokens, samples, sparsity and the previous step's compute and wall times, so per-rank timings reach every rank with
no extra collective; the last step's record is settled by one all-reduce after the loop.

Straggler accounting. A rank that finishes forward+backward early idles at the all-reduce until the slowest rank
arrives: wait_r = max_q(compute_q) - compute_r. straggler % = mean_r(wait_r) / step time, the paper's definition.
Bubbles = exposed communication (IDs, embeddings, gradients, balancer waits, label count, the all-reduce itself net
of straggler wait) + straggler wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np

from pipelines.models.step_result import StepResult

# Fields that a step of some kind or on some device has not: left out of its line rather than written as null.
_ABSENT_WHEN_NONE = ("compute_local_s", "relay_allocations", "pinned_allocations", "schedule", "balance")


def total(values: list[Optional[float]]) -> Optional[float]:
    """Sum, or None when a part was not measured: a missing part is unknown, not zero."""
    return None if any(v is None for v in values) else sum(values)


@dataclass
class StepRecord:
    step: int
    loss: float  # the global mean
    labels: float  # the global label count
    loss_sum: float
    positives: float
    compute_local_s: Optional[float]  # this rank's forward and backward; None: not measured (mode torchrec)
    tokens_per_rank: list[int]
    samples_per_rank: list[int]
    sparsity_per_rank: list[float]
    imbalance_max_over_mean: float
    allreduce_s: Optional[float]
    # every rank's compute time of the previous step, from this step's block: settles that step's record
    last_compute_all_s: Optional[np.ndarray] = field(default=None, repr=False)
    unmeasured: tuple[str, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict)
    # the trainer's accounting
    data_wait_s: float = 0.0
    data_blocked_s: float = 0.0
    exposed_s: dict[str, Optional[float]] = field(default_factory=dict)
    step_time_s: float = 0.0
    gc_s: float = 0.0
    relay_allocations: Optional[int] = None
    pinned_allocations: Optional[int] = None
    schedule: Optional[str] = None
    balance: Optional[dict] = None
    # settled one step later (None where not measured)
    compute_s: Optional[list[float]] = None
    allreduce_exposed_s: Optional[float] = None
    straggler_wait_s: Optional[float] = None
    straggler_pct: Optional[float] = None
    bubble_s: Optional[float] = None

    @classmethod
    def of(cls, step: int, result: StepResult) -> "StepRecord":
        per_rank = result.per_rank
        tokens = per_rank["tokens"]
        return cls(
            step=step,
            loss=result.loss,
            labels=result.labels,
            loss_sum=result.loss_sum,
            positives=result.positives,
            compute_local_s=result.compute_s,
            tokens_per_rank=tokens.astype(np.int64).tolist(),
            samples_per_rank=per_rank["samples"].astype(np.int64).tolist(),
            sparsity_per_rank=per_rank["sparsity"].tolist(),
            imbalance_max_over_mean=float(tokens.max() / max(tokens.mean(), 1.0)),
            allreduce_s=result.allreduce_s,
            last_compute_all_s=per_rank.get("last_compute_s"),
            unmeasured=tuple(result.unmeasured),
            extras=dict(result.extras),
        )

    def settle(self, compute_all: Optional[np.ndarray], rank: int) -> "StepRecord":
        """Completes the record with every rank's compute time of this step (None where the step has none): the
        straggler wait (the paper's: wait_r = max_q compute_q - compute_r), the all-reduce's exposed part net of
        this rank's straggler wait, and the bubbles."""
        if compute_all is not None:
            wait = compute_all.max() - compute_all
            step_time = self.compute_local_s + self.allreduce_s  # = slowest rank's compute + the exchange
            self.compute_s = compute_all.tolist()
            self.allreduce_exposed_s = max(self.allreduce_s - float(wait[rank]), 0.0)
            self.straggler_wait_s = float(wait.mean())
            self.straggler_pct = 100.0 * float(wait.mean()) / max(step_time, 1e-9)
            self.exposed_s["dense_allreduce"] = self.allreduce_exposed_s
        self.bubble_s = total([*self.exposed_s.values(), self.straggler_wait_s])
        return self

    def as_dict(self) -> dict[str, Any]:
        """The step's line: every field but the settling input, the extras among them; the fields this step has
        not (``_ABSENT_WHEN_NONE``, ``unmeasured`` when empty) left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("last_compute_all_s", "extras") or (f.name in _ABSENT_WHEN_NONE and value is None):
                continue
            if f.name == "unmeasured":
                if value:
                    out[f.name] = list(value)
                continue
            out[f.name] = value
        out.update(self.extras)
        return out
