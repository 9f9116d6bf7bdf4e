"""What a trainer does with each step beside the loop: this rank's slot of the step's bookkeeping block, the check
that the global loss is finite, and a settled record's way to the history, the summary's aggregates, the metrics
JSONL (``--metrics-jsonl``) and the progress bar, opened and closed around the loop with the ``--trace`` window
(:func:`run_outputs`); after the loop, the last step's record (:func:`settle_last`)."""

from __future__ import annotations

import contextlib
import json
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TextIO

import numpy as np
import torch

from fsdata.balance_measures import sparsity
from fsdata.item import LoaderItem
from pipelines.api.dense_sync import PER_RANK_FIELDS, gather_per_rank
from pipelines.api.step import StepResult
from pipelines.job.run.aggregates import RunAggregates
from pipelines.job.run.profiler import trace_window
from pipelines.job.run.progress import job_progress_bar
from pipelines.job.run.record import StepRecord


class NonFiniteLoss(FloatingPointError):
    """The step's global loss is NaN or infinite. ``root``: this rank's own loss is (the launcher names it)."""

    def __init__(self, message: str, root: bool) -> None:
        super().__init__(message)
        self.root = root


def rank_slot(item: LoaderItem, last_compute_s: float, last_step_s: float) -> tuple[float, ...]:
    """This rank's slot of the step's bookkeeping block, in PER_RANK_FIELDS order: its batch's tokens, samples and
    sparsity, and the previous step's compute and wall times."""
    batch = item.batch
    lengths = np.diff(batch.host_offsets("uih_offsets").numpy())  # numpy: no torch op (see dense_sync)
    slot = {
        "last_compute_s": last_compute_s,
        "tokens": float(lengths.sum()),
        "samples": float(batch.batch_size),
        "sparsity": sparsity(lengths),
        "last_step_s": last_step_s,
    }
    return tuple(slot[name] for name in PER_RANK_FIELDS)


def check_finite(result: StepResult, step: int, rank: int) -> None:
    """Stops the run at a non-finite global loss, on every rank alike (every rank sees the same global sum), naming
    the rank whose own loss was non-finite."""
    if np.isfinite(result.loss_sum):
        return
    local = float(result.local_loss_sum)
    where = (
        f"on rank {rank} (its loss sum is {local})"
        if not np.isfinite(local)
        else f"on another rank (rank {rank}'s loss sum is finite)"
    )
    raise NonFiniteLoss(f"non-finite loss at step {step} {where}: the run stops here", root=not np.isfinite(local))


def log_record(
    record: StepRecord, history: deque, aggregates: RunAggregates, metrics: Optional[TextIO], progress: Any
) -> None:
    """A settled step's record: kept in ``history``, added to ``aggregates``, written to ``metrics``, and its loss
    and straggler share shown on ``progress``."""
    line = record.as_dict()
    history.append(line)
    aggregates.add(line)
    if metrics is not None:
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()
    if progress is not None:
        straggler = record.straggler_pct
        progress.set_postfix(loss=f"{record.loss:.4f}", straggler="n/m" if straggler is None else f"{straggler:.1f}%")
        progress.update(1)


def log_settled(
    record: StepRecord, unsettled: Optional[StepRecord], rank: int, log: Callable[[StepRecord], None]
) -> Optional[StepRecord]:
    """Logs the step whose record is complete, and returns the record left waiting for the next step's block: this
    one is complete where the step's block carries no compute times (the torchrec baseline's: nothing to wait
    for); else the previous one (``unsettled``) is, which this step's block completed with every rank's compute
    time, and this one waits."""
    if record.last_compute_all_s is None:
        log(record.settle(None, rank))
        return unsettled
    if unsettled is not None:
        log(unsettled.settle(record.last_compute_all_s, rank))
    return record


def settle_last(
    unsettled: Optional[StepRecord],
    last_compute_s: float,
    rank: int,
    world_size: int,
    device: torch.device,
    log: Callable[[StepRecord], None],
) -> None:
    """Logs the last step's record, left waiting by :func:`log_settled`: no later block carries its compute times, so
    they are gathered here (one tiny all-gather, on every rank alike)."""
    if unsettled is None:
        return
    last = gather_per_rank((last_compute_s,), rank, world_size, device)[:, 0]
    log(unsettled.settle(last, rank))


@contextlib.contextmanager
def run_outputs(run: Any, rank: int, step: int, world_size: int, device: torch.device) -> Iterator[tuple]:
    """What a run writes beside its checkpoints, from ``step`` on (``run``: the job's ``[run]`` section): the progress
    bar, rank 0's metrics file and the started ``--trace`` window (each None where not asked for), closed after the
    loop however it ends."""
    progress = job_progress_bar(run, rank, step, world_size)
    metrics = open_metrics(run.metrics_jsonl, rank)
    profiler = trace_window(run.trace, rank, run.steps, run.warmup_steps, device)
    try:
        yield progress, metrics, profiler
    finally:
        if profiler is not None:
            profiler.stop()
        if progress is not None:
            progress.close()
        if metrics is not None:
            metrics.close()


def open_metrics(path: Optional[str], rank: int) -> Optional[TextIO]:
    """Rank 0's ``--metrics-jsonl`` file, written anew by the run (its folder made first); None elsewhere or without
    a path."""
    if rank != 0 or not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w")
