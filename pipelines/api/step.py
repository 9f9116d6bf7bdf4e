"""The public training API: wrap a user's model, then step it over the loader's items (docs/api.md).

    wrap = wrap_model(model, types=["EmbeddingCollection"], mode="freescale", inputs=inputs,
                      optimizer=RowWiseAdagrad())
    loader = build_loader(source, LoaderConfig(batch_size=B), rank, world_size,
                          stages=balancer_stages(...) + wrap.loader_stages(rank))
    step = TrainStep(model, loss, torch.optim.Adam(model.parameters()), wrap=wrap)
    items = iter(loader)
    while step.has_next(items):
        loss = step.progress(items)

``wrap_model`` swaps the model's embedding modules (by name or by type) for views of one row-wise sharded
collection (fsembed.swap) and returns the embedding wrap (pipelines.api.wrap.EmbeddingWrap): its ``lookup(context)``
runs the embedding exchanges of the mode (sync, sdd, semisync, freescale) before the model's first layer, and its
``loader_stages`` compute every batch's ids into its context (fsembed.context.StepContext) and start their ID
AllToAll in the loader, one batch ahead. ``TrainStep.progress(items)``, in the spirit of torchrec's
``TrainPipeline.progress(iterator)``, keeps the one batch of lookahead that prioritized updates need (batch i+1's
ids go to step i's forward: pipelines.models.step_protocol.Lookahead), runs forward and backward, all-reduces the
dense gradients (pipelines.api.dense_sync) and steps the dense optimizer. TrainStep implements the Step protocol
(pipelines.models.step_protocol), as torchrec's baseline steps do.

Loss semantics. ``loss(outputs, batch)`` returns the SUM of the per-label losses of the local batch; the step
divides it by the global number of labels (every rank's ``batch.candidate_labels.numel()``), so the gradient is
the global mean's however the balancer spread the samples, and sums the gradients over the ranks. The global
count comes with the balancer's report, else from one small all-reduce.

A loop of one's own instead of ``progress`` does per step (see ``TrainStep.train_on``): the forward inside
``with wrap.lookup(item.context.with_upcoming(next_item.context))`` (the item's context, built by the loader's ID
prefetch or by ``step.to_device``, with the next item's), backward of the scaled loss sum, the dense all-reduce,
the optimizer step, and ``wrap.flush()`` before reading tables or checkpointing.
torchrec is imported only where the model uses its types.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from fscomm.registry import host_transport  # noqa: F401  (the public API's name for a loader stage's transport)
from fsdata.batch import Batch
from fsdata.item import LoaderItem, as_item
from fsembed.context import StepContext
from pipelines.api.dense_sync import GLOBAL_FIELDS, PER_RANK_FIELDS, DenseSync, per_rank_of
from pipelines.api.modes import SHARDED, get_mode
from pipelines.api.numerics import autocast, autocast_dtype
from pipelines.api.wrap import EARLY_START, EXCLUSIVE_START, EmbeddingWrap, FeatureFn, Inputs, as_args
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.protocol import SequenceRecommender
from pipelines.models.step_protocol import Lookahead
from pipelines.models.step_result import StepResult

Loss = Callable[[Any, Batch], torch.Tensor]  # (model outputs, batch) -> sum of the local per-label losses


def bce_loss(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The default loss: BCE of per-candidate logits [C_total, T] against ``batch.candidate_labels``, summed
    (pipelines.metrics.binary_cross_entropy_sum, the softmax model's)."""
    return binary_cross_entropy_sum(outputs, batch.candidate_labels)


