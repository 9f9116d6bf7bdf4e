"""The embedding wrap: how FreeScale wraps a user's model without touching its code.

The model takes a batch and returns logits; it looks its item ids up in ``item_embedding`` (or whichever
modules are named). FreeScale installs itself around it:

* module swap (fsembed.swap): the named embedding modules become views of one row-wise sharded collection;
* the step passes each forward's context (fsembed.context.StepContext: this batch's ids, their exchange and the
  next batch's context) to ``with wrap.lookup(context): model(...)``: before the model's first layer runs, the
  mode's embedding schedule (fsembed.schedules: sync, sdd, semisync, prioritized; pipelines.api.modes names which
  mode runs which) picks what of it the collection takes, and the collection's exchanges run. Where the step is
  bound by the host, not by the exchanges, freescale may run sdd's schedule instead (``set_schedule``, chosen from
  measured step times by pipelines.job.run.schedule_probe; exact either way);
* as the forward returns, the lookup lets go of its rows and starts the side work of the next batch's embedding
  exchanges that the forward issued (``early_start="backward"``, the default: freescale's lines 6-7 and 12 then
  run in the collection's bulk chain beside the backward, where the training thread waits without the GIL);
* the loader's balancer stages (fsdata.balancer) already gave this rank a balanced batch; their exchanges are
  started in the loader's ``next()`` between steps and finish one step later (the paper hooks them at the
  optimizer step, forward and backward; here they ride the loader, with the same overlap);
* the backward of the swapped modules runs the gradient AllToAll and the row-wise update (fused optimizer); in
  ``freescale`` it sends the collision rows' gradients first; the collection's collision chain updates those
  rows as soon as they arrive and sends their new values during the dense all-reduce and the optimizer step, and
  the next step's lookup waits only for what is still in flight (the paper: the blocking exchange is waited
  for only in the next iteration's forward).

The loader's ID-prefetch stage (fsembed.id_prefetch) computes every batch's ids, once, builds the batch's context
and starts their ID AllToAll one loader call early; the step (pipelines.api.step.TrainStep) keeps one batch of
lookahead and passes step i's lookup batch i's context with batch i+1's in it (for freescale): section 6.1's one
extra batch. Without a loader stage the step builds the context itself (``context_of``: the features function, or
the KeyedJaggedTensor among the model's arguments, so the user's ``inputs`` runs once per step).

Built through the public ``pipelines.api.step.wrap_model`` (the softmax model too).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from fsdata.batch import Batch
from fsembed.context import StepContext
from fsembed.plan import Features, flat_features
from fsembed.schedules import get_schedule
from fsembed.swap import ForwardRows, swap_embeddings
from pipelines.api.modes import SHARDED, get_mode

# The wrap's defaults (also `freescale train`'s): it calls start_early_rows() as the forward returns, which
# "backward" needs (see PrioritizedEmbeddingCollection for why the collection alone defaults to "forward").
EARLY_START, EXCLUSIVE_START = "backward", "forward"
# batch -> {feature: ids, or the ids of each call of the feature's module this step, in call order}
FeatureFn = Callable[[Batch], Features]
Inputs = Callable[[Batch], Any]  # batch -> the model's positional arguments (a tuple), or its one argument


def as_args(inputs: Optional[Inputs], batch: Batch) -> tuple:
    """The model's positional arguments for ``batch``: ``(batch,)`` without an ``inputs`` function."""
    if inputs is None:
        return (batch,)
    args = inputs(batch)
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def kjt_in(args: tuple, where: str):
    """The KeyedJaggedTensor among the model's arguments."""
    found = [a for a in args if type(a).__name__ == "KeyedJaggedTensor"]
    if not found:
        raise ValueError(
            f"{where}: the model's inputs hold no KeyedJaggedTensor to take the embedding features from; "
            "give features=batch -> {feature: ids}"
        )
    return found[0]


