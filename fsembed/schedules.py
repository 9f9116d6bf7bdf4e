"""The embedding schedules: how one training step's embedding exchanges run, each one class behind one call,
``prepare(hub, context)``, which the embedding wrap (pipelines.api.wrap) makes before the model's forward:

    sync         ID AllToAll, lookup and embedding AllToAll, all blocking, inside the step (vanilla TorchRec)
    sdd          the step's ID AllToAll was started during the previous step by the loader's ID-prefetch stage
                 (fsembed.id_prefetch): only the lookup and the embedding AllToAll remain in the step (TorchRec's
                 TrainPipelineSparseDist)
    semisync     every embedding of the next batch prefetched during this step, the rows this step updates
                 included, so they arrive stale (TorchRec's TrainPipelineSemiSync): what staleness costs in NE
    prioritized  Algorithm 2: this step's rows were prefetched during the previous step; only the rows both batches
                 share (collisions) wait; the wrap hands the collection the next batch's ids to prefetch again

``context`` is the step's (fsembed.context.EmbeddingContext): this batch's ids, their exchange started by the loader
(None where none was) and the next batch's ids; each schedule hands the collection the parts it uses. ``sync``,
``sdd`` and ``prioritized`` give the same numbers bit for bit; a PrioritizedEmbeddingCollection switches between
:data:`RUNTIME_SCHEDULES` at any step boundary (``set_schedule``). This module is the one list of the schedules' names.
"""

from __future__ import annotations

from typing import Any, ClassVar


class EmbeddingSchedule:
    """One schedule. Class attributes say what it needs around it; :meth:`prepare` runs its step."""

    name: ClassVar[str]
    #: its collection is a PrioritizedEmbeddingCollection (else the synchronous ShardedEmbeddingCollection)
    prioritized_collection: ClassVar[bool] = False
    #: it wants the loader's ID-prefetch stage (each batch's ID AllToAll started one step early)
    prefetches_ids: ClassVar[bool] = True
    #: its rows of the next batch are looked up before this step's update (semisync)
    stale: ClassVar[bool] = False

    def prepare(self, hub: Any, context: Any) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Sync(EmbeddingSchedule):
    name = "sync"
    prefetches_ids = False

    def prepare(self, hub, context) -> None:
        hub.prepare(context, context.ids)


class Sdd(EmbeddingSchedule):
    name = "sdd"

    def prepare(self, hub, context) -> None:
        hub.prepare(context, context.lookup_ids)


class Prioritized(EmbeddingSchedule):
    name = "prioritized"
    prioritized_collection = True

    def prepare(self, hub, context) -> None:
        # the next batch's ids, already sent by the ID-prefetch stage (this batch's: used only by a first step,
        # whose rows nothing prefetched)
        hub.prepare(context, context.lookup_ids, context.upcoming)


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
