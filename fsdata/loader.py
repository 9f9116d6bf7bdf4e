"""Loader composition: source -> batch (GlobalBatchReader) -> prefetch -> [stages] -> pin memory / device copy.

Every item the loader yields is one ``fsdata.item.LoaderItem`` whatever stages are composed: the batch, and what
the stages attached (the balancer's ``report``, the ID prefetch's ``context``, ...), ``None`` where absent.

Each stage is a torchdata.nodes BaseNode wrapping the one before it, so the chain checkpoints through the one
``Loader.state_dict()`` (the StatefulDataLoader protocol: ``state_dict()`` / ``load_state_dict()``).
The prefetcher reads local batches ``prefetch_depth`` ahead in a thread (file I/O, generation: no
collectives). The balancer's stages (gather lengths, partition, shuffle samples; fsdata.balancer) come after it,
passed in ``stages`` as callables ``node -> node`` applied in order. They run in the consumer's thread and
overlap their exchanges with compute by starting each one a step before it is needed (fsdata.nodes.async_stage),
on the balancer's own process group, never on the dense all-reduce's. With ``background_stages`` (default) their
CPU work runs one batch ahead in a demand-driven worker thread (fsdata.nodes.background), off the training thread.
Given a CUDA ``device``, that worker also pins each batch and copies it to the device on a stream of its own
(fsdata.nodes.device_copy); without the worker, ``pin_memory`` pins batches in torchdata's pinning thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Dict, Optional, Sequence

import torch
from torchdata.nodes import BaseNode, Loader, PinMemory, Prefetcher

from fsdata.item import LoaderItem, as_item
from fsdata.nodes.background import Background
from fsdata.nodes.device_copy import DeviceCopy
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.source import SampleSource

Stage = Callable[[BaseNode[LoaderItem]], BaseNode[LoaderItem]]


class AsItems(BaseNode[LoaderItem]):
    """Wraps each batch of its source in a LoaderItem. Keeps no state and hands its source's state through
    unchanged (not nested under a key), so a loader state saved before this node existed still loads."""

    def __init__(self, source: BaseNode) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> LoaderItem:
        return as_item(next(self.source))

    def get_state(self) -> Dict[str, Any]:
        return self.source.state_dict()


# When the stage worker starts the batch after next ('take': as soon as the consumer takes a batch; 'backward': when
# the consumer calls release_loader).
WORKER_STARTS = ("take", "backward")


@dataclass
class LoaderConfig:
    """The loader's config (``build_loader``), and the ``[loader]`` table of `freescale train`'s config: the fields
    past ``prefetch_depth`` are tuning knobs (docs/tuning.md)."""

    CHOICES: ClassVar[dict] = {"worker_start": WORKER_STARTS}

    batch_size: int = 16
    """Samples per rank per step: the local batch B."""
    prefetch_depth: int = 2
    """Local batches read ahead of the model, in a thread (file I/O, generation: no collectives)."""
    pin_memory: bool = False
    """Pin the host memory of batches (the trainer forces it on when it trains on CUDA)."""
    background_stages: bool = True
    """Run the stages (balancer, ID prefetch) one batch ahead in a worker thread."""
    worker_start: Optional[str] = None
    """When the stage worker starts the batch after next, one of ``WORKER_STARTS``: 'take' as soon as the consumer
    takes a batch, 'backward' when the consumer calls release_loader (the trainer does so as its backward starts,
    so the forward runs without the worker beside it; a consumer that never calls it gets each batch computed when
    it asks). None: 'backward' under the trainer, 'take' for a loader used on its own; with pin_memory on a CPU run
    always 'take'."""
    stage_lookahead: bool = True
    """Start each stage's exchange one batch early, even under the worker thread. Off: each stage finishes its
    exchange in the call that starts it (fewer batches in flight)."""

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.worker_start not in (None, *WORKER_STARTS):
            raise ValueError(f"worker_start must be one of {', '.join(WORKER_STARTS)}, got {self.worker_start!r}")

    def for_trainer(self, device: Any) -> "LoaderConfig":
        """This config as a trainer that calls ``release_loader`` as its backward starts runs it on ``device``: the
        worker starts the batch after next there unless ``worker_start`` says otherwise, and on CUDA the batches
        are pinned (their copies to the device then queue without waiting)."""
        cuda = device is not None and torch.device(device).type == "cuda"
        return replace(self, pin_memory=self.pin_memory or cuda, worker_start=self.worker_start or "backward")


def build_loader(
    source: SampleSource,
    config: LoaderConfig,
    rank: int,
    world_size: int,
    stages: Sequence[Stage] = (),
    start: Optional[dict] = None,
    device: Optional[torch.device] = None,
) -> Loader:
    """A loader yielding ``LoaderItem``s. ``start``: the reader's ``{epoch, cursor}`` to begin from (see
    GlobalBatchReader). ``device``: where the
    batches are trained; a CUDA device makes the stage worker copy them there, ordered before the work that the
    building thread's current stream queues after it takes an item (fsdata.nodes.device_copy)."""
    config.validate()
    node: BaseNode = AsItems(GlobalBatchReader(source, config.batch_size, rank, world_size, start))
    if config.prefetch_depth > 0:
        node = Prefetcher(node, prefetch_factor=config.prefetch_depth)
    for add_stage in stages:
        node = add_stage(node)
    copied = False
    if stages and config.background_stages:
        if not config.stage_lookahead:
            _disable_lookahead(node)
        if device is not None and torch.device(device).type == "cuda":
            node, copied = DeviceCopy(node, device), True
        # Gated only when the consumer itself takes the items: torchdata's PinMemory (below) takes them from a
        # thread of its own, which would start each owed item at once (no gate) and race the consumer's release.
        pinned_above = config.pin_memory and not copied
        node = Background(node, gated=config.worker_start == "backward" and not pinned_above)
    if config.pin_memory and not copied:
        node = PinMemory(node)
    return Loader(node)


