"""The step's one all-reduce: the dense gradients, kept in flat buffers, with a bookkeeping block at the end.

Every dense parameter's ``.grad`` is a view of one flat buffer per dtype (the bucket view of DDP's
``gradient_as_bucket_view``): the backward accumulates into it in place, so the all-reduce runs on the buffer as
it is, with no gather of the gradients before it and no copy back after it, and zeroing them is one fill.

The float32 buffer ends with the bookkeeping block: the global scalars (label count, BCE sum, positives), then
one slot of ``PER_RANK_FIELDS`` per rank, written only by its rank, so every rank learns every rank's timings
from the same all-reduce. The block travels as float32: exact for counts below 2^24 per step. On a GPU it comes
back through pinned memory with its own event, not a pageable ``.cpu()``, which would hold up the host
transport's copies until the whole device is idle.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

GLOBAL_FIELDS = ("labels", "bce_sum", "positives")
PER_RANK_FIELDS = ("compute_s", "tokens", "samples", "sparsity")


class DenseSync:
    """``all_reduce(scalars, mine)``: sums the gradients of ``params`` and the bookkeeping block over the ranks;
    returns the block on the host (float64): GLOBAL_FIELDS, then world_size x PER_RANK_FIELDS."""

    def __init__(self, params: Iterable[torch.nn.Parameter], rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.params = [p for p in params if p.requires_grad]
        self.book_size = len(GLOBAL_FIELDS) + world_size * len(PER_RANK_FIELDS)
        sizes: dict[torch.dtype, int] = {torch.float32: 0}
        for p in self.params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        self.buffers = {
            dtype: torch.zeros(n + (self.book_size if dtype == torch.float32 else 0), dtype=dtype, device=self.device)
            for dtype, n in sizes.items()
        }
        self.views: list[torch.Tensor] = []
        offsets = dict.fromkeys(sizes, 0)
        for p in self.params:
            start = offsets[p.dtype]
            view = self.buffers[p.dtype][start : start + p.numel()].view(p.shape)
            offsets[p.dtype] += p.numel()
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self.views.append(view)
        self.book = self.buffers[torch.float32][offsets[torch.float32] :]
        cuda = self.device.type == "cuda"
        self._up = torch.zeros(self.book_size, dtype=torch.float32, pin_memory=cuda)
        self._down = torch.zeros(self.book_size, dtype=torch.float32, pin_memory=cuda) if cuda else None
        self._done: Optional[torch.cuda.Event] = torch.cuda.Event() if cuda else None

    def zero_grad(self) -> None:
        """Every gradient (and the block) to zero; also those this rank's batch does not reach (an empty local
        batch): the buffers have the same layout on every rank."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:  # replaced by someone (set_to_none, a non-contiguous layout): point it back
                p.grad = view
        for buffer in self.buffers.values():
            buffer.zero_()

    def all_reduce(self, scalars: tuple[float, ...], mine: tuple[float, ...]) -> torch.Tensor:
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
        self._up.zero_()
        self._up[: len(GLOBAL_FIELDS)] = torch.tensor(scalars)
        slot = len(GLOBAL_FIELDS) + self.rank * len(PER_RANK_FIELDS)
        self._up[slot : slot + len(PER_RANK_FIELDS)] = torch.tensor(mine)
        self.book.copy_(self._up, non_blocking=True)
        works = [dist.all_reduce(buffer, async_op=True) for buffer in self.buffers.values() if buffer.numel()]
        for work in works:
            work.wait()
        if self._done is None:
            return self.book.double()
        self._down.copy_(self.book, non_blocking=True)
        self._done.record()
        self._done.synchronize()
        return self._down.double()
