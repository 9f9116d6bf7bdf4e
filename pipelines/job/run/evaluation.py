"""The held-out evaluation of a job (``--eval-data``): one pass over the held-out source every ``--eval-every`` steps
and at the end (pipelines.api.evaluate: no gradient, tables flushed, every rank's samples once); its NE and AUC go to
the progress output, the metrics JSONL and the run summary."""

from __future__ import annotations

import json
from typing import Any, Optional, TextIO

import torch

from fsdata.loader import LoaderConfig, build_loader, shutdown_loader
from fsdata.source import SampleSource
from pipelines.api.evaluate import evaluate


class HeldOut:
    """The held-out source and every evaluation of it so far (``evaluations``: one record each)."""

    def __init__(self, source: SampleSource, path: str, batch_size: int, rank: int, world_size: int) -> None:
        self.source, self.path, self.batch_size = source, path, batch_size
        self.rank, self.world_size = rank, world_size
        self.evaluations: list[dict] = []

    @classmethod
    def of(cls, source: Optional[SampleSource], config: Any, rank: int, world_size: int) -> Optional["HeldOut"]:
        """The job's held-out evaluation (``config``: the job's config), None without a held-out source."""
        if source is None:
            return None
        return cls(source, config.data.eval_path, config.loader.batch_size, rank, world_size)

    def evaluate(
        self,
        step: int,
        model: torch.nn.Module,
        wrap: Any,
        inputs: Any,
        device: torch.device,
        precision: str,
        metrics: Optional[TextIO] = None,
        progress: Any = None,
        show: bool = True,
    ) -> dict:
        """One pass at ``step``; its record (``{"step", "ne", "auc", ...}``) is kept, written to ``metrics`` and,
        with ``show`` on rank 0, printed through ``progress`` (or print)."""
        loader = build_loader(self.source, LoaderConfig(batch_size=self.batch_size), self.rank, self.world_size)
        try:
            result = evaluate(
                model,
                loader,
                wrap=wrap,
                inputs=inputs,
                device=device,
                precision=precision,
                world_size=self.world_size,
            )
        except BaseException:
            shutdown_loader(loader, abandon=True)  # the rank ends: no wait for its item in flight (as in train)
            raise
        shutdown_loader(loader)
        record = {"step": step, **result.as_dict()}
        self.evaluations.append(record)
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "eval": result.as_dict()}) + "\n")
            metrics.flush()
        if self.rank == 0 and show:
            line = (
                f"step {step}: held-out NE {result.ne:.4f}, AUC {result.auc:.4f} ({result.samples} samples, "
                f"{self.path})"
            )
            (progress.write if progress is not None else print)(line)
        return record