def call_model(
    model: nn.Module,
    inputs: Optional[Inputs],
    item: LoaderItem,
    args: Optional[tuple] = None,
    context: Optional[StepContext] = None,
) -> Any:
    """The model's forward on the item's batch (``args``: its arguments, where the caller built them already), with
    the loader's attention plan as keyword ``attention_plan`` when the item carries one, and, for a model that
    declares it takes them (pipelines.models.protocol.SequenceRecommender), the context's ids as
    ``embedding_ids``: the forward computes none of them again."""
    kwargs = {} if item.attention_plan is None else {"attention_plan": item.attention_plan}
    if context is not None and isinstance(model, SequenceRecommender):
        kwargs["embedding_ids"] = context.ids
    return model(*(args if args is not None else as_args(inputs, item.batch)), **kwargs)


def wrap_model(
    model: nn.Module,
    *,
    embeddings: Optional[Sequence[str]] = None,
    types: Optional[Sequence[Union[str, type]]] = None,
    mode: str = "freescale",
    features: Optional[FeatureFn] = None,
    inputs: Optional[Inputs] = None,
    optimizer=None,
    row_boundaries: Optional[Mapping[str, torch.Tensor]] = None,
    transport: str = "host",
    device: Union[str, torch.device] = "cpu",
    timer=None,
    early_start: str = EARLY_START,
    exclusive_start: str = EXCLUSIVE_START,
) -> EmbeddingWrap:
    """Swaps ``model``'s embedding modules in place and returns its embedding wrap (:class:`EmbeddingWrap`).

    ``embeddings``: module paths (as in ``named_modules()``), or ``types``: module types or type names
    (``"Embedding"``, ``"EmbeddingCollection"``); default: every module of those two types.
    ``features``: ``batch -> {feature: ids}`` (an ``nn.Embedding``'s feature is its path; an EmbeddingCollection's
    are its tables' feature names; a module called k times per step: a list of the k calls' ids). Default: the
    ids of the KeyedJaggedTensor found in ``inputs(batch)``. ``inputs``: ``batch -> model arguments`` (default:
    the batch). ``optimizer``: the tables' row-wise optimizer (fsembed.optim; default SGD). ``row_boundaries``:
    the sharding plan of tables not split torchrec's row-wise way.
    """
    get_mode(mode, SHARDED, "wrap_model: mode")
    if embeddings is None and types is None:
        from fsembed.swap import SWAPPABLE_TYPES

        types = SWAPPABLE_TYPES
    if features is None:
        if inputs is None:
            raise ValueError(
                "wrap_model: give features=batch -> {feature: ids} (nn.Embedding tables), or "
                "inputs=batch -> model arguments holding a KeyedJaggedTensor (EmbeddingCollection)"
            )
        from fsembed.swap import quiet_torchrec_notes

        quiet_torchrec_notes()
    if optimizer is None:
        from fsembed.optim import SGD

        optimizer = SGD()
    return EmbeddingWrap(
        model,
        mode,
        features,
        list(embeddings) if embeddings is not None else None,
        inputs=inputs,
        types=types,
        row_boundaries=row_boundaries,
        optimizer=optimizer,
        transport_name=transport,
        early_start=early_start,
        exclusive_start=exclusive_start,
        timer=timer,
        device=torch.device(device),
    )


def unwrap_model(
    model: nn.Module,
    wrap: Optional[EmbeddingWrap] = None,
    *,
    dst: Optional[int] = 0,
) -> nn.Module:
    """The inverse of :func:`wrap_model`, after training: puts your own embedding modules back in ``model`` in
    place, with the trained tables, and removes FreeScale's collection, so ``model.state_dict()`` is
    your class's (load it into a fresh instance to serve or evaluate). Returns ``model``.

    Collective: every rank calls it, once, when the wrap is done (``wrap.flush()`` runs first). The tables
    are gathered to rank ``dst`` only, one table at a time; on the other ranks the modules come back on the meta
    device (the same keys, shapes and dtypes, no values: load the saved file to use them). ``dst=None`` gives
    every rank the tables (each holds every whole table then). The wrap trains no more afterwards."""
    from fsembed.swap import unswap_embeddings

    if wrap is None:
        raise ValueError("unwrap_model: give the EmbeddingWrap that wrap_model returned for this model")
    wrap.flush()
    unswap_embeddings(model, wrap.swapped, dst)
    return model


