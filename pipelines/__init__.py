"""pipelines, in the parts a reader finds by name:

    api/       the training API a user's script calls: wrap_model (and the EmbeddingWrap it returns), TrainStep,
               ModelSpec, unwrap_model, predict, evaluate
    job/       what `freescale train` runs around the API's step, in rooms: config/, checkpoint/, launch/, run/
    models/    the built-in models (a softmax transformer, and HSTU), and torchrec's TrainPipelineSparseDist and PEC
               around the first as outside baselines
    cli/       the `freescale` command and its data commands
    simulate/  the step-time simulator: `freescale simulate`, the straggler effect of N ranks without N devices

The public names are re-exported here (``from pipelines import TrainStep, wrap_model, ...``; docs/api.md)."""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, so `freescale data ...` and other commands do not import the training stack.
_EXPORTS = {
    "ModelSpec": "pipelines.api.step",
    "StepResult": "pipelines.api.step",
    "TrainStep": "pipelines.api.step",
    "bce_loss": "pipelines.api.step",
    "evaluate": "pipelines.api.evaluate",
    "EvalResult": "pipelines.api.evaluate",
    "predict": "pipelines.api.evaluate",
    "Predictions": "pipelines.api.evaluate",
    "load_export": "pipelines.job.checkpoint.export",
    "data_dims": "pipelines.job.dims",
    "DataDims": "pipelines.job.dims",
    "host_transport": "fscomm.registry",
    "unwrap_model": "pipelines.api.step",
    "wrap_model": "pipelines.api.step",
    "EmbeddingWrap": "pipelines.api.wrap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
