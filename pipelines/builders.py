"""build_* functions: each builds one component from its own config section only."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdata.source import SampleSource
from pipelines.config import DataConfig, ModelSection, TrainConfig
from pipelines.model import MODEL_PRESETS, ModelConfig, SequenceModel


def build_source(config: DataConfig, global_batch_size: int) -> SampleSource:
    """The data source. Synthetic data keys its collision knob to ``global_batch_size`` (B x world size), so
    the configured share of rows is shared between consecutive global batches."""
    if config.data == "synthetic":
        from fsdata.synthetic import SyntheticConfig, SyntheticSource

        overrides = {"collision_block_size": global_batch_size}
        if config.collision_rate is not None:
            overrides["collision_rate"] = config.collision_rate
        return SyntheticSource(
            SyntheticConfig.from_preset(
                config.preset, num_samples=config.num_samples, seed=config.data_seed, uih_cap=config.uih_cap, **overrides
            )
        )
    from fsdata.parquet import ParquetSource

    path = Path(config.data)
    paths = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not paths:
        raise ValueError(f"{path}: directory holds no *.parquet files")
    return ParquetSource(paths, uih_cap=config.uih_cap)


def build_model(config: ModelSection, source: SampleSource, seed: int) -> SequenceModel:
    """The reference model, shaped by the data's label and dense widths; identical initial weights on every rank."""
    if config.model not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {config.model!r}; choose from {sorted(MODEL_PRESETS)}")
    probe = source.read(0, 0, min(1, source.num_samples(0)))
    sizes = dict(MODEL_PRESETS[config.model])
    overrides = (("num_items", config.num_items), ("dim", config.dim), ("num_layers", config.num_layers), ("max_uih", config.max_uih))
    sizes.update({k: v for k, v in overrides if v is not None})
    model_config = ModelConfig(num_labels=max(probe.num_labels, 1), dense_dim=probe.dense.shape[1],
                               attention=config.attention, **sizes)
    torch.manual_seed(seed)
    return SequenceModel(model_config)


def build_pipeline(model: SequenceModel, config: TrainConfig, timer, device: torch.device):
    """The staged pipeline around ``model`` for the sharded-embedding modes (None for ``replicated``, ``torchrec``)."""
    if config.mode in ("replicated", "torchrec"):
        return None
    from fsembed import get_optimizer
    from pipelines.staged import StagedPipeline

    optimizer = get_optimizer(config.embedding_optimizer, lr=config.embedding_lr)
    return StagedPipeline(
        model,
        config.mode,
        features=lambda batch: {"item_embedding": model.item_ids(batch)},
        table_names=["item_embedding"],
        optimizer=optimizer,
        transport_name=config.transport,
        early_start=config.early_start,
        exclusive_start=config.exclusive_start,
        timer=timer,
        device=device,
    )


def build_torchrec_reference(model: SequenceModel, config: TrainConfig, device: torch.device):
    """torchrec's own DistributedModelParallel + TrainPipelineSparseDist around ``model`` (mode ``torchrec``,
    the outside reference; None in the other modes)."""
    if config.mode != "torchrec":
        return None
    from pipelines.torchrec_ref import TorchrecReference

    return TorchrecReference(
        model, optimizer_name=config.embedding_optimizer, embedding_lr=config.embedding_lr, lr=config.lr, device=device
    )