@dataclass
class ModelSpec:
    """What a model factory returns (``freescale train --model module:function`` or ``path/file.py:function``;
    the factory is called with the job's config, pipelines.job.config.JobConfig, on every rank, and must build the same
    initial weights everywhere, e.g. after ``torch.manual_seed(config.run.seed)``).

    Only ``model`` is required; the rest defaults to the softmax model's conventions."""

    model: nn.Module
    #: batch -> the model's arguments (default: the batch itself)
    inputs: Optional[Inputs] = None
    #: (outputs, batch) -> the sum of the local per-label losses (default: BCE against batch.candidate_labels)
    loss: Optional[Loss] = None
    #: the embedding modules to swap, by path ...
    embeddings: Optional[Sequence[str]] = None
    #: ... or by type (default: every nn.Embedding and EmbeddingCollection)
    types: Optional[Sequence[Union[str, type]]] = None
    #: batch -> {feature: ids} (default: the ids of the KeyedJaggedTensor among ``inputs(batch)``)
    features: Optional[FeatureFn] = None
    #: source -> source, e.g. to add the extra features the model reads (default: the job's source as it is)
    source: Optional[Callable[[Any], Any]] = None
    #: (uih_offsets, candidate_offsets) -> an attention plan (host int64 offsets in; e.g. block masks out): run by the
    #: loader's attention-plan stage for a batch ahead when training on CUDA, and handed to the model as its
    #: ``attention_plan`` keyword (the softmax model's ``plan_function()``; default: none)
    plan: Optional[Callable[[Any, Any], Any]] = None


def count_labels(batch: Batch, device: torch.device, timer=None) -> float:
    """The global batch's label count: one small all-reduce over the default group (timed as ``label_count`` by a
    fscomm.timing.Timer, if given)."""
    with timer.span("label_count") if timer is not None else contextlib.nullcontext():
        count = torch.tensor([float(batch.candidate_labels.numel())], device=device)
        dist.all_reduce(count)
    return float(count)


