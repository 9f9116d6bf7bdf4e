"""The step's dense all-reduce: gradients in flat buckets, summed as the backward produces them (DDP's way), with a
bookkeeping block in the last bucket.

Every dense parameter's ``.grad`` is a view of one bucket (DDP's ``gradient_as_bucket_view``): the backward
accumulates into it in place, so a bucket is all-reduced as it is, with no gather before and no copy back after,
and zeroing is one fill per bucket. Parameters go into buckets in reverse order, since the backward produces the
last layers' gradients first, and a bucket closes at ``bucket_bytes``. As soon as every gradient of a bucket has
been accumulated (``register_post_accumulate_grad_hook``) its all-reduce starts, while the backward goes on. Buckets
start strictly in index order on every rank (a ready bucket waits for the ones before it), so the collectives
pair up across ranks even when a rank's batch leaves some parameters without a gradient; those buckets start
after the backward, in the same order. The hooks issue from autograd's thread while the training thread waits in
``backward()``, and the training thread issues the last bucket after it returns: the two threads never issue on
the group at the same time.

The last bucket (the first parameters) ends with the bookkeeping block: one row per rank, written only by its rank,
of the global scalars (label count, BCE sum, positives) and ``PER_RANK_FIELDS``, so every rank learns every rank's
timings from the same all-reduce. The all-reduce of rows that only one rank writes is exact in any order; the
global scalars are then summed over the rows in rank order on the host, so the reported sums have the same bits
however the ranks are split over hosts (a float sum all-reduced by the backend depends on its algorithm's order,
which follows the layout). It starts once the block is written (``start``) and is waited
for apart (``finish``), so the trainer may launch it as soon as the backward is queued, before the device has
finished it; the per-rank timings it carries are therefore the previous step's (``last_compute_s``,
``last_step_s``), known by then. The block travels as float32 (exact for counts below 2^24 per step) and on a GPU
comes back through pinned memory with its own event, not a pageable ``.cpu()``, which would hold up the host
transport's copies. It is handed back as a numpy array: the trainer's bookkeeping on it then dispatches no torch
op, each of which would let the stage worker or an embedding chain take the GIL from the training thread.

``bucket_bytes=0`` puts every parameter of a dtype in one bucket: one all-reduce after the backward.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Optional

import numpy as np
import torch
import torch.distributed as dist

GLOBAL_FIELDS = ("labels", "loss_sum", "positives")
PER_RANK_FIELDS = ("last_compute_s", "tokens", "samples", "sparsity", "last_step_s")  # last_*: of the previous step


class _Bucket:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params: list[torch.nn.Parameter] = []
        self.numel = 0
        self.buffer: Optional[torch.Tensor] = None
        self.views: list[torch.Tensor] = []


class DenseSync:
    """``all_reduce(scalars, mine, device_scalars)``: sums the gradients of ``params`` and the bookkeeping block
    over the ranks; returns the block on the host (a float64 numpy array): GLOBAL_FIELDS summed in rank order, then
    world_size x PER_RANK_FIELDS."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        rank: int,
        world_size: int,
        device: torch.device,
        bucket_bytes: int = 0,
    ):
        if bucket_bytes < 0:
            raise ValueError(f"DenseSync: bucket_bytes must be >= 0, got {bucket_bytes}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.book_size = world_size * _ROW
        cap = bucket_bytes or math.inf
        self.buckets: list[_Bucket] = []
        for p in reversed([p for p in params if p.requires_grad]):
            last = self.buckets[-1] if self.buckets else None
            if (
                last is None
                or last.dtype != p.dtype
                or (last.numel and (last.numel + p.numel()) * p.element_size() > cap)
            ):
                last = _Bucket(p.dtype)
                self.buckets.append(last)
            last.params.append(p)
            last.numel += p.numel()
        if not self.buckets or self.buckets[-1].dtype != torch.float32:
            self.buckets.append(_Bucket(torch.float32))
        for i, bucket in enumerate(self.buckets):
            extra = self.book_size if i == len(self.buckets) - 1 else 0
            bucket.buffer = torch.zeros(bucket.numel + extra, dtype=bucket.dtype, device=self.device)
            offset = 0
            for p in bucket.params:
                view = bucket.buffer[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                bucket.views.append(view)
        self.book = self.buckets[-1].buffer[self.buckets[-1].numel :]
        # Overlap: every bucket but the last starts from the hooks of its parameters.
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets[:-1]) for p in b.params}
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._works: list = []
        self._next = 0
        for b in self.buckets[:-1]:
            for p, view in zip(b.params, b.views):
                p.register_post_accumulate_grad_hook(self._hook(view))
        cuda = self.device.type == "cuda"
        self._up = torch.zeros(self.book_size, dtype=torch.float32, pin_memory=cuda)
        self._up_host = self._up.numpy()  # written with numpy: no torch op (each would release the GIL and queue)
        self._down = torch.zeros(self.book_size, dtype=torch.float32, pin_memory=cuda) if cuda else None
        self._down_host = self._down.numpy() if cuda else None
        self._done: Optional[torch.cuda.Event] = torch.cuda.Event() if cuda else None
        self._reset_pending()

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def _reset_pending(self) -> None:
        self._pending = [len(b.params) for b in self.buckets]
        self._works, self._next = [], 0

    def _hook(self, view: torch.Tensor):
        def accumulated(p: torch.nn.Parameter) -> None:
            if p.grad is not view:  # replaced rather than accumulated into (e.g. a non-contiguous layout)
                view.copy_(p.grad)
                p.grad = view
            with self._lock:
                self._pending[self._bucket_of[id(p)]] -= 1
                self._start_ready()

        return accumulated

    def _start_ready(self, upto: Optional[int] = None) -> None:
        """Starts, in index order, the buckets whose gradients are all in (every bucket below ``upto``)."""
        while self._next < len(self.buckets) and (
            (upto is not None and self._next < upto)
            or (self._next < len(self.buckets) - 1 and self._pending[self._next] == 0)
        ):
            self._works.append(dist.all_reduce(self.buckets[self._next].buffer, async_op=True))
            self._next += 1

    def zero_grad(self) -> None:
        """Every gradient (and the block) to zero; also those this rank's batch does not reach (an empty local
        batch): the buckets have the same layout on every rank."""
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not view:  # replaced by someone (set_to_none): point it back
                    p.grad = view
            b.buffer.zero_()
        with self._lock:
            self._reset_pending()

    def all_reduce(
        self, scalars: tuple[float, ...], mine: tuple[float, ...], device_scalars: Optional[torch.Tensor] = None
    ) -> np.ndarray:
        """``start`` then ``finish``."""
        self.start(scalars, mine, device_scalars)
        return self.finish()

    def start(
        self, scalars: tuple[float, ...], mine: tuple[float, ...], device_scalars: Optional[torch.Tensor] = None
    ) -> None:
        """Launches the all-reduces not started yet, the block's bucket last, without waiting for anything: on a
        GPU they wait for the backward's kernels on the device (stream order), so this may run as soon as the
        backward is queued, as DDP's last bucket does. ``scalars`` and then ``device_scalars`` (a tensor on the
        device, e.g. the loss: never read on the host before the all-reduce, so reading it costs no device sync)
        are the GLOBAL_FIELDS; ``mine`` this rank's PER_RANK_FIELDS."""
        n_device = 0 if device_scalars is None else device_scalars.numel()
        if len(scalars) + n_device != len(GLOBAL_FIELDS) or len(mine) != len(PER_RANK_FIELDS):
            raise ValueError(
                f"DenseSync.all_reduce: expected {len(GLOBAL_FIELDS)} global fields {GLOBAL_FIELDS} and "
                f"{len(PER_RANK_FIELDS)} per-rank fields {PER_RANK_FIELDS}, got {len(scalars)} + {n_device} "
                f"and {len(mine)}"
            )
        for p, view in zip(self.buckets[-1].params, self.buckets[-1].views):
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
        up = self._up_host  # the pinned block's previous copy is done: the last all_reduce waited for the block
        up.fill(0.0)
        row = self.rank * _ROW
        up[row : row + len(scalars)] = scalars
        up[row + len(GLOBAL_FIELDS) : row + _ROW] = mine
        self.book.copy_(self._up, non_blocking=True)
        if n_device:
            self.book[row + len(scalars) : row + len(GLOBAL_FIELDS)].copy_(device_scalars.reshape(-1))
        with self._lock:
            self._start_ready(upto=len(self.buckets))  # the rest, the block's bucket last

    def finish(self) -> np.ndarray:
        """Waits for every bucket (the gradients are summed when it returns) and returns the block on the host."""
        with self._lock:
            works = self._works
        for work in works:
            work.wait()
        if self._done is None:
            return _summed(self.book.numpy(), self.world_size)
        self._down.copy_(self.book, non_blocking=True)
        self._done.record()
        self._done.synchronize()
        return _summed(self._down_host, self.world_size)


