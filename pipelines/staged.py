"""The staged pipeline: how FreeScale wraps a user's model without touching its code.

The model takes a batch and returns logits; it looks its item ids up in ``item_embedding`` (or whichever
modules are named). FreeScale installs itself around it:

* module swap (fsembed.swap): the named embedding modules become views of one row-wise sharded collection;
* a forward pre-hook on the model drives the embedding stage, before the model's first layer runs:
    - ``sync``       ID AllToAll, lookup, embedding AllToAll, all blocking, inside the step (vanilla TorchRec);
    - ``sdd``        the next batch's ID AllToAll was started during the previous step (TorchRec's
                     TrainPipelineSparseDist): only the lookup and the embedding AllToAll remain in the step;
    - ``freescale``  prioritized updates (Algorithm 2): this step's embeddings were prefetched during the
                     previous step, only rows shared with the previous batch waited; the pre-hook hands the
                     collection the next batch's ids so it can prefetch again;
* the loader's balancer stages (fsdata.balancer) already gave this rank a balanced batch; their exchanges are
  started in the loader's ``next()`` between steps and finish one step later (the paper hooks them at the
  optimizer step, forward and backward; here they ride the data-loading stage, with the same overlap);
* the backward of the swapped modules runs the gradient AllToAll and the row-wise update (fused optimizer).

The trainer keeps one batch of lookahead and sets ``upcoming`` (batch i+1) before step i's forward, which is
what both ``sdd`` and ``freescale`` need: section 6.1's one extra batch in memory.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn

from fsdata.batch import Batch

EMBEDDING_MODES = ("sync", "sdd", "freescale")
FeatureFn = Callable[[Batch], Mapping[str, torch.Tensor]]


class StagedPipeline:
    """Owns the one-batch lookahead and the embedding stage of a model whose tables were swapped."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        features: FeatureFn,
        table_names: list[str],
        *,
        optimizer,
        transport_name: str = "host",
        timer=None,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        from fsembed.swap import swap_embeddings

        if mode not in EMBEDDING_MODES:
            raise ValueError(f"StagedPipeline mode must be one of {EMBEDDING_MODES}, got {mode!r}")
        self.mode, self.features = mode, features
        self.hub = swap_embeddings(
            model,
            table_names,
            mode="prioritized" if mode == "freescale" else "sync",
            optimizer=optimizer,
            timer=timer,
            device=device,
            **self._transports(transport_name),
        )
        self.collection = self.hub.collection
        self.upcoming: Optional[Batch] = None  # batch i+1, set by the trainer before step i's forward
        self._next_ids = None  # sdd: the next batch's ID exchange, started one step early
        self._hook = model.register_forward_pre_hook(self._before_forward)

    @staticmethod
    def _transports(name: str) -> dict:
        if name == "host":
            return {}  # the collection's own pair of host transports
        from fsembed.comm import stage_transports

        forward, backward = stage_transports(name)
        return {"transport": forward, "backward_transport": backward}

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        batch = args[0]
        if not module.training or not torch.is_grad_enabled():  # evaluation: a plain synchronous lookup
            self.hub.prepare(self.features(batch))
            return
        upcoming = self.features(self.upcoming) if self.upcoming is not None else None
        if self.mode == "freescale":
            self.hub.prepare(self.features(batch), upcoming)
        elif self.mode == "sdd":
            current = self._next_ids if self._next_ids is not None else self.features(batch)
            self.hub.prepare(self.features(batch), prefetched=current)
            self._next_ids = self.collection.exchange_ids(upcoming) if upcoming is not None else None
        else:
            self.hub.prepare(self.features(batch))

    def flush(self) -> None:
        """Applies deferred updates (before a checkpoint, an evaluation, a reshard and at the end)."""
        self.collection.flush()
