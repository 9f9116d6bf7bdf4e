"""The embedding schedules: how one training step's embedding exchanges run, each one class whose attributes say
what of the step's context its collection takes, which the embedding wrap's lookup (pipelines.api.wrap) hands it
before the model's forward:

    sync         ID AllToAll, lookup and embedding AllToAll, all blocking, inside the step (vanilla TorchRec)
    sdd          the step's ID AllToAll was started during the previous step by the loader's ID-prefetch stage
                 (fsembed.id_prefetch): only the lookup and the embedding AllToAll remain in the step (TorchRec's
                 TrainPipelineSparseDist)
    semisync     every embedding of the next batch prefetched during this step, the rows this step updates
                 included, so they arrive stale (TorchRec's TrainPipelineSemiSync): what staleness costs in NE
    prioritized  Algorithm 2: this step's rows were prefetched during the previous step; only the rows both batches
                 share (collisions) wait; the wrap hands the collection the next batch's ids to prefetch again

The step's context (fsembed.context.StepContext) holds this batch's ids, their exchange started by the loader
(None where none was) and the next batch's context; a schedule that ``prefetches_ids`` takes the exchange, one
whose collection is prioritized also the next batch's. ``sync``,
``sdd`` and ``prioritized`` give the same numbers bit for bit; a PrioritizedEmbeddingCollection switches between
:data:`RUNTIME_SCHEDULES` at any step boundary (``set_schedule``). This module is the one list of the schedules' names.
"""

from __future__ import annotations

from typing import ClassVar


class EmbeddingSchedule:
    """One schedule: its class attributes say what it needs around it and what its collection takes."""

    name: ClassVar[str]
    #: its collection is a PrioritizedEmbeddingCollection (else the synchronous ShardedEmbeddingCollection), which
    #: also takes the next batch's ids, already sent by the ID-prefetch stage (this batch's are used only by a first
    #: step, whose rows nothing prefetched)
    prioritized_collection: ClassVar[bool] = False
    #: it wants the loader's ID-prefetch stage (each batch's ID AllToAll started one step early), and its collection
    #: takes the exchange that stage started (else the ids, exchanged in the step)
    prefetches_ids: ClassVar[bool] = True
    #: its rows of the next batch are looked up before this step's update (semisync)
    stale: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Sync(EmbeddingSchedule):
    name = "sync"
    prefetches_ids = False


class Sdd(EmbeddingSchedule):
    name = "sdd"


class Prioritized(EmbeddingSchedule):
    name = "prioritized"
    prioritized_collection = True


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
