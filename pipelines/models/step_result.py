"""What one training step returns, whichever kind of step ran it: the public API's TrainStep
(pipelines.api.step) or the torchrec baseline (pipelines.models.torchrec_baseline), so that `freescale train`'s trainer
drives either through one interface and builds its step record from this alone. It lives below both (the
layout's one rule: a package imports only the ones below it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class StepResult:
    """One step, as every rank sees it: the global mean loss, the global label count and positives; then what a
    job's record needs (timings, every rank's slot of the step's bookkeeping block)."""

    loss: float
    labels: float
    positives: float
    #: the global sum of the per-label losses
    loss_sum: float = float("nan")
    #: this rank's loss sum, on the device (reading it waits for the device): a non-finite loss names its rank
    local_loss_sum: Optional[torch.Tensor] = None
    #: this rank's forward and backward (its host time; with a hook that waits for the device, the device's);
    #: None where the step cannot tell it apart from the exchanges it interleaves (torchrec's progress())
    compute_s: Optional[float] = None
    #: the wait for the dense all-reduce after the compute; None where not measured
    allreduce_s: Optional[float] = None
    #: every rank's slot of the bookkeeping block, by field name ([world_size] each)
    per_rank: dict[str, np.ndarray] = field(default_factory=dict)
    #: exposed-time parts this step cannot time (reported as None, never as 0)
    unmeasured: tuple[str, ...] = ()
    #: what this kind of step adds to a job's record (the torchrec baseline: progress_s, bookkeeping_s)
    extras: dict[str, Any] = field(default_factory=dict)
