"""What a model factory reads from the job's data before building the model: the dense width and the label count.

def build_model(config):              # freescale train --model file.py:build_model
    dims = data_dims(config)
    return ModelSpec(MyModel(dense_dim=dims.dense_dim, num_labels=dims.num_labels), ...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pipelines.job.config.sections import JobConfig


class DataDims(NamedTuple):
    dense_dim: int  # D of batch.dense [B, D]
    num_labels: int  # T of batch.candidate_labels [C_total, T]


def data_dims(config: "JobConfig") -> DataDims:
    """The dense width and label count of the job's source (``config.data``: synthetic preset or Parquet), read
    from its first sample, as the softmax model is shaped (pipelines.job.builders.build_model). The same on every
    rank; a source without samples gives (0, 1)."""
    from pipelines.job.builders import build_source

    source = build_source(config.data, config.loader.batch_size)
    probe = source.read(0, 0, min(1, source.num_samples(0)))
    return DataDims(int(probe.dense.shape[1]), max(probe.num_labels, 1))
