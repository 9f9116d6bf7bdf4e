"""The default loss and the metrics a job reports: what a step's loss sum and label counts become.

    binary_cross_entropy_sum(logits, labels)         the default loss (ModelSpec.loss, TrainStep's): per-label BCE,
                                                     summed over the local candidates
    normalized_entropy(loss_sum, positives, count)   NE: the mean loss over the entropy of the base rate

A step reports ``loss_sum`` whatever its loss is; NE reads it as a BCE sum, so it means NE only for a BCE loss
(the default). The models (pipelines.models), the step (pipelines.api) and the job (pipelines.job) all read these
from here, so this module imports nothing of the pipelines.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def binary_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-label BCE over the local candidates (the step scales it to the global mean)."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


def normalized_entropy(loss_sum: float, positives: float, count: float) -> float:
    """NE = mean BCE (``loss_sum / count``) / entropy of the base rate (lower is better, 1.0 = predicting the base
    rate)."""
    if count <= 0:
        return float("nan")
    p = min(max(positives / count, 1e-7), 1 - 1e-7)
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return (loss_sum / count) / base
