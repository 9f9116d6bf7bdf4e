"""One step's embedding context: what the training step hands the embedding wrap, in the role of torchrec's
``TrainPipelineContext``.

    EmbeddingContext(ids, exchange, upcoming)
      .ids       this batch's ids per feature (flat, batch-major, every call of a module in call order): computed
                 once, by the loader's ID-prefetch stage (``PrefetchedIds.features``) or, where none ran, by the step
      .exchange  this batch's ID AllToAll, started by the loader (``PrefetchedIds``); None: exchanged in the step
      .upcoming  the next batch's ids for prioritized updates: its exchange, or its ids; None otherwise
      .rows      filled by the lookup: each feature's rows, which the swapped modules hand out
      .taken     per feature, the ids the swapped modules' calls took so far this step

The step builds one per batch; the wrap's forward pre-hook (pipelines.api.wrap) takes it (and lets go of it), the
schedule (fsembed.schedules) picks what of it the collection uses, and the swapped modules (fsembed.swap) read the
ids and rows from it until the forward returns, when the hub lets go of it too. Nothing else keeps a batch's ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from fsembed.id_prefetch import PrefetchedIds
from fsembed.plan import Features, flat_features


@dataclass
class EmbeddingContext:
    ids: dict[str, torch.Tensor]
    exchange: Optional[PrefetchedIds] = None
    upcoming: Optional[Union[PrefetchedIds, dict[str, torch.Tensor]]] = None
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    taken: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        features: Features,
        exchange: Optional[PrefetchedIds] = None,
        upcoming: Optional[Union[PrefetchedIds, Features]] = None,
    ) -> "EmbeddingContext":
        """A context from ids in any of the features' forms (a tensor, or a list of each call's ids)."""
        if upcoming is not None and not isinstance(upcoming, PrefetchedIds):
            upcoming = flat_features(upcoming)
        return cls(flat_features(features), exchange, upcoming)

    @property
    def lookup_ids(self) -> Union[PrefetchedIds, dict[str, torch.Tensor]]:
        """This batch's ids as the collection takes them: the loader's exchange where it started one, else the
        ids (the collection exchanges them in the step)."""
        return self.exchange if self.exchange is not None else self.ids