_ROW = len(GLOBAL_FIELDS) + len(PER_RANK_FIELDS)  # a rank's row of the block as it travels


def _summed(rows: np.ndarray, world_size: int) -> np.ndarray:
    """The travelled block (a row per rank) as handed back: GLOBAL_FIELDS summed over the ranks in rank order, then
    every rank's PER_RANK_FIELDS."""
    rows = rows.astype(np.float64).reshape(world_size, _ROW)
    total = rows[0, : len(GLOBAL_FIELDS)].copy()
    for row in rows[1:]:  # one rank after the other: the same bits for every layout of the ranks
        total += row[: len(GLOBAL_FIELDS)]
    return np.concatenate([total, rows[:, len(GLOBAL_FIELDS) :].reshape(-1)])


def per_rank_of(book: np.ndarray, world_size: int) -> dict[str, np.ndarray]:
    """Every rank's value of each of PER_RANK_FIELDS in a bookkeeping block, by name ([world_size] each)."""
    slots = book[len(GLOBAL_FIELDS) :].reshape(world_size, len(PER_RANK_FIELDS))
    return {name: slots[:, i] for i, name in enumerate(PER_RANK_FIELDS)}


def gather_per_rank(values: tuple[float, ...], rank: int, world_size: int, device: torch.device) -> np.ndarray:
    """Every rank's ``values`` [world_size, len(values)], by one blocking all-reduce (on ``device``, for NCCL):
    the trainer's last step, whose compute times no later block carries."""
    block = torch.zeros(world_size, len(values), dtype=torch.float64)
    block[rank] = torch.tensor(values, dtype=torch.float64)
    block = block.to(device)
    dist.all_reduce(block)
    return block.cpu().numpy()