class EmbeddingWrap:
    """What :func:`pipelines.api.step.wrap_model` returns: the one object between the model and its sharded tables.
    It holds the swapped tables (``collection``; the user's modules they replaced: ``swapped``) and the embedding
    schedule that runs their exchanges each step, in :meth:`lookup`, which the step's forward runs inside; the
    swapped modules take their rows from it (:meth:`rows`).

    ``features``: ``batch -> {feature: ids}``; None: the ids of the KeyedJaggedTensor among ``inputs(batch)``."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        features: Optional[FeatureFn],
        table_names: Optional[list[str]] = None,
        *,
        inputs: Optional[Inputs] = None,
        types: Optional[Sequence] = None,
        row_boundaries: Optional[Mapping[str, torch.Tensor]] = None,
        optimizer,
        transport_name: str = "host",
        early_start: str = EARLY_START,
        exclusive_start: str = EXCLUSIVE_START,
        timer=None,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        self.model = model
        self.mode, self.features, self.inputs = get_mode(mode, SHARDED, "EmbeddingWrap mode"), features, inputs
        self.schedule = get_schedule(self.mode.schedule)  # this step's; freescale's may change (set_schedule)
        prioritized = self.schedule.prioritized_collection
        # The rows of the forward running now (lookup), and of the last one, whose id checks queued on a GPU are read
        # at the next lookup or flush (fsembed.swap.ForwardRows).
        self._forward: Optional[ForwardRows] = None
        self._last: Optional[ForwardRows] = None
        self.swapped = swap_embeddings(
            model,
            table_names,
            source=self,
            types=types,
            row_boundaries=row_boundaries,
            schedule=self.schedule.name,
            optimizer=optimizer,
            timer=timer,
            device=device,
            **(
                {"stale": self.schedule.stale, "early_start": early_start, "exclusive_start": exclusive_start}
                if prioritized
                else {}
            ),
            **self._transports(transport_name),
        )
        self.collection = self.swapped.collection

    @staticmethod
    def _transports(name: str) -> dict:
        if name == "host":
            return {}  # the collection's own pair of host transports
        from fsembed.transports import embedding_transports

        return {"transport": embedding_transports(name)}

    def feature_ids(self, batch: Optional[Batch], args: Optional[tuple] = None) -> dict[str, torch.Tensor]:
        """``batch``'s ids per feature, flat: from ``features(batch)``, else from the KeyedJaggedTensor among the
        model's arguments (``args``, or ``inputs(batch)`` where the caller has none)."""
        if self.features is not None:
            return flat_features(self.features(batch))
        from fsembed.swap import kjt_ids

        return kjt_ids(kjt_in(args if args is not None else as_args(self.inputs, batch), "wrap_model"))

    def context_of(self, batch: Batch, args: Optional[tuple] = None) -> StepContext:
        """The context of a batch no loader stage built one for: its ids (:meth:`feature_ids`), and the model's
        arguments where they were read from them (a KeyedJaggedTensor model's; ``args`` where the caller has them)."""
        if self.features is None and args is None:
            args = as_args(self.inputs, batch)
        return StepContext(self.feature_ids(batch, args), None, args)

    @contextlib.contextmanager
    def lookup(self, context: StepContext) -> Iterator[None]:
        """Looks every feature of ``context`` up, once, for the model's forward run inside, whose swapped modules
        take their rows (:meth:`rows`); then lets go of them and starts the next batch's early rows held by the
        forward (``early_start="backward"``: the collection's bulk chain then runs beside the backward).

        Training: the ids as the schedule takes them (their exchange started by the loader where it prefetches
        ids, else the ids, exchanged here) and, for prioritized updates, the next batch's. In evaluation (the model
        in eval mode, or no grad) a plain synchronous lookup of this batch's ids."""
        self.verify()
        training = self.model.training and torch.is_grad_enabled()
        ids, following = context.ids, None
        if training and self.schedule.prefetches_ids:
            ids = context.lookup_ids
        if training and self.prioritized and context.upcoming is not None:
            following = context.upcoming.lookup_ids
        self._forward = ForwardRows(context.ids, self.collection(ids, following))
        try:
            yield
        finally:
            forward, self._forward = self._forward, None
            self._last = forward
        forward.finish()
        if training and self.prioritized:
            self.collection.start_early_rows()

    def rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``feature`` for a swapped module's call with ``ids`` (fsembed.swap.RowSource), from the lookup
        running now."""
        if self._forward is None:
            raise ValueError(
                f"embedding wrap: feature {feature!r} was looked up by no step: call the model inside "
                "wrap.lookup(context) (TrainStep does)"
            )
        return self._forward.take(feature, ids)

    def verify(self) -> None:
        """Raises if the last forward's swapped modules were called with other ids than its lookup took (the
        checks queued on a GPU, read here, when the step has synchronised anyway)."""
        last, self._last = self._last, None
        if last is not None:
            last.verify()

    @property
    def prioritized(self) -> bool:
        """Whether this step runs prioritized updates (semisync; freescale unless its schedule is sdd)."""
        return self.schedule.prioritized_collection

    def set_schedule(self, schedule: str) -> None:
        """freescale's embedding schedule from the next step on, one of its ``switches`` (pipelines.api.modes):
        ``prioritized`` or ``sdd`` (bit-exact either way, see PrioritizedEmbeddingCollection.set_schedule and
        pipelines.job.run.schedule_probe)."""
        if schedule not in self.mode.switches:
            raise ValueError(
                f"the embedding schedule of mode {self.mode.name} is {self.mode.schedule}; it switches "
                f"between {list(self.mode.switches) or 'none'}, not to {schedule!r}"
            )
        self.collection.set_schedule(schedule)
        self.schedule = get_schedule(schedule)

    def id_prefetch_stages(self, rank: int, timer=None) -> list:
        """The loader stages that compute each batch's ids and start their ID AllToAll ahead of its step (sdd,
        semisync and freescale)."""
        if not self.schedule.prefetches_ids:
            return []
        from fscomm.registry import host_transport
        from fsembed.id_prefetch import id_prefetch_stages

        # The loader's batches are on the CPU: their ids travel through the host transport, on a group of the
        # loader's own (the loader's stages issue from the loader's worker thread, fsdata.nodes.background).
        transport = host_transport("id-prefetch")
        features = self.features if self.features is not None else self._derive_in_loader
        return id_prefetch_stages(self.collection.plan, transport, features, rank, timer)

    def _derive_in_loader(self, batch: Batch):
        """The loader's ids of a KeyedJaggedTensor model's batch, read from its arguments (the user's
        ``inputs()``, here once), which travel with them to the step where they can (fsembed.id_prefetch.Derived)."""
        from fsembed.id_prefetch import Derived, carried_args

        args = as_args(self.inputs, batch)
        return Derived(self.feature_ids(batch, args), carried_args(args, batch))

    def loader_stages(self, rank: int, timer=None) -> list:
        """The loader stages this wrap wants (the ID prefetch in sdd / semisync / freescale; none in
        sync), for ``fsdata.loader.build_loader(stages=...)`` after the balancer's: the public name of
        ``id_prefetch_stages``."""
        return self.id_prefetch_stages(rank, timer)

    def flush(self) -> None:
        """Applies deferred updates (before a checkpoint, an evaluation, a reshard and at the end), and reads back
        the last step's id checks (:meth:`verify`)."""
        self.collection.flush()
        self.verify()