def _unnamed(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


@dataclass
class StepHooks:
    """What a job adds around the one step (pipelines.job.trainer's: its phases in a trace, the early all-reduce,
    per-rank slots, the batch it lets go of); the defaults add nothing."""

    #: a context named around the step's parts ("freescale/forward", ...), e.g. torch.profiler.record_function
    phase: Callable[[str], ContextManager] = _unnamed
    #: called between the forward and the backward (the trainer lets its loader's worker start the batch after next)
    before_backward: Optional[Callable[[], None]] = None
    #: called once the backward is queued, before the compute time is read (the trainer lets the last batch go and,
    #: on a GPU, waits for the compute stream, so that the time is the device's)
    after_backward: Optional[Callable[[], None]] = None
    #: this rank's slot of the dense all-reduce's block for an item, PER_RANK_FIELDS in order (default: zeros)
    per_rank: Optional[Callable[[LoaderItem], tuple[float, ...]]] = None
    #: the block's bucket launched as soon as the backward is queued, within the compute time (else after it)
    early_allreduce: bool = False


class TrainStep:
    """Trains ``model`` one step per ``progress(items)`` call over the loader's items (LoaderItems): the one
    implementation of a training step, which ``freescale train``'s trainer drives too (pipelines.job.trainer adds only
    what a job needs around it, through ``hooks``: timings, per-rank slots; and checkpoints, logs).

    ``wrap``: what ``wrap_model`` returned (None for a model without sharded tables). ``inputs``: ``batch -> model
    arguments`` (default: the wrap's, else the batch). ``loss``: ``(outputs, batch) ->`` the sum of the local
    per-label losses (default :func:`bce_loss`). ``optimizer``: the dense part's, built on ``model.parameters()``
    after ``wrap_model`` (the swapped tables are no parameters: the wrap updates them).
    ``precision``: the forward's and loss's compute, ``auto`` (bf16 autocast on CUDA, fp32 on CPU), ``bf16`` or
    ``fp32`` (pipelines.api.numerics). For a job's accounting: ``timer`` (fscomm.timing.Timer) times the label count's
    all-reduce as ``label_count``, the forward and backward as ``forward_backward`` and the wait for the dense
    all-reduce as ``dense_allreduce``; ``hooks`` (:class:`StepHooks`) are what a job adds around the step.
    """

    #: items it takes beyond the current one (batch i+1's ids go to step i's forward): the trainer's lookahead
    lookahead = 1

    def __init__(
        self,
        model: nn.Module,
        loss: Optional[Loss],
        optimizer: torch.optim.Optimizer,
        *,
        wrap: Optional[EmbeddingWrap] = None,
        inputs: Optional[Inputs] = None,
        device: Union[str, torch.device] = "cpu",
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        bucket_mb: float = 1.0,
        precision: str = "auto",
        timer=None,
        hooks: Optional[StepHooks] = None,
    ) -> None:
        self.model, self.optimizer, self.wrap = model, optimizer, wrap
        self.loss = loss if loss is not None else bce_loss
        self.inputs = inputs if inputs is not None else getattr(wrap, "inputs", None)
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype(precision, self.device)
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.dense_sync = DenseSync(
            [p for p in model.parameters() if p.requires_grad],
            self.rank,
            self.world_size,
            self.device,
            bucket_bytes=int(bucket_mb * 2**20),
        )
        self.timer = timer
        self.hooks = hooks if hooks is not None else StepHooks()
        self._items: Lookahead[LoaderItem] = Lookahead(self._take, self.lookahead)
        self.step = 0

    # ------------------------------------------------------------------ the iterator
    def _take(self, items: Iterator) -> Optional[LoaderItem]:
        try:
            item = as_item(next(items))
        except StopIteration:
            return None
        return self.to_device(item)

    def to_device(self, item: LoaderItem) -> LoaderItem:
        """The item with its batch and its context on the step's device (no-op where they are already). Where no
        loader stage built the context and the model has sharded tables, it is built here, once per batch
        (``wrap.context_of``: its ids, and the model's arguments they were read from)."""
        batch = item.batch if item.batch.device == self.device else item.batch.to(self.device, non_blocking=True)
        if item.context is not None:
            context = item.context.to(self.device)
        else:
            context = self.wrap.context_of(batch) if self.wrap is not None else None
        return LoaderItem(batch, item.report, context, item.attention_plan, item.extras)

    def has_next(self, items: Iterator) -> bool:
        """Whether ``progress(items)`` has a batch to train (takes the first one on the first call)."""
        return self._items.has_next(items)

    def progress(self, items: Iterator) -> StepResult:
        """Trains the next batch of ``items``, taking the one after it as lookahead; raises StopIteration when
        ``items`` is exhausted."""
        current, upcoming = self._items.advance(items)
        result = self.train_on(current, upcoming)
        if not upcoming and self.wrap is not None:
            self.wrap.flush()  # the last step: deferred updates land, the tables are final
        return result

    # ------------------------------------------------------------------ one step
    def count_labels(self, batch: Batch) -> float:
        """The global batch's label count by one small all-reduce (timed as ``label_count``)."""
        return count_labels(batch, self.device, self.timer)

    def global_labels(self, item: LoaderItem) -> float:
        """The global batch's label count: from the balancer's report, else :meth:`count_labels`."""
        if item.report is not None:
            return float(item.report["global_candidates"] * item.batch.num_labels)
        return self.count_labels(item.batch)

    def zero_grad(self) -> None:
        self.dense_sync.zero_grad()

    def forward_backward(
        self, item: LoaderItem, upcoming: Optional[LoaderItem], global_labels: float
    ) -> tuple[float, torch.Tensor]:
        """The forward (the embedding wrap handed this step's context first) and the backward of the local loss
        sum over ``global_labels``. Returns this rank's label count and, on the device (not read here: no device
        sync), its loss sum and positives: the dense all-reduce's payload.

        Runs even for an empty local batch: a sharded table's exchanges must run on every rank."""
        batch, labels = item.batch, item.batch.candidate_labels
        with self.hooks.phase("freescale/forward"):
            context = self.context(item, upcoming)
            # the user's inputs(), once per step: read by the loader's ID prefetch or by to_device where the ids came
            # from them (they travel in the context), else called here
            args = context.args if context is not None and context.args is not None else as_args(self.inputs, batch)
            with autocast(self.autocast_dtype, self.device):
                with self.wrap.lookup(context) if self.wrap is not None else contextlib.nullcontext():
                    outputs = call_model(self.model, self.inputs, item, args, context)
                loss_sum = self.loss(outputs, batch)
        if self.hooks.before_backward is not None:
            self.hooks.before_backward()
        with self.hooks.phase("freescale/backward"):
            (loss_sum / max(global_labels, 1.0)).backward()
        return float(labels.numel()), torch.stack([loss_sum.detach().float().reshape(()), labels.sum().float()])

    def context(self, item: LoaderItem, upcoming: Optional[LoaderItem]) -> Optional[StepContext]:
        """The step's context: the item's (built by the loader's ID prefetch, or by :meth:`to_device`), with the next
        item's in it for prioritized updates (None at the end); None for a model without sharded tables."""
        if self.wrap is None:
            return None
        if item.context is None:  # an item that did not come through to_device
            item = self.to_device(item)
        following = upcoming.context if upcoming is not None and self.wrap.prioritized else None
        if following is None and upcoming is not None and self.wrap.prioritized:
            following = self.to_device(upcoming).context
        return item.context.with_upcoming(following)

    def train_on(self, item: LoaderItem, upcoming: Sequence[LoaderItem] = ()) -> StepResult:
        """One step on ``item``, ``upcoming`` being the items after it (the next one's ids feed prioritized updates;
        none at the end): :meth:`zero_grad`, :meth:`global_labels`, :meth:`forward_backward`, the dense all-reduce, the
        optimizer step. A loop of one's own calls these in this order. The only step there is: the trainer's goes
        through here too, its additions coming in through ``hooks``."""
        hooks = self.hooks
        self.zero_grad()
        total = self.global_labels(item)
        t0 = time.perf_counter()
        with hooks.phase("freescale/forward_backward"):
            labels, device_scalars = self.forward_backward(item, upcoming[0] if upcoming else None, total)
            mine = hooks.per_rank(item) if hooks.per_rank is not None else (0.0,) * len(PER_RANK_FIELDS)
            if hooks.early_allreduce:  # queued behind the backward on the device: runs as soon as it is done
                with hooks.phase("freescale/dense_allreduce"):
                    self.dense_sync.start((labels,), mine, device_scalars)
            if hooks.after_backward is not None:
                hooks.after_backward()
        compute = time.perf_counter() - t0
        t1 = time.perf_counter()
        with hooks.phase("freescale/dense_allreduce"):
            if not hooks.early_allreduce:
                self.dense_sync.start((labels,), mine, device_scalars)
            book = self.dense_sync.finish()
        allreduce = time.perf_counter() - t1
        if self.timer is not None:
            self.timer.add("forward_backward", compute)
            self.timer.add("dense_allreduce", allreduce)
        self.optimizer.step()
        self.step += 1
        # numpy on the host block (no torch op: see pipelines.api.dense_sync)
        count, loss_sum, positives = (float(x) for x in book[: len(GLOBAL_FIELDS)])
        return StepResult(
            loss_sum / count if count > 0 else float("nan"),
            count,
            positives,
            loss_sum=loss_sum,
            local_loss_sum=device_scalars[0],
            compute_s=compute,
            allreduce_s=allreduce,
            per_rank=per_rank_of(book, self.world_size),
        )