def _disable_lookahead(node: BaseNode) -> None:
    """``stage_lookahead = false``: each stage finishes its exchange in the call that starts it, so only the
    worker's batch (and the trainer's next one) are in flight; the worker then waits inside each item for the
    other ranks' workers to reach the same exchange (the A/B of both settings is in BENCHMARKS.md)."""
    from fsdata.nodes.async_stage import AsyncStage

    while node is not None:
        if isinstance(node, AsyncStage):
            node.lookahead = False
        node = getattr(node, "source", None)


def _workers(loader: Loader) -> list[Background]:
    out, node = [], loader.root
    while node is not None:
        if isinstance(node, Background):
            out.append(node)
        node = getattr(node, "source", None)
    return out


def release_loader(loader: Loader) -> None:
    """Lets a gated stage worker (``worker_start = "backward"``) start the next batch; the trainer calls it as its
    backward starts, from the thread that takes the batches. Without a gated worker it does nothing."""
    for worker in _workers(loader):
        worker.release()


def loader_blocked_s(loader: Loader) -> float:
    """How long the thread that takes the batches has waited for the stage worker to finish them, in all (0 without
    a stage worker): the part of the loader's time on the critical path that is the worker's being late."""
    return sum(worker.blocked_s for worker in _workers(loader))


def shutdown_loader(loader: Loader, abandon: bool = False) -> None:
    """Lets the loader's stage worker finish its item in flight (every rank alike) and stop, then ends the read-ahead
    threads of torchdata's nodes (Prefetcher): call it once the loader is done, before destroying the process groups.
    ``abandon``: the process ends on a failure: the item in flight is not waited for (``Background.shutdown``).

    The read-ahead threads are daemon threads, often inside a torch op that has released the GIL: left running
    at interpreter exit, such a thread is ended by the interpreter in the middle of C++ code, which can abort the
    process ("terminate called without an active exception") after an otherwise clean run."""
    for worker in _workers(loader):
        worker.shutdown(abandon)
    node = loader.root
    while node is not None:
        # torchdata has no public way to end a node's thread short of reset(), which starts a new one
        inner = getattr(node, "_it", None)
        if inner is not None and hasattr(inner, "_shutdown"):
            inner._shutdown()
        node = getattr(node, "source", None)
