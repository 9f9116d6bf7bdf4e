"""The embedding schedules: how one training step's embedding exchanges run, each one class behind one call,
``lookup_args(context)``: what of the step's context the collection takes, which the embedding wrap's lookup
(pipelines.api.wrap) hands it before the model's forward:

    sync         ID AllToAll, lookup and embedding AllToAll, all blocking, inside the step (vanilla TorchRec)
    sdd          the step's ID AllToAll was started during the previous step by the loader's ID-prefetch stage
                 (fsembed.id_prefetch): only the lookup and the embedding AllToAll remain in the step (TorchRec's
                 TrainPipelineSparseDist)
    semisync     every embedding of the next batch prefetched during this step, the rows this step updates
                 included, so they arrive stale (TorchRec's TrainPipelineSemiSync): what staleness costs in NE
    prioritized  Algorithm 2: this step's rows were prefetched during the previous step; only the rows both batches
                 share (collisions) wait; the wrap hands the collection the next batch's ids to prefetch again

``context`` is the step's (fsembed.context.StepContext): this batch's ids, their exchange started by the loader
(None where none was) and the next batch's context; each schedule picks the parts its collection uses. ``sync``,
``sdd`` and ``prioritized`` give the same numbers bit for bit; a PrioritizedEmbeddingCollection switches between
:data:`RUNTIME_SCHEDULES` at any step boundary (``set_schedule``). This module is the one list of the schedules' names.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional


class EmbeddingSchedule:
    """One schedule. Class attributes say what it needs around it; :meth:`lookup_args` picks what its collection
    takes of a step's context."""

    name: ClassVar[str]
    #: its collection is a PrioritizedEmbeddingCollection (else the synchronous ShardedEmbeddingCollection)
    prioritized_collection: ClassVar[bool] = False
    #: it wants the loader's ID-prefetch stage (each batch's ID AllToAll started one step early)
    prefetches_ids: ClassVar[bool] = True
    #: its rows of the next batch are looked up before this step's update (semisync)
    stale: ClassVar[bool] = False

    def lookup_args(self, context: Any) -> tuple[Any, Optional[Any]]:
        """(this batch's ids as the collection takes them, the next batch's or None)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Sync(EmbeddingSchedule):
    name = "sync"
    prefetches_ids = False

    def lookup_args(self, context):
        return context.ids, None


class Sdd(EmbeddingSchedule):
    name = "sdd"

    def lookup_args(self, context):
        return context.lookup_ids, None


class Prioritized(EmbeddingSchedule):
    name = "prioritized"
    prioritized_collection = True

    def lookup_args(self, context):
        # the next batch's ids, already sent by the ID-prefetch stage (this batch's: used only by a first step,
        # whose rows nothing prefetched)
        return context.lookup_ids, None if context.upcoming is None else context.upcoming.lookup_ids


class SemiSync(Prioritized):
    name = "semisync"
    stale = True


SCHEDULES: dict[str, type[EmbeddingSchedule]] = {cls.name: cls for cls in (Sync, Sdd, SemiSync, Prioritized)}
#: What a PrioritizedEmbeddingCollection switches between at run time, exactly either way.
RUNTIME_SCHEDULES = (Prioritized.name, Sdd.name)


def get_schedule(name: str) -> EmbeddingSchedule:
    """The schedule named ``name`` (one of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"embedding schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]()
