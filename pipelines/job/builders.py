"""build_* functions: each builds one component from its own config section only."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from fsdata.source import SampleSource
from kernels.attention import resolve_impl
from pipelines.api.modes import MODES
from pipelines.api.step import ModelSpec, StepHooks, TrainStep
from pipelines.job.config.sections import (
    JobConfig,
    JobDataSection,
    JobDenseSyncSection,
    JobEmbeddingsSection,
    JobModelSection,
    JobRunSection,
)
from pipelines.models.hstu import HSTU_PRESETS, HSTUConfig, HSTUModel
from pipelines.models.softmax import SOFTMAX_PRESETS, SoftmaxConfig, SoftmaxModel


def build_source(config: JobDataSection, global_batch_size: int) -> SampleSource:
    """The data source. Synthetic data keys its collision knob to ``global_batch_size`` (B x world size), so
    the configured share of rows is shared between consecutive global batches."""
    if config.path == "synthetic":
        from fsdata.synthetic import SyntheticConfig, SyntheticSource

        overrides = {"collision_block_size": global_batch_size}
        if config.collision_rate is not None:
            overrides["collision_rate"] = config.collision_rate
        return SyntheticSource(
            SyntheticConfig.from_preset(
                config.preset,
                num_samples=config.num_samples,
                seed=config.seed,
                uih_cap=config.uih_cap,
                **overrides,
            )
        )
    from fsdata.parquet import ParquetSource

    path = Path(config.path)
    paths = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not paths:
        raise ValueError(f"{path}: directory holds no *.parquet files")
    return ParquetSource(paths, uih_cap=config.uih_cap, drop_bad_samples=config.drop_bad_samples)


def is_factory(name: str) -> bool:
    """Whether ``--model`` names a factory (``module:function`` or ``path/file.py:function``), not a preset."""
    return ":" in name


def build_model_spec(config: JobConfig, source: SampleSource) -> ModelSpec:
    """The model to train and how to train it: a user's factory (``--model module:function`` or
    ``path/file.py:function``, called with the job's config; it returns a ModelSpec, or just the model), or the
    model of a preset (the softmax model, or the HSTU model of an HSTU preset), described the same way (its item
    table swapped by name, its features the ids of its one lookup)."""
    if is_factory(config.model.name):
        from fsdata.resolve import load_callable

        factory = load_callable(config.model.name, "model factory")
        spec = factory(config)
        if isinstance(spec, torch.nn.Module):
            spec = ModelSpec(spec)
        if not isinstance(spec, ModelSpec):
            raise ValueError(
                f"model factory {config.model.name!r} returned a {type(spec).__name__}; return a "
                "pipelines.ModelSpec (or an nn.Module)"
            )
        return spec
    model = build_model(
        config.model,
        source,
        seed=config.run.seed,
        deterministic=config.run.deterministic,
        attention_impl=config.kernels.attention_impl,
    )
    # A plan only for a kernel that takes block masks (FlexAttention); the loader runs its stage on CUDA alone.
    plan = model.plan_function() if model.needs_plan(torch.device("cuda")) else None
    return ModelSpec(
        model,
        embeddings=["item_embedding"],
        features=model.embedding_ids,
        plan=plan,
    )


def build_model(
    config: JobModelSection,
    source: SampleSource,
    seed: int,
    deterministic: bool = False,
    attention_impl: Optional[str] = None,
) -> Union[SoftmaxModel, HSTUModel]:
    """The model of a preset: the softmax model (SOFTMAX_PRESETS) or the HSTU model (pipelines.models.hstu's
    HSTU_PRESETS), shaped by the data's label and dense widths; identical initial weights on every rank.
    ``deterministic`` picks the attention kernel that is reproducible as it is (the softmax model's FlexAttention,
    the HSTU Triton kernel's deterministic backward) where ``attention_impl`` (the job's ``kernels.attention_impl``)
    is unset."""
    presets = {**SOFTMAX_PRESETS, **HSTU_PRESETS}
    if config.name not in presets:
        raise ValueError(
            f"unknown model preset {config.name!r}; choose from {sorted(presets)} or name a "
            "factory: module:function or path/to/file.py:function"
        )
    probe = source.read(0, 0, min(1, source.num_samples(0)))
    sizes = dict(presets[config.name])
    overrides = (
        ("num_items", config.num_items),
        ("dim", config.dim),
        ("num_layers", config.num_layers),
        ("max_uih", config.max_uih),
    )
    sizes.update({k: v for k, v in overrides if v is not None})
    shape = dict(num_labels=max(probe.num_labels, 1), dense_dim=probe.dense.shape[1])
    if config.name in HSTU_PRESETS:
        hstu_config = _hstu_config(config, sizes, shape, deterministic, attention_impl)
        torch.manual_seed(seed)
        return HSTUModel(hstu_config)
    impl = attention_impl
    if impl is None and deterministic:
        impl = resolve_impl(None, torch.device("cuda"), deterministic=True).value
    model_config = SoftmaxConfig(attention=config.attention, attention_impl=impl, **shape, **sizes)
    torch.manual_seed(seed)
    return SoftmaxModel(model_config)


def _hstu_config(
    config: JobModelSection, sizes: dict, shape: dict, deterministic: bool, attention_impl: Optional[str]
) -> HSTUConfig:
    """The HSTU model's config of preset ``config.name``; the softmax model's attention options are refused in
    one line (HSTU has its own kernel, kernels.hstu)."""
    if config.attention != "jagged":
        raise ValueError(
            f"--attention {config.attention} is the softmax model's; --model {config.name} packs its sequences "
            "(jagged) always"
        )
    if attention_impl not in (None, "torch"):
        raise ValueError(
            f"--kernels.attention-impl {attention_impl} is not a kernel of --model {config.name}: leave it unset "
            "(Triton on CUDA) or give torch"
        )
    positions = config.positions or "rab"
    return HSTUConfig(
        attention_impl=attention_impl,
        deterministic=deterministic,
        rab=positions in ("rab", "both"),
        position_embeddings=positions in ("embeddings", "both"),
        fp32_residual=config.residual != "bf16",
        **shape,
        **sizes,
    )


def build_wrap(
    spec: ModelSpec,
    mode: str,
    embeddings: JobEmbeddingsSection,
    timer,
    device: torch.device,
):
    """The embedding wrap around ``spec.model`` for the sharded-embedding modes, through the public
    ``wrap_model`` (None for ``replicated``, ``torchrec``)."""
    if MODES[mode].schedule is None:
        return None
    from fsembed import get_optimizer
    from pipelines.api.step import wrap_model

    return wrap_model(
        spec.model,
        embeddings=spec.embeddings,
        types=spec.types,
        mode=mode,
        features=spec.features,
        inputs=spec.inputs,
        optimizer=get_optimizer(embeddings.optimizer, lr=embeddings.lr),
        transport=embeddings.transport,
        early_start=embeddings.early_start,
        exclusive_start=embeddings.exclusive_start,
        timer=timer,
        device=device,
    )


def build_step(
    spec: ModelSpec,
    wrap,
    run: JobRunSection,
    embeddings: JobEmbeddingsSection,
    dense_sync: JobDenseSyncSection,
    hooks: StepHooks,
    timer,
    device: torch.device,
    rank: int,
    world_size: int,
):
    """The job's step, chosen once here: the public API's TrainStep around ``spec.model`` (its embedding wrap
    ``wrap``, dense Adam at ``run.lr``), or in mode ``torchrec`` torchrec's own DistributedModelParallel +
    TrainPipelineSparseDist (the outside baseline), which implements the same interface (``lookahead``,
    ``to_device``, ``train_on``, ``optimizer``, ``dense_sync``). ``hooks``: what the job adds around the step."""
    if run.mode == "torchrec-pec":
        return _torchrec_pec_step(spec, run, embeddings, hooks, timer, device)
    if run.mode == "torchrec":
        from pipelines.api.step import count_labels
        from pipelines.models.torchrec_baseline import TorchrecBaseline

        return TorchrecBaseline(
            spec.model,
            optimizer_name=embeddings.optimizer,
            embedding_lr=embeddings.lr,
            lr=run.lr,
            device=device,
            global_labels=lambda batch: count_labels(batch, device, timer),
            phase=hooks.phase,
        )
    # Dense part only (the swapped tables are no parameters). On a GPU, fused: a few kernels per step instead of a
    # foreach chain of ops, each of which would give the GIL away on the training thread (every mode alike, so the
    # comparison is fair).
    optimizer = torch.optim.Adam(spec.model.parameters(), lr=run.lr, fused=device.type == "cuda")
    return TrainStep(
        spec.model,
        spec.loss,
        optimizer,
        wrap=wrap,
        inputs=spec.inputs,
        device=device,
        rank=rank,
        world_size=world_size,
        bucket_mb=dense_sync.bucket_mb,
        precision=run.precision,
        timer=timer,
        hooks=hooks,
    )


def _torchrec_pec_step(
    spec: ModelSpec, run: JobRunSection, embeddings: JobEmbeddingsSection, hooks: StepHooks, timer, device
):
    """Mode ``torchrec-pec``: torchrec's PEC (pipelines.models.torchrec_pec) on the softmax model's item table, or
    on the one EmbeddingCollection of a ``--model`` factory's model."""
    from pipelines.api.step import count_labels
    from pipelines.models.torchrec_baseline import check_device_and_optimizer, require_torchrec
    from pipelines.models.torchrec_pec import TorchrecPEC, softmax_target, user_target

    require_torchrec()
    check_device_and_optimizer(run.mode, device, embeddings.optimizer)
    if isinstance(spec.model, SoftmaxModel) and spec.inputs is None:
        target = softmax_target(spec.model, embeddings.optimizer, embeddings.lr, device)
    else:
        target = user_target(spec, embeddings.optimizer, embeddings.lr)
    return TorchrecPEC(
        target,
        lr=run.lr,
        device=device,
        global_labels=lambda batch: count_labels(batch, device, timer),
        phase=hooks.phase,
    )
