"""Predictions and held-out evaluation: the model's per-candidate logits, and NE and AUC over every rank's samples.

``predict`` runs the model over a loader of any data (``fsdata.build_loader`` with no stages: an evaluation
needs no balancer and no ID prefetch, the plan does not matter when nothing is updated), or over one batch,
under ``torch.no_grad()`` and in eval mode, and returns this rank's per-candidate logits (or probabilities) with
each candidate's sample id and labels. ``evaluate`` is ``predict`` over every rank's held-out data, gathered,
then two figures. Swapped embedding tables are read after ``wrap.flush()``, so deferred updates have landed; in
eval mode their lookup is a plain synchronous exchange, one per batch on every rank: the loader gives every rank
the same number of batches (the last ones short or empty), so the exchanges pair up.

Metrics, over the whole held-out set (all ranks, each sample once):

- **NE**: the summed BCE of the logits (in float64) over the label count, divided by the entropy of the labels'
  positive rate (as the training NE, pipelines.metrics.normalized_entropy).
- **AUC**: the area under the ROC curve per label column: torchmetrics' binary AUROC of the float32 sigmoid of
  the logits against every candidate's label (every rank's, gathered); tied scores count half, as the
  trapezoid rule gives. ``auc`` is the mean over the columns that have both classes (a column without positives
  or without negatives has no AUC: NaN).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from fsdata.batch import Batch
from fsdata.item import LoaderItem, as_item
from pipelines.api.numerics import autocast, autocast_dtype
from pipelines.metrics import normalized_entropy


@dataclass
class Predictions:
    """One rank's outputs of a ``predict`` pass, a row per candidate in the order of its batches' candidates (a
    batch's ``candidate_offsets`` give each sample's rows)."""

    scores: torch.Tensor
    """float32 [candidates, labels]: the model's logits, or their sigmoid with ``probabilities=True``."""
    sample_ids: torch.Tensor
    """int64 [candidates]: the sample each row's candidate belongs to."""
    labels: torch.Tensor
    """float32 [candidates, labels]: the candidates' labels as the data holds them."""
    samples: int
    """Samples this rank ran."""


@dataclass
class EvalResult:
    """One evaluation pass, the same on every rank."""

    ne: float
    """Normalized entropy: the mean BCE of the logits over the entropy of the labels' positive rate."""
    auc: float
    """The mean of ``auc_per_label`` over the label columns that have an AUC (NaN if none has)."""
    auc_per_label: list[float]
    """ROC AUC per label column; NaN for a column without positives or without negatives."""
    loss: float
    """Mean BCE per label."""
    samples: int
    """Samples evaluated, every rank's, each once."""
    labels: int
    """Labels evaluated (candidates x label columns), every rank's."""

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


def _on_device(item: LoaderItem, device: torch.device) -> LoaderItem:
    if item.batch.device == device:
        return item
    return LoaderItem(item.batch.to(device, non_blocking=True), item.report, None, item.attention_plan, item.extras)


def _per_candidate(output: Any, batch: Batch) -> torch.Tensor:
    """The model's output for ``batch``, checked to be a row per candidate."""
    candidates = int(batch.candidate_offsets[-1])
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != candidates:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        first = f" (its first sample_id {int(batch.sample_ids[0])})" if batch.batch_size else ""
        raise ValueError(
            f"predict: the model returned {got} for a batch of {candidates} candidates{first}; predict and "
            "evaluate take a model whose forward returns per-candidate logits [candidates, labels]"
        )
    return output


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    items: Union[Iterable, Batch, LoaderItem],
    *,
    wrap=None,
    inputs=None,
    device: Union[str, torch.device] = "cpu",
    precision: str = "auto",
    probabilities: bool = False,
) -> Predictions:
    """The model's per-candidate logits (``probabilities=True``: their float32 sigmoid) over ``items``: a loader,
    any iterable of LoaderItems or Batches, or one Batch or LoaderItem. Runs under ``torch.no_grad()`` in eval
    mode and leaves the model in the mode it was in. ``wrap``: what ``wrap_model`` returned (flushed first; its
    lookups are collective, so every rank calls ``predict`` over as many batches); ``inputs``: ``batch -> model
    arguments`` (default: the wrap's, else the batch); ``precision``: as ``--precision`` (``auto`` is fp32 on CPU,
    bf16 autocast on CUDA). Returns this rank's rows only (``evaluate`` gathers every rank's)."""
    from pipelines.api.step import call_model
    from pipelines.api.wrap import as_args

    device = torch.device(device)
    if wrap is not None:
        wrap.flush()
        inputs = inputs if inputs is not None else getattr(wrap, "inputs", None)
    dtype = autocast_dtype(precision, device)
    was_training = model.training
    model.eval()
    scores, labels, sample_ids, samples = [], [], [], 0
    try:
        for raw in [items] if isinstance(items, (Batch, LoaderItem)) else items:
            item = _on_device(as_item(raw), device)
            batch = item.batch
            args = as_args(inputs, batch)
            # the lookup takes the batch's ids (the model may take other inputs), looked up synchronously: an ID
            # exchange a training loader's stage started is not this lookup's
            context = None if wrap is None else wrap.context_of(batch, args)
            with autocast(dtype, device):
                with wrap.lookup(context) if wrap is not None else contextlib.nullcontext():
                    outputs = call_model(model, inputs, item, args, context)
                logits = _per_candidate(outputs, batch)
            scores.append(logits.float().cpu())
            labels.append(batch.candidate_labels.float().cpu())
            sample_ids.append(batch.sample_ids.cpu().repeat_interleave(batch.num_candidates.cpu()))
            samples += batch.batch_size
    finally:
        model.train(was_training)
    width = labels[0].shape[1] if labels else 1
    logits = torch.cat(scores) if scores else torch.zeros(0, width)
    return Predictions(
        scores=torch.sigmoid(logits) if probabilities else logits,
        sample_ids=torch.cat(sample_ids) if sample_ids else torch.zeros(0, dtype=torch.int64),
        labels=torch.cat(labels) if labels else torch.zeros(0, width),
        samples=samples,
    )


def evaluate(
    model: torch.nn.Module,
    items: Iterable,
    *,
    wrap=None,
    inputs=None,
    device: Union[str, torch.device] = "cpu",
    precision: str = "auto",
    world_size: Optional[int] = None,
) -> EvalResult:
    """NE and AUC of ``model`` over ``items`` (every rank passes its own loader's held-out items): ``predict``'s
    logits and labels gathered from every rank, then the module docstring's metrics. The arguments are
    ``predict``'s; ``world_size``: the ranks to gather from (default: the process group's, 1 without one)."""
    world_size = (dist.get_world_size() if dist.is_initialized() else 1) if world_size is None else world_size
    rows = predict(model, items, wrap=wrap, inputs=inputs, device=device, precision=precision)
    logits, labels = _gathered(rows.scores, world_size), _gathered(rows.labels, world_size)
    samples = rows.samples
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
