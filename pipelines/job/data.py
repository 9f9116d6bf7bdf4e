"""The job's data as its model reads it: the training and held-out sources, the model built on them, the loader
with the stages the job's mode composes (the balancer's, the ID prefetch, the attention plan), and a batch fetched
from it for the step's lookahead (:func:`fetch`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from fscomm.registry import host_transport
from fsdata.balancer import BalancerConfig, balancer_stages
from fsdata.id_overflow import IdRangeSource
from fsdata.item import LoaderItem
from fsdata.loader import LoaderConfig, build_loader
from fsdata.nodes.attention_plan import AttentionPlanStage
from fsdata.source import SampleSource
from pipelines.api.modes import MODES
from pipelines.api.numerics import check_determinism
from pipelines.api.step import ModelSpec
from pipelines.job.builders import build_model_spec, build_source
from pipelines.job.config import JobConfig
from pipelines.job.config.sections import JobDataSection, JobRunSection
from pipelines.job.memory_probe import measured_budget
from pipelines.models.protocol import SequenceRecommender


class JobData(NamedTuple):
    """The training source (as the model reads it), the model's spec with the model on its device, and the held-out
    source (None without ``--eval-data``)."""

    source: SampleSource
    spec: ModelSpec
    model: torch.nn.Module
    eval_source: Optional[SampleSource]


def build_data_and_model(config: JobConfig, world_size: int, device: torch.device) -> JobData:
    """The training source, the model spec (the softmax model, or a user's --model factory), the held-out source,
    and the model on its device."""
    source = build_source(config.data, config.loader.batch_size * world_size)
    spec = build_model_spec(config, source)
    order_timestamps(source, config.data, spec.model)
    if spec.source is not None:  # a user's model may read features of its own from the source
        source = spec.source(source)
    # a model declaring SequenceRecommender (the presets') names its item table's rows; a user's may not
    num_items = spec.model.num_items if isinstance(spec.model, SequenceRecommender) else None
    if num_items is not None:
        # Ids past the softmax model's item table are an error unless the job or the dataset declares a fold
        # (fsdata.id_overflow).
        source = IdRangeSource(source, num_items, config.data.id_overflow)
    model = spec.model.to(device)
    if config.run.deterministic:
        check_determinism(model, device)
    return JobData(source, spec, model, build_eval_source(config.data, spec, num_items))


def order_timestamps(source: SampleSource, data: JobDataSection, model: torch.nn.Module) -> None:
    """A Parquet source's histories out of time order (or with negative times): refused for a model that reads time
    gaps (its class declares ``reads_time_gaps``), unless --unordered-timestamps sorts or drops them; counted for any
    other. Synthetic histories are in order by construction."""
    if not hasattr(source, "set_timestamp_policy"):
        return
    reads_gaps = getattr(model, "reads_time_gaps", False)
    source.set_timestamp_policy(data.unordered_timestamps or ("error" if reads_gaps else "count"))


def build_eval_source(data: JobDataSection, spec: ModelSpec, num_items: Optional[int]) -> Optional[SampleSource]:
    """The held-out source (``--eval-data``): Parquet at the training data's cap, through the same wrappers as the
    training source (a user's feature reader, the item table's id range); None without one."""
    if data.eval_path is None:
        return None
    from fsdata.parquet import ParquetSource

    source = ParquetSource([Path(data.eval_path)], uih_cap=data.uih_cap, drop_bad_samples=data.drop_bad_samples)
    order_timestamps(source, data, spec.model)
    if spec.source is not None:
        source = spec.source(source)
    if num_items is not None:
        source = IdRangeSource(source, num_items, data.id_overflow)
    return source


def model_max_uih(spec: ModelSpec) -> Optional[int]:
    """The model's UIH cap, where it declares one: the memory budget counts the tokens the model keeps."""
    return getattr(getattr(spec.model, "config", None), "max_uih", None)


def balances(run: JobRunSection, balancer: BalancerConfig) -> bool:
    """Whether the job's loader composes the balancer's stages: a balancing mode with a partitioner."""
    return MODES[run.mode].balances and balancer.partitioner != "none"


def build_balancer_config(
    balancer: BalancerConfig, run: JobRunSection, data: JobData, device: torch.device, rank: int
) -> BalancerConfig:
    """The balancer's section; with ``--memory-budget auto``, its memory model measured on this job's model on its
    device (pipelines.job.memory_probe), unless the flag gives the figures. Built before the wrap swaps the model's
    tables."""
    if not balances(run, balancer):
        return balancer
    args = (data.spec, data.source, device, run.precision, model_max_uih(data.spec))
    balancer, memory = measured_budget(balancer, *args)
    if memory is not None and rank == 0:
        print(
            f"[freescale] --memory-budget auto: {memory.bytes_per_token / 1024:.1f} KiB per kept token + "
            f"{memory.fixed_bytes / 2**30:.2f} GiB, probed on {type(data.spec.model).__name__}"
        )
    return balancer


class LoaderStages(NamedTuple):
    """What the loader's stages are built from: the balancer's section (None: no balancing), the wrap (its ID
    prefetch), the model's attention plan, and the step's feedback and the worker's timer they report to."""

    balancer: Optional[BalancerConfig]
    wrap: Any
    plan: Any
    feedback: Any
    timer: Any
    max_uih: Optional[int]

    @classmethod
    def of(
        cls, run: JobRunSection, balancer: BalancerConfig, wrap: Any, spec: ModelSpec, feedback, timer
    ) -> "LoaderStages":
        """The job's stages' parts: the balancer's (built by :func:`build_balancer_config`) where the job balances."""
        return cls(balancer if balances(run, balancer) else None, wrap, spec.plan, feedback, timer, model_max_uih(spec))


def loader_stages(stages: LoaderStages, rank: int, world_size: int, batch_size: int, device: torch.device) -> list:
    """The balancer's stages (when balancing), then the ID-prefetch stage (sdd, freescale), then the attention plan
    (a model that asks for one, on CUDA)."""
    built = []
    if stages.balancer is not None:  # the loader's batches are on the CPU: the host transport carries them
        built += balancer_stages(
            stages.balancer,
            host_transport("balancer"),
            rank,
            world_size,
            batch_size,
            stages.feedback,
            stages.timer,
            device=device,
            max_uih=stages.max_uih,
        )
    if stages.wrap is not None:
        built += stages.wrap.id_prefetch_stages(rank, stages.timer)
    if stages.plan is not None and device.type == "cuda":
        # The batch's attention plan (block masks) is built a batch ahead with the other stages' host work, and
        # travels to the device with it: the training thread never builds a mask.
        built.append(lambda node: AttentionPlanStage(node, stages.plan))
    return built


def build_job_loader(
    source: SampleSource,
    section: LoaderConfig,
    stages: list,
    rank: int,
    world_size: int,
    position: dict,
    state: Optional[dict],
    device: torch.device,
):
    """The job's loader from its ``[loader]`` section as a trainer runs it (LoaderConfig.for_trainer: on a GPU the
    batches reach the training thread on the device already, or at least pinned; the stage worker starts the batch
    after next as the backward starts), from ``position`` (``{epoch, cursor}``) and, on a resume at the same world
    size, the saved ``state``."""
    loader = build_loader(source, section.for_trainer(device), rank, world_size, stages, start=position, device=device)
    if state is not None:
        loader.load_state_dict(state)
    return loader


@dataclass
class Fetched:
    """A loader item on the device, with where the job stood when it was fetched."""

    item: LoaderItem
    new_epoch: bool
    loader_state: dict  # the loader's state from before this batch was fetched: where a resume restarts


def fetch(loader: Any, to_device: Callable[[LoaderItem], LoaderItem], items: Iterator) -> Fetched:
    """The next item of ``items`` (``loader``'s), its batch and prefetched ids on the device (on a GPU the stage
    worker copied the batch already: fsdata.nodes.device_copy); past the end of an epoch, the next epoch's first."""
    new_epoch = False
    loader_state = loader.state_dict()
    try:
        item = next(items)
    except StopIteration:  # end of an epoch: every rank reaches it at the same step
        item, new_epoch = next(iter(loader)), True
    return Fetched(to_device(item), new_epoch, loader_state)
