"""ID prefetch: the loader stage that starts a batch's ID AllToAll (batch-major -> shard-major) ahead of its step.

The embedding stage of step i needs the shard-major ids of batch i+1 (Algorithm 2 computes the collisions
between i and i+1 on the shards). This node sends them while batch i+1 waits in the loader, so the step finds
them there, with nothing to wait for but the handle.

fsdata knows nothing of tables. The node is built with plain data from fsembed's sharding plan:

    boundaries         {key: Tensor[W+1] int64}, sorted: rank r owns ids [b[r], b[r+1]) of that key
                       (a key is an embedding group of tables that travel together)
    feature_extractor  batch -> {key: (ids Tensor[N] int64 batch-major, segments list[int])}; ``segments``
                       is carried along opaquely (fsembed puts the per-feature id counts there)
    transport          anything with ``all_to_all(tensor, send_splits, recv_splits) -> Handle`` (fscomm)

and yields ``(batch, PrefetchedIds)``. The node is an AsyncStage: the exchange in flight is not loader state
(a resumed node pulls that batch again and restarts its exchange), and once a batch is yielded its ids belong to
the consumer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Optional, TypeVar

import torch

try:  # the node needs torchdata; the exchange helpers below do not (the GPU machine has no torchdata)
    from torchdata.nodes import BaseNode
except ModuleNotFoundError:  # pragma: no cover - exercised only where torchdata is absent
    BaseNode = None

T = TypeVar("T")


@dataclass
class ShardedIds:
    """One key's ID AllToAll in flight, with what both directions of the later exchanges need.

    ``perm``/``send_splits`` describe the batch-major side (this rank's ids grouped by owning shard);
    ``recv_splits`` the shard-major side (how many ids every source rank sends here, in rank order).
    """

    key: str
    num_ids: int
    segments: list[int]
    perm: torch.Tensor  # [N] int64, send order -> batch-major position
    send_splits: list[int]  # [W]
    recv_splits: list[int]  # [W]
    handle: Any  # -> shard-major ids [sum(recv_splits)] int64
    sizes_wait_s: float = 0.0  # time blocked on the size exchange (counted as ID exchange time)
    _shard_ids: Optional[torch.Tensor] = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        """The shard-major ids (blocks until they arrived; later calls return at once)."""
        if self._shard_ids is None:
            self._shard_ids = self.handle.wait()
        return self._shard_ids

    @property
    def wait_time_s(self) -> float:
        return float(getattr(self.handle, "wait_time_s", 0.0))

    def to(self, device: torch.device) -> "ShardedIds":
        """The same exchange, its results delivered on ``device`` (the loader exchanges ids on the CPU, off
        the GPU streams, so it never waits behind queued compute; the tables may live on a GPU)."""
        if self.perm.device == torch.device(device):
            return self
        return ShardedIds(
            self.key, self.num_ids, self.segments, self.perm.to(device, non_blocking=True), self.send_splits,
            self.recv_splits, _OnDevice(self.handle, device), self.sizes_wait_s,
            None if self._shard_ids is None else self._shard_ids.to(device, non_blocking=True),
        )


class _OnDevice:
    """A handle whose result is moved to ``device`` when waited for."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner, self.device = inner, device

    def wait(self) -> torch.Tensor:
        return self.inner.wait().to(self.device, non_blocking=True)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    @property
    def wait_time_s(self) -> float:
        return float(getattr(self.inner, "wait_time_s", 0.0))


@dataclass
class PrefetchedIds:
    """Every key's exchange for one batch."""

    keys: dict[str, ShardedIds]

    def __getitem__(self, key: str) -> ShardedIds:
        if key not in self.keys:
            raise ValueError(f"PrefetchedIds: no key {key!r} (has {sorted(self.keys)})")
        return self.keys[key]

    def to(self, device: torch.device) -> "PrefetchedIds":
        return PrefetchedIds({k: v.to(device) for k, v in self.keys.items()})


def _dispatch(ids: torch.Tensor, boundaries: torch.Tensor):
    from kernels import ops

    return ops.ranged_dispatch(ids, boundaries)


def start_id_exchange(
    key: str, ids: torch.Tensor, segments: list[int], boundaries: torch.Tensor, transport, rank: int
) -> ShardedIds:
    """Groups ``ids`` by owning shard and starts their AllToAll; returns at once after the size exchange.

    The size exchange (every rank tells every shard how many ids follow) is the one step that must finish
    before the ids can be posted; it is tiny and, when this runs in the loader, off the training step.
    """
    world_size = boundaries.numel() - 1
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ID prefetch, rank {rank}, key {key!r}: ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}")
    if sum(segments) != ids.numel():
        raise ValueError(f"ID prefetch, rank {rank}, key {key!r}: segments {segments} do not add up to {ids.numel()} ids")
    send_ids, splits, perm = _dispatch(ids, boundaries.to(ids.device))
    t0 = time.perf_counter()
    recv = transport.all_to_all(splits.to(torch.int64).reshape(world_size, 1), [1] * world_size, [1] * world_size).wait()
    sizes_wait = time.perf_counter() - t0
    send_splits = [int(x) for x in splits.tolist()]
    recv_splits = [int(x) for x in recv.reshape(-1).tolist()]
    handle = transport.all_to_all(send_ids, send_splits, recv_splits)
    return ShardedIds(key, int(ids.numel()), list(segments), perm, send_splits, recv_splits, handle, sizes_wait)


