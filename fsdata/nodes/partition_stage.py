"""The partition stage: turns one step's gathered lengths (and gathered runtime info R) into a plan.

The plan is a pure function of what every rank gathered, so every rank computes the same plan without
exchanging it. The measured step times ride along with the lengths (Stage I): each rank sends its newest
measurement, which may be of different steps on different ranks (each rank's loader reads its trainer's report
at its own moment). :class:`_Measurements` joins them across the gathered items: a step is *measured* once every
rank's time for it has arrived, in one item or over several. Its input is gathered, so it completes the same
steps on every rank.

Measured steps feed VBS autotune (:class:`AutoTune`) and the balance gate (fsdata.partition.gate), which may keep
a step's identity plan. A memory budget (``budget``, fsdata.partition.budget) becomes the step's
``RuntimeInfo.memory_budget`` from the least the ranks sent in Stage I; a step no plan can fit fails here, before
it trains, and so does a partitioner's plan that puts a rank over the budget. Their states and the partly measured
steps are this node's state, so a resumed job plans
exactly as the stopped one would have.

Given the balancer's ``transport``, the stage checks that every rank holds the same plan before Stage III moves a
sample (fsdata.partition.agreement: one small AllGather per step). An exception in a user's partitioner becomes a
:class:`PartitionerError` naming the partitioner and the step; the other ranks learn of it in that same exchange
and stop with it, so the launcher names the rank where it was raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torchdata.nodes import BaseNode

from fsdata.batch import Batch
from fsdata.item import LoaderItem
from fsdata.nodes.gather_lengths import Gathered
from fsdata.partition import (
    BUILTIN,
    AutoTune,
    BalanceGate,
    BudgetSpec,
    GatheredLengths,
    MemoryBudget,
    Partitioner,
    PartitionerError,
    Plan,
    PlanAgreement,
    RuntimeInfo,
    partitioner_name,
)


@dataclass
class Planned:
    item: LoaderItem
    lengths: GatheredLengths
    plan: Plan
    step: int
    predicted_gain: Optional[float] = None  # the balance gate's prediction for the partitioner's plan, if gated
    extra_lengths: Optional[torch.Tensor] = None  # int64 [G, K]: the extra jagged fields' lengths (Gathered)
    memory_budget: Optional[MemoryBudget] = None  # the step's budget, when there is one

    @property
    def batch(self) -> Batch:
        return self.item.batch


class _Measurements:
    """Joins the ranks' gathered (step, seconds) reports into whole measured steps, oldest first."""

    MAX_PARTIAL = 64  # partly measured steps kept (a rank whose reads jump past a step never reports it)

    def __init__(self) -> None:
        self.partial: Dict[int, Dict[int, float]] = {}  # step -> {rank: seconds}
        self.newest = -1  # newest whole step handed out
        self.newest_times: Optional[torch.Tensor] = None
        self.world = 0

    def add(self, measured_steps: torch.Tensor, step_times: torch.Tensor) -> list:
        """Takes one item's reports; returns the steps they completed, as ``[(step, times [W] float64)]``."""
        world = measured_steps.numel()
        if world != self.world:  # resumed on another world size: the old ranks' reports do not join the new
            self.partial, self.newest_times, self.world = {}, None, world
        for rank, (step, seconds) in enumerate(zip(measured_steps.tolist(), step_times.tolist())):
            if step > self.newest:
                self.partial.setdefault(step, {})[rank] = seconds
        done = sorted(s for s, times in self.partial.items() if len(times) == world)
        out = [(s, torch.tensor([self.partial[s][r] for r in range(world)], dtype=torch.float64)) for s in done]
        if out:
            self.newest, self.newest_times = out[-1]
        for s in [s for s in self.partial if s <= self.newest]:
            del self.partial[s]
        while len(self.partial) > self.MAX_PARTIAL:
            del self.partial[min(self.partial)]
        return out

    def state_dict(self) -> dict:
        times = None if self.newest_times is None else self.newest_times.tolist()
        partial = {s: dict(t) for s, t in self.partial.items()}
        return {"partial": partial, "newest": self.newest, "newest_times": times, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        self.partial = {int(s): {int(r): float(x) for r, x in t.items()} for s, t in state["partial"].items()}
        self.newest = int(state["newest"])
        times = state["newest_times"]
        self.newest_times = None if times is None else torch.tensor(times, dtype=torch.float64)
        self.world = int(state["world"])


class PartitionStage(BaseNode[Planned]):
    SOURCE_KEY = "source"
    STEP_KEY = "step"
    MEASURED_KEY = "measured"
    AUTOTUNE_KEY = "autotune"
    GATE_KEY = "gate"

    def __init__(
        self,
        source: BaseNode[Gathered],
        partitioner: Partitioner,
        autotune: Optional[AutoTune] = None,
        gate: Optional[BalanceGate] = None,
        budget: Optional[BudgetSpec] = None,
        transport: Any = None,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.source, self.partitioner, self.autotune, self.gate = source, partitioner, autotune, gate
        self.budget = budget
        self.name = partitioner_name(partitioner)
        self._builtin = isinstance(partitioner, tuple(BUILTIN.values()))
        # None: no cross-rank check (a stage driven on one rank, as in tests of the planning alone)
        self.agreement = PlanAgreement(transport, rank, self.name) if transport is not None else None
        self._step = 0
        self._measured = _Measurements()

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._measured = _Measurements()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self._step = int(initial_state[self.STEP_KEY])
        if initial_state.get(self.MEASURED_KEY) is not None:  # absent from checkpoints before the join
            self._measured.load_state_dict(initial_state[self.MEASURED_KEY])
        for part, key in ((self.autotune, self.AUTOTUNE_KEY), (self.gate, self.GATE_KEY)):
            saved = initial_state.get(key)
            if part is not None and saved is not None:
                part.load_state_dict(saved.get("state", saved))  # earlier checkpoints wrapped autotune's state

    def get_state(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            self.SOURCE_KEY: self.source.state_dict(),
            self.STEP_KEY: self._step,
            self.MEASURED_KEY: self._measured.state_dict(),
        }
        for part, key in ((self.autotune, self.AUTOTUNE_KEY), (self.gate, self.GATE_KEY)):
            if part is not None:
                state[key] = part.state_dict()
        return state

    def next(self) -> Planned:
        item = next(self.source)
        runtime = self._runtime(item)
        plan, gain, failure = None, None, None
        try:
            plan, gain = self._plan(item, runtime)
        except Exception as error:  # raised after the agreement has told the other ranks, so they stop with it
            failure = error
        if self.agreement is not None:
            self.agreement.check(self._step, item.lengths, runtime, plan, failure)
        elif failure is not None:
            raise failure
        planned = Planned(
            item=item.item,
            lengths=item.lengths,
            plan=plan,
            step=self._step,
            predicted_gain=gain,
            extra_lengths=item.extra_lengths,
            memory_budget=runtime.memory_budget,
        )
        self._step += 1
        return planned

    def _runtime(self, item: Gathered) -> RuntimeInfo:
        """The step's runtime info R, from the measurements gathered so far (identical on every rank)."""
        for step, times in self._measured.add(item.measured_steps, item.step_times):
            if self.autotune is not None:
                self.autotune.observe(step, times)
            if self.gate is not None:
                self.gate.observe(step, times)
        runtime = RuntimeInfo(
            step=self._step, measured_step=self._measured.newest, step_times=self._measured.newest_times
        )
        if self.autotune is not None:
            runtime.budget_shares = self.autotune.shares_for_step(self._step)
        return runtime

    def _plan(self, item: Gathered, runtime: RuntimeInfo) -> tuple[Plan, Optional[float]]:
        """The step's plan, checked (exactly once, the memory budget) and gated; the gate's predicted gain."""
        who = f"partitioner {self.partitioner!r} at step {self._step}"
        if self.budget is not None:
            runtime.memory_budget = self.budget.for_step(item.lengths, item.budget_tokens, item.budget_factor)
            runtime.memory_budget.check_fits(item.lengths, who)
        plan = self._call_partitioner(item.lengths, runtime)
        enforced = runtime.memory_budget if getattr(self.partitioner, "honours_budget", True) else None
        plan.validate(item.lengths.num_samples, item.lengths.world_size, who=who, lengths=item.lengths, budget=enforced)
        gain = None
        if self.gate is not None:
            plan, gain = self.gate.choose(self._step, item.lengths, plan, enforced)
        if self.autotune is not None and hasattr(self.partitioner, "rank_weights"):
            # Judge this step's later measurement against the weight each rank really got, not its planned
            # share: the cut granularity (up to one sample per rank) then stays out of the estimate.
            self.autotune.record_weights(self._step, self.partitioner.rank_weights(item.lengths, runtime, plan))
        return plan, gain

    def _call_partitioner(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        try:
            return self.partitioner(lengths, runtime)
        except Exception as error:
            if isinstance(error, PartitionerError) or (self._builtin and isinstance(error, ValueError)):
                raise  # its message names the partitioner already
            raise PartitionerError(
                f"partitioner {self.name} raised {type(error).__name__} at step {runtime.step}: {error}"
            ) from error
