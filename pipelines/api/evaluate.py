"""Held-out evaluation: NE and AUC of a model on samples it did not train on, every rank's samples counted once.

An evaluation pass runs the model over a loader of held-out data (``fsdata.build_loader`` over, say, the
converters' ``--eval-out`` split, with no balancer stages: the plan does not matter when nothing is updated),
under ``torch.no_grad()`` and in eval mode. Swapped embedding tables are read after ``stage.flush()``, so
deferred updates have landed; in eval mode their lookup is a plain synchronous exchange, one per batch on every
rank: the loader gives every rank the same number of batches (the last ones short or empty), so the exchanges
pair up.

Metrics, over the whole held-out set (all ranks, each sample once):

- **NE**: the summed BCE over the label count, divided by the entropy of the labels' positive rate (as the
  training NE, pipelines.models.reference.normalized_entropy).
- **AUC**: the area under the ROC curve per label column (torchmetrics' binary AUROC over every rank's
  predictions, gathered), and their mean over the columns that have both classes (a column without positives or
  without negatives has no AUC: NaN).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from fsdata.item import as_item
from pipelines.api.numerics import autocast, autocast_dtype
from pipelines.models.reference import normalized_entropy


@dataclass
class EvalResult:
    """One evaluation pass, as every rank sees it."""

    ne: float
    auc: float  # mean over the label columns that have an AUC
    auc_per_label: list[float]
    loss: float  # mean BCE per label
    samples: int
    labels: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    from torchmetrics.functional.classification import binary_auroc

    positives = int(labels.sum())
    if positives == 0 or positives == labels.numel():
        return float("nan")
    return float(binary_auroc(scores, labels.long()))


def _gathered(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's rows of ``tensor`` (CPU, any row counts), in rank order."""
    if world_size == 1:
        return tensor
    parts: list[Optional[torch.Tensor]] = [None] * world_size
    dist.all_gather_object(parts, tensor)
    return torch.cat(parts)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    items: Iterable,
    *,
    stage=None,
    inputs=None,
    device: torch.device = torch.device("cpu"),
    precision: str = "auto",
    world_size: Optional[int] = None,
) -> EvalResult:
    """NE and AUC of ``model`` over ``items`` (LoaderItems or Batches of held-out data; every rank passes its own
    loader's). ``stage``: the embedding stage of ``wrap_model`` (flushed first); ``inputs``: ``batch -> model
    arguments`` (default: the stage's, else the batch). The model's outputs must be per-candidate logits
    [candidates, labels] (the reference model's). The model is left in the mode it was in."""
    from pipelines.api.step import call_model

    device = torch.device(device)
    world_size = (dist.get_world_size() if dist.is_initialized() else 1) if world_size is None else world_size
    if stage is not None:
        stage.flush()
        inputs = inputs if inputs is not None else getattr(stage, "inputs", None)
    dtype = autocast_dtype(precision, device)
    was_training = model.training
    model.eval()
    scores, targets, samples = [], [], 0
    try:
        for raw in items:
            item = as_item(raw)
            batch = item.batch if item.batch.device == device else item.batch.to(device, non_blocking=True)
            item = (
                item if batch is item.batch else type(item)(batch, item.report, None, item.attention_plan, item.extras)
            )
            if stage is not None:  # names the batch whose features the lookup takes (the model may take other inputs)
                stage.begin_step(batch)
            with autocast(dtype, device):
                logits = call_model(model, inputs, item)
            scores.append(logits.float().cpu())
            targets.append(batch.candidate_labels.float().cpu())
            samples += batch.batch_size
    finally:
        model.train(was_training)
    width = targets[0].shape[1] if targets else 1
    logits = _gathered(torch.cat(scores) if scores else torch.zeros(0, width), world_size)
    labels = _gathered(torch.cat(targets) if targets else torch.zeros(0, width), world_size)
    if world_size > 1:
        counted = torch.tensor([samples], dtype=torch.int64)
        dist.all_reduce(counted)
        samples = int(counted)
    if logits.shape != labels.shape:
        raise ValueError(
            f"evaluate: the model's outputs {tuple(logits.shape)} are not per-candidate logits of the "
            f"labels' shape {tuple(labels.shape)}"
        )
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double(), reduction="sum")
    count = labels.numel()
    per_label = [_auc(torch.sigmoid(logits[:, t]), labels[:, t]) for t in range(labels.shape[1])]
    valid = [a for a in per_label if not math.isnan(a)]
    return EvalResult(
        ne=normalized_entropy(float(bce), float(labels.sum()), float(count)),
        auc=sum(valid) / len(valid) if valid else float("nan"),
        auc_per_label=per_label,
        loss=float(bce) / count if count else float("nan"),
        samples=samples,
        labels=count,
    )
