"""The run summary's figures, kept as the steps go by in memory that does not grow with their number.

A job may run a million steps: its summary holds running aggregates, never a list per step. Sums and means are
exact over the steps they cover; medians and tails (p90, p99) are read over a window of the latest ``WINDOW``
timed steps (exact for a run of fewer); the loss and NE curves keep at most ``CURVE_POINTS`` points, evenly
spaced (every step for a short run; when full, every other point is let go and the stride doubles), with the step
of each point. Every step's own record goes to ``--metrics-jsonl`` as it is settled, and only there: ``per_step``
reads such a file back into the per-step series a benchmark tabulates.

Which steps count (the trainer's rules, known from the run's length before it starts): the first ``warmup``
steps are left out of the timings (one-time costs), and so is the last (it drains the lookahead) when at least
three timed steps remain; loss and NE average the second half of the steps (past the first steps' fast fall).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

WINDOW = 2048  # the latest timed steps that the medians and tails read
CURVE_POINTS = 512  # at most this many points of a curve in the summary


class Window:
    """The latest ``size`` values of a series, for its median and tails; None values make them unknown (a part not
    measured, as in mode torchrec, is not a number)."""

    def __init__(self, size: int = WINDOW) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.unknown = False

    def add(self, value: Optional[float]) -> None:
        if value is None:
            self.unknown = True
        else:
            self.values.append(float(value))

    def median(self) -> Optional[float]:
        """torch's median (the lower of the two middle values), as the summary always gave."""
        if self.unknown:
            return None
        return float(torch.tensor(list(self.values), dtype=torch.float64).median()) if self.values else float("nan")

    def quantile(self, q: float) -> Optional[float]:
        if self.unknown:
            return None
        if not self.values:
            return float("nan")
        return float(torch.quantile(torch.tensor(list(self.values), dtype=torch.float64), q, interpolation="higher"))


class Mean:
    """A running sum and count; None when a value was not measured."""

    def __init__(self) -> None:
        self.sum, self.count, self.unknown = 0.0, 0, False

    def add(self, value: Optional[float]) -> None:
        if value is None:
            self.unknown = True
        else:
            self.sum += float(value)
        self.count += 1

    def mean(self) -> Optional[float]:
        return None if self.unknown else self.sum / max(self.count, 1)


class Curve:
    """Every ``stride``-th value of a series, at most ``points`` of them, with the step of each."""

    def __init__(self, points: int = CURVE_POINTS) -> None:
        self.points, self.stride, self.seen = points, 1, 0
        self.steps: list[int] = []
        self.values: list[float] = []

    def add(self, step: int, value: float) -> None:
        if self.seen % self.stride == 0:
            self.steps.append(step)
            self.values.append(value)
            if len(self.values) > self.points:  # the kept points are the multiples of the doubled stride
                self.steps, self.values, self.stride = self.steps[::2], self.values[::2], 2 * self.stride
        self.seen += 1


def _compute(record: dict, rank: int) -> Optional[float]:
    """A rank's forward+backward time; None in mode torchrec, where it cannot be told apart from the exchanges."""
    return None if record["compute_s"] is None else record["compute_s"][rank]


