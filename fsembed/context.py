"""One step's context: a batch's ids, computed once, and what travels with them, in the role of torchrec's
``TrainPipelineContext``.

    StepContext(ids, exchange, args, upcoming, sizes)  frozen: nothing writes into it once built
      .ids       this batch's ids per feature (flat, batch-major, every call of a module in call order)
      .exchange  their ID AllToAll, started by the loader (fsembed.id_prefetch.PrefetchedIds); None: exchanged in
                 the step
      .args      the model's arguments the ids were read from (a KeyedJaggedTensor model's), None: the step builds
                 them (the user's ``inputs()`` runs once per step either way)
      .upcoming  the next batch's context, for prioritized updates; None otherwise
      .sizes     between the ID prefetch's two loader stages only: per key, the ids' size exchange in flight
                 (fsembed.id_prefetch.SizedIds), from which the second stage posts ``exchange``; None after

The loader's ID-prefetch stage builds it (fsembed.id_prefetch), or the step where no such stage ran; it rides the
loader item (``LoaderItem.context``: the later stages complete, pin, move and compare it through the methods
below), the step adds the next batch's (``with_upcoming``) and passes it, as an argument, to the embedding wrap's
lookup (pipelines.api.wrap.EmbeddingWrap.lookup), which hands the collection what its schedule takes
(fsembed.schedules).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch

if TYPE_CHECKING:
    from fsembed.id_prefetch import PrefetchedIds, SizedIds


@dataclass(frozen=True)
class StepContext:
    ids: Mapping[str, torch.Tensor]
    exchange: Optional["PrefetchedIds"] = None
    args: Optional[tuple] = None
    upcoming: Optional["StepContext"] = None
    sizes: Optional[Mapping[str, "SizedIds"]] = None

    @property
    def lookup_ids(self) -> Union["PrefetchedIds", Mapping[str, torch.Tensor]]:
        """This batch's ids as the collection takes them: the loader's exchange where it started one, else the
        ids (the collection exchanges them in the step)."""
        return self.exchange if self.exchange is not None else self.ids

    def with_upcoming(self, upcoming: Optional["StepContext"]) -> "StepContext":
        """This context with the next batch's (its own next batch's left out: one batch of lookahead)."""
        return replace(self, upcoming=None if upcoming is None else replace(upcoming, upcoming=None))

    # ------------------------------------------------------------------ as a loader item's attachment (fsdata.item)
    def to(self, device: torch.device, non_blocking: bool = True) -> "StepContext":
        """The ids, their exchange and the arguments delivered on ``device`` (asynchronously from pinned memory)."""
        return StepContext(
            {f: ids.to(device, non_blocking=True) for f, ids in self.ids.items()},
            None if self.exchange is None else self.exchange.to(device),
            None if self.args is None else tuple(a.to(device, non_blocking=True) for a in self.args),
        )

    def pin_memory(self) -> "StepContext":
        return StepContext(
            {f: ids if ids.is_cuda else ids.pin_memory() for f, ids in self.ids.items()},
            None if self.exchange is None else self.exchange.pin_memory(),
            None if self.args is None else tuple(_pinned(a) for a in self.args),
        )

    def wait(self) -> "StepContext":
        """Completes the exchange (blocks); its results stay with it, so ``pin_memory`` and ``to`` move them."""
        if self.exchange is not None:
            self.exchange.wait()
        return self

    def record_stream(self, stream) -> None:
        for t in self.tensors():
            t.record_stream(stream)
        for a in self.args or ():
            if not isinstance(a, torch.Tensor):  # a KeyedJaggedTensor records its own tensors
                a.record_stream(stream)

    def tensors(self) -> list[torch.Tensor]:
        own = list(self.ids.values()) + (self.exchange.tensors() if self.exchange is not None else [])
        return own + [a for a in self.args or () if isinstance(a, torch.Tensor)]

    def equals(self, other: Any) -> bool:
        """The same ids and exchange layout (not the ids still in flight): what a resumed loader must reproduce."""
        if not isinstance(other, StepContext) or self.ids.keys() != other.ids.keys():
            return False
        if not all(torch.equal(self.ids[f].cpu(), other.ids[f].cpu()) for f in self.ids):
            return False
        if self.exchange is None or other.exchange is None:
            return self.exchange is other.exchange
        return self.exchange.equals(other.exchange)


def _pinned(a: Any) -> Any:
    return a if getattr(a, "is_cuda", False) else a.pin_memory()