def start_prefetch(
    keyed_ids: Mapping[str, tuple[torch.Tensor, list[int]]], boundaries: Mapping[str, torch.Tensor], transport, rank: int
) -> PrefetchedIds:
    """Starts the exchange of every key, in sorted key order (the same collective order on every rank)."""
    missing = set(boundaries) - set(keyed_ids)
    if missing:
        raise ValueError(f"ID prefetch, rank {rank}: the feature extractor gave no ids for keys {sorted(missing)}")
    return PrefetchedIds(
        {k: start_id_exchange(k, keyed_ids[k][0], keyed_ids[k][1], boundaries[k], transport, rank) for k in sorted(boundaries)}
    )


if BaseNode is not None:
    from fsdata.nodes.async_stage import AsyncStage

    class IdPrefetch(AsyncStage):
        """Starts each batch's ID exchange one ``next()`` before handing the batch out.

        Yields ``(*item, PrefetchedIds)`` where ``item`` is what the source yields (a batch, or a tuple whose
        first element is the batch). With the trainer's one batch of lookahead, batch i+1's ids leave when batch
        i+1 is pulled here, during step i-1, and have a whole step to arrive before step i's forward needs them.
        The ids travel from the CPU (the loader's batches are on the CPU): an exchange of GPU tensors would
        order its copies behind the compute already queued on the GPU and stall the loader; the consumer moves
        the results to the tables' device (``PrefetchedIds.to``).
        """

        span_name = "id_prefetch_wait"

        def __init__(
            self,
            source: "BaseNode[T]",
            boundaries: Mapping[str, torch.Tensor],
            transport,
            feature_extractor: Callable[[T], Mapping[str, tuple[torch.Tensor, list[int]]]],
            rank: int = 0,
            timer=None,
        ):
            super().__init__(source, timer)
            for k, b in boundaries.items():
                if b.dim() != 1 or b.numel() < 2 or b.dtype != torch.int64 or bool((b[1:] < b[:-1]).any()):
                    raise ValueError(f"IdPrefetch: boundaries of key {k!r} must be sorted 1-D int64 [W+1], got {b}")
            self.boundaries = dict(boundaries)
            self.transport = transport
            self.feature_extractor = feature_extractor
            self.rank = rank

        def start(self, item) -> tuple:
            parts = item if isinstance(item, tuple) else (item,)
            keyed = self.feature_extractor(parts[0])
            return (*parts, start_prefetch(keyed, self.boundaries, self.transport, self.rank))

        def finish(self, started: tuple) -> tuple:
            return started  # the ids are waited for by the embedding stage, where they are needed

else:  # pragma: no cover

    class IdPrefetch:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ModuleNotFoundError("IdPrefetch is a torchdata.nodes node: install torchdata==0.11.0")