class RunAggregates:
    """The summary's figures of a run of ``steps`` steps (this process's: after a resume, the part it runs), fed
    each step's settled record (``StepRecord.as_dict()``) in order."""

    def __init__(self, steps: int, warmup_steps: int, world_size: int, rank: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.warm = min(warmup_steps, max(steps - 1, 0))
        self.drain = 1 if steps - self.warm >= 3 else 0
        self.timed_end = steps - self.drain  # steps [warm, timed_end) are timed
        self.tail_from = steps // 2
        self.seen = 0
        self.samples = self.timed_samples = 0
        self.warmup_s = self.drain_s = self.timed_s = 0.0
        self.loss_total = self.positives = self.labels = 0.0  # cumulative: the NE curve
        self.tail_loss_sum = self.tail_positives = self.tail_labels = 0.0
        self.loss_first_step = float("nan")
        self.unmeasured: list[str] = []
        self.loss_curve, self.ne_curve = Curve(), Curve()
        self.step_time, self.bubble = Window(), Window()
        self.data_wait, self.data_blocked, self.compute = Window(), Window(), Window()
        self.straggler_pct, self.bubble_mean = Mean(), Mean()
        self.exposed: dict[str, Mean] = {}
        self.per_rank_compute = [Mean() for _ in range(world_size)]
        self.gc_s = self.gc_max_s = 0.0
        self.balanced_steps: Optional[int] = None

    def add(self, record: dict) -> None:
        from pipelines.metrics import normalized_entropy

        i = self.seen
        self.seen += 1
        if i == 0:
            self.loss_first_step = record["loss"]
            self.unmeasured = list(record.get("unmeasured", []))
        samples = sum(record["samples_per_rank"])
        self.samples += samples
        self.loss_total, self.positives = self.loss_total + record["loss_sum"], self.positives + record["positives"]
        self.labels += record["labels"]
        self.loss_curve.add(record["step"], record["loss"])
        self.ne_curve.add(record["step"], normalized_entropy(self.loss_total, self.positives, self.labels))
        if i >= self.tail_from:
            self.tail_loss_sum += record["loss_sum"]
            self.tail_positives += record["positives"]
            self.tail_labels += record["labels"]
        if "balance" in record:
            self.balanced_steps = (self.balanced_steps or 0) + int(record["balance"]["exchanged"])
        if i < self.warm:
            self.warmup_s += record["step_time_s"]
        elif i >= self.timed_end:
            self.drain_s += record["step_time_s"]
        else:
            self._timed(record, samples)

    def _timed(self, record: dict, samples: int) -> None:
        self.timed_samples += samples
        self.timed_s += record["step_time_s"]
        self.step_time.add(record["step_time_s"])
        self.data_wait.add(record["data_wait_s"])
        self.data_blocked.add(record["data_blocked_s"])
        self.compute.add(_compute(record, self.rank))
        self.bubble.add(record["bubble_s"])
        self.bubble_mean.add(record["bubble_s"])
        self.straggler_pct.add(record["straggler_pct"])
        for part, seconds in record["exposed_s"].items():
            self.exposed.setdefault(part, Mean()).add(seconds)
        for q, mean in enumerate(self.per_rank_compute):
            mean.add(_compute(record, q))
        self.gc_s += record["gc_s"]
        self.gc_max_s = max(self.gc_max_s, record["gc_s"])

    def summary(self) -> dict[str, Any]:
        """The summary's step figures (pipelines.job.trainer adds what is not per step)."""
        from pipelines.metrics import normalized_entropy

        timed = max(self.timed_end - self.warm, 0) if self.seen else 0
        return {
            "steps": self.seen,
            "samples": self.samples,
            "samples_per_s": self.timed_samples / max(self.timed_s, 1e-9),
            "loss": self.tail_loss_sum / self.tail_labels if self.tail_labels else float("nan"),
            "loss_first_step": self.loss_first_step,
            "ne": normalized_entropy(self.tail_loss_sum, self.tail_positives, self.tail_labels),
            # at most CURVE_POINTS points, evenly spaced, each at its step (every step: --metrics-jsonl)
            "curve_steps": self.loss_curve.steps,
            "loss_curve": self.loss_curve.values,
            "ne_curve": self.ne_curve.values,  # cumulative NE after each of those steps
            "straggler_pct": self.straggler_pct.mean(),
            "step_time_s": self.timed_s / max(timed, 1),
            "warmup_steps": self.warm,
            "warmup_s": self.warmup_s,
            "drain_steps": self.drain,
            "drain_s": self.drain_s,
            # medians and tails over the latest WINDOW timed steps (all of them in a shorter run)
            "aggregate_window_steps": min(timed, WINDOW),
            "step_time_median_s": self.step_time.median(),
            "step_time_p90_s": self.step_time.quantile(0.9),
            "step_time_p99_s": self.step_time.quantile(0.99),
            "data_wait_median_s": self.data_wait.median(),
            "data_blocked_median_s": self.data_blocked.median(),
            "compute_median_s": self.compute.median(),
            "bubble_s": self.bubble_mean.mean(),
            "bubble_median_s": self.bubble.median(),
            "bubble_p99_s": self.bubble.quantile(0.99),
            "gc_s": self.gc_s,  # this rank's garbage-collection pauses in the timed steps
            "gc_max_s": self.gc_max_s,
            "exposed_s": {part: mean.mean() for part, mean in self.exposed.items()},
            "per_rank_compute_s": [mean.mean() for mean in self.per_rank_compute],
            "unmeasured": self.unmeasured,
            # steps whose samples the balancer moved (the balance gate keeps the others local); None: no balancer
            "balanced_steps": self.balanced_steps,
        }


def per_step(records: Iterable[dict]) -> dict[str, Any]:
    """Every step's series, from the step records of a ``--metrics-jsonl`` file (its evaluation lines skipped): step
    times, bubbles, exposed parts and straggler waits, rank 0's clues to a stalled step (pipelines.job.run.accounting),
    and the balance gate's predicted gains (None: no balancer)."""
    from pipelines.job.run.accounting import stall_clues

    steps = [r for r in records if "eval" not in r]
    parts = steps[0]["exposed_s"] if steps else {}
    return {
        "step_times_s": [r["step_time_s"] for r in steps],
        "bubbles_s": [r["bubble_s"] for r in steps],
        "exposed_per_step_s": {k: [r["exposed_s"][k] for r in steps] for k in parts},
        "straggler_per_step_s": [r["straggler_wait_s"] for r in steps],
        "stall_clues_per_step": stall_clues(steps),
        "predicted_gains": [r["balance"]["predicted_gain"] for r in steps] if steps and "balance" in steps[0] else None,
    }


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of a ``--metrics-jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
