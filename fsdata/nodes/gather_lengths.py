"""Stages I and II of Algorithm 1: gather every rank's sample lengths, so every rank can plan the same partition.

Both are :class:`AsyncStage` nodes: each exchange starts one ``next()`` before its result is needed.

Stage I  — one AllGather of a fixed-size int64 block per rank: a header row (local batch size, the rank's latest
           measured step time, the step it measures, a schema code, a signature of the user's extra features,
           the rank's memory budget in tokens and as a factor of the mean) and one row per sample (UIH length,
           number of candidates, sample id, then the length of each extra jagged field), padded to ``capacity``
           rows. Fixed size, so no size exchange first.
Stage II — one AllGather of the candidates' content lengths, sized per rank from Stage I's candidate counts.

The runtime measurements ride along in Stage I, so the runtime info R that autotune and the online cost model
read is itself gathered: identical on every rank, hence the same plan everywhere. So does each rank's memory
budget: the step's budget is the least the ranks sent (``auto`` measures each rank's own device), the same
number everywhere.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torchdata.nodes import BaseNode

from fscomm.timing import Timer
from fsdata.batch import Batch
from fsdata.item import LoaderItem, as_item
from fsdata.nodes.async_stage import AsyncStage
from fsdata.partition.base import GatheredLengths

# int64 columns per row before the extra jagged fields' lengths: (uih_length, num_candidates, sample_id, -, -, -, -)
# / header (batch size, step time bits, measured step, schema code, extras signature, budget tokens, budget factor
# bits); a budget column is 0 where the rank has none of that kind
_ROW = 7


class StepFeedback:
    """Where the trainer reports each step's measured compute time for the balancer (thread-safe).

    The balancer reads the newest report when it gathers lengths for a batch ahead of the model, so with the
    loader's lookahead the plan of step s sees the measurement of step s-2 or older (RuntimeInfo.measured_step).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest = (-1, 0.0)

    def report(self, step: int, seconds: float) -> None:
        with self._lock:
            self._latest = (int(step), float(seconds))

    def latest(self) -> tuple[int, float]:
        with self._lock:
            return self._latest


@dataclass
class Gathered:
    """A local batch with the whole global step's lengths and runtime measurements (identical on all ranks)."""

    item: LoaderItem
    lengths: GatheredLengths
    measured_steps: torch.Tensor  # int64 [W]: the step each rank's step_time measures (-1: none yet)
    step_times: torch.Tensor  # float64 [W]
    extra_lengths: Optional[torch.Tensor] = None  # int64 [G, K]: each extra jagged field's length (sorted names)
    budget_tokens: int = 0  # the least memory budget the ranks sent, in tokens (0: none in tokens)
    budget_factor: float = 0.0  # the least budget the ranks sent as a factor of the mean (0: none as a factor)

    @property
    def batch(self) -> Batch:
        return self.item.batch


def extra_layout(batch: Batch) -> tuple[list[str], list[tuple]]:
    """The user's extra features in a fixed order: jagged names (sorted), and per dense field (sorted)
    ``(name, dtype, per-sample shape)``. Every rank's batches must agree on it (checked in Stage I)."""
    jagged = sorted(batch.extra_jagged)
    dense = [(k, batch.extra_dense[k].dtype, tuple(batch.extra_dense[k].shape[1:])) for k in sorted(batch.extra_dense)]
    return jagged, dense


def _extras_signature(batch: Batch) -> int:
    jagged, dense = extra_layout(batch)
    jagged_types = [(k, str(batch.extra_jagged[k].values.dtype)) for k in jagged]
    return zlib.crc32(repr((jagged_types, [(k, str(d), s) for k, d, s in dense])).encode())


def _schema_code(batch: Batch) -> int:
    """Packs what every rank's batches must agree on to be exchanged: side features and widths."""
    return (
        int(batch.uih_action_types is not None)
        | int(batch.uih_timestamps is not None) << 1
        | int(batch.dense.shape[1]) << 2
        | int(batch.num_labels) << 32
    )


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


@dataclass
class _StageOne:
    item: LoaderItem
    handle: Any


@dataclass
class _StageOneDone:
    """Stage I unpacked once: every rank's header row and the real sample rows, in source-rank order."""

    item: LoaderItem
    header: torch.Tensor  # [W, 7+K]: local batch size, step time bits, measured step, schema code, extras signature,
    #                       budget tokens, budget factor bits
    rows: torch.Tensor  # [G, 7+K]: uih length, candidates, sample id, 4 unused, extra jagged lengths


@dataclass
class _StageTwo:
    done: _StageOneDone
    handle: Any


