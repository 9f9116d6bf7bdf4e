"""pipelines: the public training API (wrap_model, TrainStep, ModelSpec, unwrap_model), the staged train
pipeline, the reference model, CLI, benchmarks and simulator. See docs/api.md."""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, so `freescale data ...` and other commands do not import the training stack.
_EXPORTS = {
    "ModelSpec": "pipelines.step",
    "StepResult": "pipelines.step",
    "TrainStep": "pipelines.step",
    "bce_loss": "pipelines.step",
    "evaluate": "pipelines.evaluate",
    "EvalResult": "pipelines.evaluate",
    "data_dims": "pipelines.dims",
    "DataDims": "pipelines.dims",
    "host_transport": "fscomm.registry",
    "unwrap_model": "pipelines.step",
    "wrap_model": "pipelines.step",
    "StagedPipeline": "pipelines.staged",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
