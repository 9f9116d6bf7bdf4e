"""ID prefetch: the loader stage that computes a batch's ids and starts their ID AllToAll (batch-major ->
shard-major) ahead of its step.

The embedding exchanges of step i need the shard-major ids of batch i+1 (Algorithm 2 computes the collisions
between i and i+1 on the shards). This node sends them while batch i+1 waits in the loader, so the step finds
them there, with nothing to wait for but the handle.

It belongs to fsembed (the ids' exchange is the embedding's protocol); the loader runs it as one of the stages it
is given. The node is built with

    plan       the sharding plan (fsembed.plan.ShardingPlan, plain data): it stacks a batch's ids per group of
               tables and says which rank owns which stacked id
    features   batch -> {feature: ids, or the ids of each call of the feature's module, in call order}: the one
               place a batch's ids are computed (the model's, or the KeyedJaggedTensor among its inputs); or
               batch -> ``Derived(features, args)`` where the ids were read from the model's arguments ``args``,
               which then travel with them to the step (the user's ``inputs()`` runs once per batch)
    transport  anything with ``all_to_all(tensor, send_splits, recv_splits) -> Handle`` (fscomm)

and yields the loader item with ``context`` set (fsembed.context.StepContext: the batch's ids per feature, per group
their exchange in flight, and the model's arguments where they were read from them; an attachment in the sense
of fsdata.item: later loader stages complete, pin, move and compare it through its own methods). The step passes
that context on to the embedding wrap's lookup, so nothing computes the ids again. The node is an AsyncStage:
the exchange in flight is not loader state (a resumed node pulls that batch again and restarts its exchange),
and once a batch is yielded its ids belong to the consumer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

import torch

from fsdata.batch import Batch, lengths_to_offsets
from fsdata.item import LoaderItem, as_item
from fsembed.context import StepContext
from fsembed.plan import Features, ShardingPlan, flat_features

try:  # the node needs torchdata; the exchange helpers below do not (they run where torchdata is absent)
    from torchdata.nodes import BaseNode
except ModuleNotFoundError:  # pragma: no cover - exercised only where torchdata is absent
    BaseNode = None

T = TypeVar("T")


@dataclass
class ShardedIds:
    """One key's ID AllToAll in flight, with what both directions of the later exchanges need.

    ``perm``/``send_splits`` describe the batch-major side (this rank's ids grouped by owning shard);
    ``recv_splits`` the shard-major side (how many ids every source rank sends here, in rank order), and
    ``recv_offsets`` their offsets ([W+1] int64), built by the loader's stage and moved with the rest, so the
    embedding exchanges find them on their device (``recv_offsets_on``).
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
    recv_offsets: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def completed(
        cls,
        key: str,
        num_ids: int,
        segments: list[int],
        perm: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        shard_ids: torch.Tensor,
    ) -> "ShardedIds":
        """An exchange whose shard-major ids are already here (a restored checkpoint's step in flight)."""
        return cls(key, num_ids, segments, perm, send_splits, recv_splits, None, _shard_ids=shard_ids)

    def wait(self) -> torch.Tensor:
        """The shard-major ids (blocks until they arrived; later calls return at once)."""
        if self._shard_ids is None:
            self._shard_ids = self.handle.wait()
        return self._shard_ids

    def recv_offsets_on(self, device: torch.device) -> torch.Tensor:
        """The offsets of ``recv_splits`` on ``device``: those the loader's stage brought, or built here once
        (through pinned memory to a GPU: no device sync)."""
        device = torch.device(device)
        if self.recv_offsets is None or self.recv_offsets.device != device:
            host = lengths_to_offsets(self.recv_splits)
            if device.type == "cuda":
                host = host.pin_memory()
            self.recv_offsets = host.to(device, non_blocking=True)
        return self.recv_offsets

    @property
    def wait_time_s(self) -> float:
        return float(getattr(self.handle, "wait_time_s", 0.0))

    def pin_memory(self) -> "ShardedIds":
        """The same exchange with its host-side tensors pinned (so that ``to`` copies them asynchronously)."""
        if self.perm.is_cuda:
            return self
        return replace(
            self,
            perm=self.perm.pin_memory(),
            _shard_ids=None if self._shard_ids is None else self._shard_ids.pin_memory(),
            recv_offsets=None if self.recv_offsets is None else self.recv_offsets.pin_memory(),
        )

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds now (not the result still in flight)."""
        return [t for t in (self.perm, self._shard_ids, self.recv_offsets) if t is not None]

    def to(self, device: torch.device) -> "ShardedIds":
        """The same exchange, its results delivered on ``device`` (the loader exchanges ids on the CPU, off
        the GPU streams, so it never waits behind queued compute; the tables may live on a GPU)."""
        if self.perm.device == torch.device(device):
            return self
        return ShardedIds(
            self.key,
            self.num_ids,
            self.segments,
            self.perm.to(device, non_blocking=True),
            self.send_splits,
            self.recv_splits,
            _OnDevice(self.handle, device),
            self.sizes_wait_s,
            None if self._shard_ids is None else self._shard_ids.to(device, non_blocking=True),
            None if self.recv_offsets is None else self.recv_offsets.to(device, non_blocking=True),
        )


class _OnDevice:
    """A handle whose result is moved to ``device`` when waited for."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner, self.device = inner, device

    def wait(self) -> torch.Tensor:
        # Pinned first: a copy from pageable memory would hold the host until the stream's queued work is done.
        result = self.inner.wait()
        if result.device.type == "cpu" and torch.device(self.device).type == "cuda" and not result.is_pinned():
            result = result.pin_memory()
        return result.to(self.device, non_blocking=True)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    @property
    def wait_time_s(self) -> float:
        return float(getattr(self.inner, "wait_time_s", 0.0))


@dataclass
class Derived:
    """What a ``features`` function returns when it read the ids from the model's arguments: the ids, and the
    arguments (a tuple of tensors and of objects with ``to``, ``pin_memory`` and ``record_stream``, such as a
    KeyedJaggedTensor), which the step then takes instead of computing them again."""

    features: Features
    args: Optional[tuple] = None


def carried_args(args: tuple, batch: Batch) -> Optional[tuple]:
    """``args`` where they can travel with the ids to the step's device (every element a tensor or an object
    with ``to``, ``pin_memory`` and ``record_stream``, and none the batch itself, which travels on its own);
    None otherwise (the step computes them again from its batch)."""
    for a in args:
        if a is batch or not all(hasattr(a, m) for m in ("to", "pin_memory", "record_stream")):
            return None
    return tuple(args)


@dataclass
class PrefetchedIds:
    """One batch's ID AllToAll: per key (group of tables) its exchange in flight. The ids themselves and the
    model's arguments travel beside it in the step's context (fsembed.context.StepContext)."""

    keys: dict[str, ShardedIds]

    def __getitem__(self, key: str) -> ShardedIds:
        if key not in self.keys:
            raise ValueError(f"PrefetchedIds: no key {key!r} (has {sorted(self.keys)})")
        return self.keys[key]

    def to(self, device: torch.device, non_blocking: bool = True) -> "PrefetchedIds":
        """Every key's exchange delivered on ``device`` (always asynchronously from pinned memory)."""
        return PrefetchedIds({k: v.to(device) for k, v in self.keys.items()})

    def equals(self, other: Any) -> bool:
        """The same exchanges' layout (keys, splits, permutations; not the ids still in flight)."""
        return (
            isinstance(other, PrefetchedIds)
            and self.keys.keys() == other.keys.keys()
            and all(
                a.send_splits == b.send_splits
                and a.recv_splits == b.recv_splits
                and torch.equal(a.perm.cpu(), b.perm.cpu())
                for a, b in ((self[k], other[k]) for k in self.keys)
            )
        )

    def wait(self) -> "PrefetchedIds":
        """Completes every key's exchange (blocks); the results stay with it, so ``pin_memory`` and ``to`` move
        them too and a later ``ShardedIds.wait()`` returns at once."""
        for v in self.keys.values():
            v.wait()
        return self

    def pin_memory(self) -> "PrefetchedIds":
        return PrefetchedIds({k: v.pin_memory() for k, v in self.keys.items()})

    def tensors(self) -> list[torch.Tensor]:
        return [t for v in self.keys.values() for t in v.tensors()]


def _dispatch(ids: torch.Tensor, boundaries: torch.Tensor):
    from kernels import ops

    return ops.ranged_dispatch(ids, boundaries)


@dataclass
class SizedIds:
    """One key's ids grouped by owning shard, with the size exchange (how many ids each shard receives) started.

    The size exchange is the one step that must finish before the ids can be posted; ``post()`` waits for it
    and starts the id AllToAll. Issued a step apart, neither wait blocks.
    """

    key: str
    num_ids: int
    segments: list[int]
    perm: torch.Tensor
    send_ids: torch.Tensor
    send_splits: list[int]
    sizes_handle: Any
    transport: Any

    def post(self) -> ShardedIds:
        t0 = time.perf_counter()
        recv = self.sizes_handle.wait()
        sizes_wait = time.perf_counter() - t0
        recv_splits = [int(x) for x in recv.reshape(-1).tolist()]
        handle = self.transport.all_to_all(self.send_ids, self.send_splits, recv_splits)
        return ShardedIds(
            self.key,
            self.num_ids,
            self.segments,
            self.perm,
            self.send_splits,
            recv_splits,
            handle,
            sizes_wait,
            recv_offsets=lengths_to_offsets(recv_splits),
        )


def start_size_exchange(
    key: str, ids: torch.Tensor, segments: list[int], boundaries: torch.Tensor, transport, rank: int
) -> SizedIds:
    """Groups ``ids`` by owning shard and starts the size exchange; returns at once."""
    world_size = boundaries.numel() - 1
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(
            f"ID prefetch, rank {rank}, key {key!r}: ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}"
        )
    if sum(segments) != ids.numel():
        raise ValueError(
            f"ID prefetch, rank {rank}, key {key!r}: segments {segments} do not add up to {ids.numel()} ids"
        )
    send_ids, splits, perm = _dispatch(ids, boundaries.to(ids.device))
    sizes = transport.all_to_all(splits.to(torch.int64).reshape(world_size, 1), [1] * world_size, [1] * world_size)
    return SizedIds(
        key, int(ids.numel()), list(segments), perm, send_ids, [int(x) for x in splits.tolist()], sizes, transport
    )


def start_sizes(
    keyed_ids: Mapping[str, tuple[torch.Tensor, list[int]]],
    boundaries: Mapping[str, torch.Tensor],
    transport,
    rank: int,
) -> dict[str, SizedIds]:
    """Starts the size exchange of every key, in sorted key order (the same collective order on every rank)."""
    missing = set(boundaries) - set(keyed_ids)
    if missing:
        raise ValueError(f"ID prefetch, rank {rank}: the feature extractor gave no ids for keys {sorted(missing)}")
    return {
        k: start_size_exchange(k, keyed_ids[k][0], keyed_ids[k][1], boundaries[k], transport, rank)
        for k in sorted(boundaries)
    }


def start_prefetch(
    keyed_ids: Mapping[str, tuple[torch.Tensor, list[int]]],
    boundaries: Mapping[str, torch.Tensor],
    transport,
    rank: int,
) -> PrefetchedIds:
    """Starts the exchange of every key now (sizes waited for at once), in sorted key order."""
    return PrefetchedIds({k: sized.post() for k, sized in start_sizes(keyed_ids, boundaries, transport, rank).items()})


if BaseNode is not None:
    from fsdata.nodes.async_stage import AsyncStage

    def _check_boundaries(boundaries: Mapping[str, torch.Tensor]) -> dict:
        for k, b in boundaries.items():
            if b.dim() != 1 or b.numel() < 2 or b.dtype != torch.int64 or bool((b[1:] < b[:-1]).any()):
                raise ValueError(f"IdPrefetch: boundaries of key {k!r} must be sorted 1-D int64 [W+1], got {b}")
        return dict(boundaries)

    class IdSizeExchange(AsyncStage):
        """First half of the ID prefetch: computes each batch's ids (``features``, once: they travel on with the
        item), groups them by shard and starts the size exchange.

        Yields the item with its ``context`` begun: the ids and the model's arguments, and per key the size
        exchange in flight (``StepContext.sizes``), started one ``next()`` earlier; :class:`IdPrefetch` posts the
        ids' exchange from it.
        """

        span_name = "id_sizes_wait"

        def __init__(
            self,
            source,
            plan: ShardingPlan,
            transport,
            features: Callable[[Batch], Union[Features, Derived]],
            rank: int = 0,
            timer=None,
        ):
            super().__init__(source, timer)
            self.boundaries = _check_boundaries(plan.group_boundaries)
            self.plan, self.transport, self.features, self.rank = plan, transport, features, rank

        def start(self, item) -> LoaderItem:
            item = as_item(item)
            got = self.features(item.batch)
            derived = got if isinstance(got, Derived) else Derived(got)
            ids = flat_features(derived.features)
            sized = start_sizes(self.plan.stack_ids(ids), self.boundaries, self.transport, self.rank)
            return replace(item, context=StepContext(ids, args=derived.args, sizes=sized))

        def finish(self, started: LoaderItem) -> LoaderItem:
            return started

    class IdPrefetch(AsyncStage):
        """Second half: posts each batch's id AllToAll (its sizes known) one ``next()`` before handing it out.

        Yields the item with ``context`` set (``StepContext``: the ids, their exchange and the model's arguments).
        Chained after
        :class:`IdSizeExchange` (``id_prefetch_stages``), batch k's sizes leave two loader calls and its ids one
        call before batch k is handed out: with the trainer's one batch of lookahead, batch i+1's ids travel
        during step i-1 and are there for step i's forward.
        The ids travel from the CPU (the loader's batches are on the CPU): an exchange of GPU tensors would order
        its copies behind the compute queued on the GPU and stall the loader; the consumer moves the results to
        the tables' device (``StepContext.to``).
        """

        span_name = "id_prefetch_wait"

        def start(self, item: LoaderItem) -> LoaderItem:
            context = item.context if isinstance(item, LoaderItem) else None
            if not isinstance(context, StepContext) or context.sizes is None:
                raise ValueError("IdPrefetch: compose it right after IdSizeExchange (use id_prefetch_stages)")
            exchange = PrefetchedIds({k: s.post() for k, s in context.sizes.items()})
            return replace(item, context=replace(context, exchange=exchange, sizes=None))

        def finish(self, started: LoaderItem) -> LoaderItem:
            return started  # the ids are waited for by the embedding exchanges, where they are needed

    def id_prefetch_stages(
        plan: ShardingPlan, transport, features: Callable[[Batch], Union[Features, Derived]], rank: int = 0, timer=None
    ) -> list:
        """The two loader stages of the ID prefetch, for ``fsdata.loader.build_loader(stages=...)``."""
        return [
            lambda node: IdSizeExchange(node, plan, transport, features, rank, timer),
            lambda node: IdPrefetch(node, timer),
        ]

else:  # pragma: no cover

    def id_prefetch_stages(*args, **kwargs):
        raise ModuleNotFoundError("the ID prefetch stages are torchdata.nodes nodes: install torchdata==0.11.0")
