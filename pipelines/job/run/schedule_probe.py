"""freescale's embedding schedule, chosen per job from measured step times.

Prioritized updates (Algorithm 2) take the embedding exchanges off the critical path, at the price of host
work: per step, a collision check, a flags exchange, two chains of side work whose Python shares the GIL with
the training thread. Where the exchanges are long (long sequences, large tables) that price is small against
what it hides. Where the step is bound by the host instead (short sequences, tiny tables: the e2e bench's
light case) the exchanges it hides are short, and sdd's schedule (the next batch's ID exchange overlapped, the
lookup and the embedding exchanges inside the step) is faster. Both give the synchronous path's numbers bit for
bit (fsembed.prioritized.PrioritizedEmbeddingCollection.set_schedule), so the job can measure both and keep the
faster, as cuDNN's benchmark mode picks a convolution algorithm.

``--embeddings.schedule auto`` (the default in mode freescale) probes, then commits:

    steps [0, start)           prioritized, not measured (one-time costs: compilation, first pinned buffers)
    probe A                    prioritized, until ``steps`` step times are known
    one transition step        sdd, not measured (it flushes the prioritized context)
    probe B                    sdd, until ``steps`` step times are known
    the rest of the job        prioritized when its median step time is at least ``margin`` below sdd's
                               (its first step looks its rows up synchronously), else sdd

Prioritized updates must pay measurably to be kept: they hold one more batch's rows and run two more threads,
and a shared host's noise can hide a few percent either way, so a tie runs sdd. Where the exchanges dominate,
the gap is far wider than the margin (the probes' medians are in each run's record and in BENCHMARKS.md).

A step's time is its wall time on the slowest rank. It reaches every rank one step late, in the per-rank slots
of the next step's dense all-reduce (pipelines.api.dense_sync), so every rank sees the same numbers and switches at
the same step: no collective of its own. That lag costs a step at the end of each probe, so the choice runs
from step ``start + 2 * steps + 3`` on; ``ScheduleProbe.length`` counts one step more, the choice's first (a
transition again when it is prioritized). A resumed job probes again: measurements of another process (and
maybe another world size) are not this one's. ``--embeddings.schedule prioritized|sdd`` fixes the schedule.
"""

from __future__ import annotations

import statistics
from typing import Optional

from fsembed.schedules import RUNTIME_SCHEDULES

SCHEDULE_CHOICES = ("auto", *RUNTIME_SCHEDULES)
# Steps of a process that the probe leaves out: they pay one-time costs (kernel compilation, the first pinned
# buffers), so the first steps can take several times as long as the later ones.
PROBE_START = 3
PROBE_STEPS = 4


class ScheduleProbe:
    """Which embedding schedule each step runs. ``schedule_for(step)`` before the step (the same on every rank),
    ``observe(step, seconds)`` once that step's time (slowest rank) is known, in any later step."""

    def __init__(
        self,
        schedule: str = "auto",
        *,
        first_step: int = 0,
        start: int = PROBE_START,
        steps: int = PROBE_STEPS,
        margin: float = 0.05,
    ) -> None:
        if schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"embedding_schedule must be one of {SCHEDULE_CHOICES}, got {schedule!r}")
        if steps < 1 or start < 0:
            raise ValueError(f"schedule probe: steps must be >= 1 and start >= 0, got steps={steps}, start={start}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"schedule probe: margin must be in [0, 1), got {margin}")
        self.mode, self.steps, self.margin = schedule, steps, margin
        self.first_measured = first_step + start
        self._phase = "prioritized" if schedule == "auto" else schedule  # the schedule of the steps to come
        self.choice: Optional[str] = None if schedule == "auto" else schedule
        self.decided_at: Optional[int] = None  # the first step that ran the choice (auto)
        self._ran: dict[int, str] = {}  # step -> schedule, for the steps not yet observed
        self._transition: Optional[int] = None  # the first sdd step (flushes: not measured)
        self.times: dict[str, list[float]] = {"prioritized": [], "sdd": []}

    @staticmethod
    def length(steps: int = PROBE_STEPS) -> int:
        """Steps from ``start`` on that an auto probe spends, up to and with the choice's first step."""
        return 2 * steps + 4

    def schedule_for(self, step: int) -> str:
        schedule = self._phase
        if self.mode == "auto" and self.choice is None:
            self._ran[step] = schedule
            if schedule == "sdd" and self._transition is None:
                self._transition = step
        elif self.mode == "auto" and self.decided_at is None:
            self.decided_at = step
        return schedule

    def observe(self, step: int, seconds: float) -> None:
        schedule = self._ran.pop(step, None)
        if schedule is None or self.choice is not None or step < self.first_measured or step == self._transition:
            return
        if schedule != self._phase:  # a step of probe A observed after probe B began
            return
        times = self.times[schedule]
        times.append(float(seconds))
        if len(times) < self.steps:
            return
        if schedule == "prioritized":
            self._phase = "sdd"
            return
        pays = self.median("prioritized") < (1.0 - self.margin) * self.median("sdd")
        self.choice = self._phase = "prioritized" if pays else "sdd"
        self._ran.clear()

    def median(self, schedule: str) -> Optional[float]:
        times = self.times[schedule]
        return statistics.median(times) if times else None

    def summary(self) -> dict:
        """For the run summary: the choice and the probe's median step times (seconds)."""
        return {
            "mode": self.mode,
            "choice": self.choice,
            "decided_at": self.decided_at,
            "probe_steps": self.steps,
            "probe_median_s": {k: self.median(k) for k in self.times},
            "margin": self.margin,
        }


def describe_choice(summary: dict) -> str:
    """The run summary's line for an auto probe (``ScheduleProbe.summary()``): the choice, the probes' median step
    times and the margin that decided between them."""
    medians = {k: v for k, v in summary["probe_median_s"].items() if v is not None}
    chosen = (
        f"{summary['choice']} from step {summary['decided_at']}"
        if summary["choice"]
        else "not chosen: the run ended inside the schedule probe"
    )
    if not medians:
        return chosen
    probe = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in medians.items())
    if len(medians) < 2 or not medians["sdd"]:
        return f"{chosen} (probe medians: {probe})"
    gain = 1.0 - medians["prioritized"] / medians["sdd"]
    faster = f"{100 * abs(gain):.1f}% {'faster' if gain >= 0 else 'slower'}"
    return (
        f"{chosen} (probe medians: {probe}; prioritized {faster}, kept only when at least "
        f"{100 * summary['margin']:.0f}% faster)"
    )
