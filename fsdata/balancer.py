"""The sequence load balancer (paper section 3.1, Algorithm 1) as three loader stages.

    reader -> prefetch -> GatherLengths (I) -> GatherCandidateLengths (II) -> PartitionStage (P) -> ShuffleSamples (III)

``balancer_stages`` returns the wrappers for ``fsdata.loader.build_loader(stages=...)``. Each exchanging
stage starts its collective one ``next()`` before its result is needed (fsdata.nodes.async_stage), so while
step i computes, Stage III of batch i+1, Stage II of batch i+2 and Stage I of batch i+3 are in flight; the model
waits only on handles. The collectives go through ``transport`` on a process group of the balancer's own.
Between P and III one small AllGather checks that every rank holds the same plan, and carries a partitioner's
failure on one rank to the others (fsdata.partition.agreement).
The balance gate (``min_gain``, fsdata.partition.gate) keeps a step's samples local, and skips Stage III's
exchange, when its fitted step-time model predicts that moving them would not pay. A memory budget
(``memory_budget``, fsdata.partition.budget) caps every rank's kept tokens; each rank sends its own limit in
Stage I and the step uses the least, so ``auto`` (from each device's free memory) gives one budget everywhere.

Semantics. Balancing permutes samples within one global step only (every sample of global step s stays in
step s), so the temporal order of training across steps is kept. Local batch sizes may differ afterwards
(VBS; also the last global batch of an epoch): the trainer backpropagates the sum of its local losses and
divides the summed gradients by the global label count, so the gradient is the global mean's whatever the
split (pipelines.job.trainer). Embedding gradients follow the same scaling since they flow from the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fscomm.timing import Timer
from fsdata.nodes.gather_lengths import GatherCandidateLengths, GatherLengths, StepFeedback
from fsdata.nodes.partition_stage import PartitionStage
from fsdata.nodes.shuffle import ShuffleSamples
from fsdata.partition import AutoTune, BalanceGate, BudgetSpec, get_partitioner


@dataclass
class BalancerConfig:
    """The balancer's config (``balancer_stages``), and the ``[balancer]`` table of `freescale train`'s config.
    ``balancer_stages`` balance whatever embedding mode the model is wrapped in (the stages a loop composes are the
    ones that run, mode sync included); `freescale train` composes them in modes replicated and freescale only, and
    its other modes ignore this section."""

    partitioner: str = "fbs"
    """A built-in (none, fbs, vbs, kk) or your own, ``module:function`` or ``path/to/file.py:function``."""
    alpha: Optional[float] = None
    """The cost exponent of L^alpha (fbs, vbs, kk); unset: the partitioner's."""
    autotune: bool = False
    """vbs: tune the per-rank budgets from measured step times."""
    min_gain: float = 0.0
    """The balance gate, in [0, 1): a step's samples move only when the fitted step-time model predicts the slowest
    rank at least this fraction faster for it (0: always move; off with ``autotune``)."""
    memory_budget: Optional[str] = None
    """Caps the kept tokens of every rank: a count, ``Nx`` (N times the step's mean per rank) or ``auto`` (from the
    device's free memory; ``auto:bytes_per_token=B,fixed_bytes=F,headroom=H`` sets the memory model); none by
    default."""

    def __post_init__(self) -> None:
        BudgetSpec.parse(self.memory_budget)  # a bad spelling fails where the config is made, naming the flag

    def validate(self) -> None:
        """What ``balancer_stages`` needs of the fields, each a one-line ValueError: ``memory_budget``'s spelling,
        ``autotune`` with vbs alone, ``min_gain`` in [0, 1)."""
        BudgetSpec.parse(self.memory_budget)
        if self.autotune and self.partitioner != "vbs":
            raise ValueError(f"--autotune applies to the vbs partitioner, not {self.partitioner!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")


def balancer_stages(
    config: BalancerConfig,
    transport: Any,
    rank: int,
    world_size: int,
    capacity: int,
    feedback: Optional[StepFeedback] = None,
    timer: Optional[Timer] = None,
    device: Any = None,
    max_uih: Optional[int] = None,
) -> list:
    """The three stage wrappers, or none when the partitioner is 'none' (no exchange at all, so no budget either).

    ``device``: where this rank trains (``memory_budget = auto`` measures it here, once: call this after the
    model is on the device and before the first step); ``max_uih``: the model's UIH cap, so the budget counts
    the tokens the model keeps (None: the gathered lengths, which the source has cut at its own cap).
    """
    config.validate()
    if config.partitioner == "none":
        return []
    budget = BudgetSpec.parse(config.memory_budget, max_uih=max_uih)
    limit = budget.rank_limit(device) if budget is not None else (0, 0.0)
    partitioner = get_partitioner(config.partitioner, alpha=config.alpha)
    autotune = AutoTune(world_size) if config.autotune else None
    # The gate's model gives every rank the same speed, which autotune exists to correct: not both.
    gate = BalanceGate(config.min_gain) if config.min_gain > 0 and autotune is None else None
    return [
        lambda node: GatherLengths(node, transport, rank, world_size, capacity, feedback, timer, limit),
        lambda node: GatherCandidateLengths(node, transport, world_size, timer),
        lambda node: PartitionStage(node, partitioner, autotune, gate, budget, transport, rank),
        lambda node: ShuffleSamples(node, transport, rank, world_size, timer),
    ]