class GatherLengths(AsyncStage[LoaderItem, _StageOne, _StageOneDone]):
    """Stage I: AllGather of every rank's per-sample lengths and sample ids, plus its runtime measurement."""

    span_name = "balancer_stage1_wait"

    def __init__(
        self,
        source: BaseNode[LoaderItem],
        transport: Any,
        rank: int,
        world_size: int,
        capacity: int,
        feedback: Optional[StepFeedback] = None,
        timer: Optional[Timer] = None,
        memory_budget: tuple[int, float] = (0, 0.0),
    ) -> None:
        super().__init__(source, timer)
        if capacity < 1:
            raise ValueError(f"GatherLengths: capacity must be >= 1, got {capacity}")
        self.transport, self.rank, self.world_size, self.capacity = transport, rank, world_size, capacity
        self.feedback = feedback
        self.memory_budget = (int(memory_budget[0]), float(memory_budget[1]))  # BudgetSpec.rank_limit()

    def start(self, item: LoaderItem) -> _StageOne:
        item = as_item(item)
        batch = item.batch
        b = batch.batch_size
        if b > self.capacity:
            raise ValueError(
                f"GatherLengths on rank {self.rank}: local batch of {b} samples exceeds the gather capacity "
                f"{self.capacity} (set capacity to the largest local batch the loader can produce)"
            )
        measured_step, seconds = self.feedback.latest() if self.feedback is not None else (-1, 0.0)
        jagged, _ = extra_layout(batch)
        block = torch.zeros(self.capacity + 1, _ROW + len(jagged), dtype=torch.int64)
        budget_tokens, budget_factor = self.memory_budget
        block[0, :_ROW] = torch.tensor(
            [
                b,
                _float_bits(seconds),
                measured_step,
                _schema_code(batch),
                _extras_signature(batch),
                budget_tokens,
                _float_bits(budget_factor),
            ]
        )
        block[1 : b + 1, 0] = batch.uih_lengths
        block[1 : b + 1, 1] = batch.num_candidates
        block[1 : b + 1, 2] = batch.sample_ids
        for k, name in enumerate(jagged):
            block[1 : b + 1, _ROW + k] = batch.extra_jagged[name].lengths
        return _StageOne(item, self.transport.all_gather(block))

    def finish(self, started: _StageOne) -> _StageOneDone:
        world = started.handle.wait()  # [W, capacity+1, 7+K]
        codes = world[:, 0, 3:5]
        mismatched = torch.nonzero((codes != codes[self.rank]).any(1)).flatten().tolist()
        if mismatched:
            raise ValueError(
                f"GatherLengths on rank {self.rank}: ranks {mismatched} send batches of another layout "
                "(side features, dense width, label columns or extra features differ); every rank must read the same "
                "schema"
            )
        kinds = world[:, 0, 5:7] != 0  # which kind of budget each rank has: the same on all, or the plan would differ
        mismatched = torch.nonzero((kinds != kinds[self.rank]).any(1)).flatten().tolist()
        if mismatched:
            raise ValueError(
                f"GatherLengths on rank {self.rank}: ranks {mismatched} set --memory-budget otherwise (a token count,"
                " Nx, auto or none); every rank must be given the same kind of budget"
            )
        counts = world[:, 0, 0]
        rows = world[:, 1:][torch.arange(self.capacity).unsqueeze(0) < counts.unsqueeze(1)]
        return _StageOneDone(started.item, world[:, 0], rows)


class GatherCandidateLengths(AsyncStage[_StageOneDone, _StageTwo, Gathered]):
    """Stage II: AllGather of every candidate's content length, each rank's size known from Stage I."""

    span_name = "balancer_stage2_wait"

    def __init__(self, source: BaseNode[_StageOneDone], transport: Any, world_size: int, timer: Optional[Timer] = None):
        super().__init__(source, timer)
        self.transport, self.world_size = transport, world_size

    def start(self, item: _StageOneDone) -> _StageTwo:
        counts = item.header[:, 0]
        source_rank = torch.repeat_interleave(torch.arange(self.world_size), counts)
        per_rank = torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, source_rank, item.rows[:, 1])
        handle = self.transport.all_gather(item.item.batch.candidate_lengths.to(torch.int64), sizes=per_rank.tolist())
        return _StageTwo(item, handle)

    def finish(self, started: _StageTwo) -> Gathered:
        candidate_lengths = started.handle.wait()
        header, rows = started.done.header, started.done.rows
        rank_offsets = torch.zeros(self.world_size + 1, dtype=torch.int64)
        torch.cumsum(header[:, 0], 0, out=rank_offsets[1:])
        lengths = GatheredLengths(
            uih_lengths=rows[:, 0],
            num_candidates=rows[:, 1],
            candidate_lengths=candidate_lengths,
            sample_ids=rows[:, 2],
            rank_offsets=rank_offsets,
            world_size=self.world_size,
        )
        return Gathered(
            item=started.done.item,
            lengths=lengths,
            measured_steps=header[:, 2].clone(),
            step_times=header[:, 1].clone().view(torch.float64),
            extra_lengths=rows[:, _ROW:].contiguous(),
            budget_tokens=int(header[:, 5].min()),  # min-reduced: the tightest rank's (auto: the fullest device)
            budget_factor=float(header[:, 6].clone().view(torch.float64).min()),
        )
