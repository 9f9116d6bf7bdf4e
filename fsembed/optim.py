"""Sparse row-wise optimizers, applied on the shard to the rows a step touched (torchrec's "fused" optimizers).

Duplicate ids of one step are summed first, deterministically: the shard-major gradient rows are stably sorted
by row id and every row's contributions are summed in their arrival order (source rank, then batch-major
position) by ``kernels.ops.segment_sum``, never by atomics, and without a device-to-host sync
(:func:`sum_duplicate_rows`). A row's update therefore depends only on that
ordered list of contributions, which is what lets the prioritized path, which updates the same rows at other
moments and in other subsets, match the synchronous one bit for bit. For the same reason the per-row
arithmetic below is written so that a row's result never depends on which other rows are updated with it
(no reductions across rows; the row-wise mean is a per-row sum over the dim).

State lives beside the weight, one entry per local row (or per element for Adam), so it shards with the rows.
Every state starts at zero. ``g`` below is a row's summed gradient of the step (of the loss as the backward gives
it: TrainStep divides the loss by the global label count, and the collection's ``grad_scale``, 1.0 by default,
multiplies it); the arithmetic is fp32 and the row is written back in the table's dtype. Rows the step did not
look up are not touched (no decay of their state, no weight decay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from kernels import ops
from kernels.impl import Impl, resolve


def duplicate_segments(local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ids [M], order [M], offsets [M + 1]) of ids [M] on the device, with no device-to-host sync: the ids
    stably sorted (each row's entries stay in arrival order), ``order`` their entries' positions, and segment k,
    entries ``offsets[k]:offsets[k+1]`` of the sorted ids, the k-th unique row's; the segments past the U unique
    rows are empty (offsets M)."""
    sorted_ids, order = torch.sort(local_ids, stable=True)
    m = local_ids.numel()
    first = torch.ones(m, dtype=torch.bool, device=local_ids.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    starts = torch.nonzero_static(first, size=m, fill_value=m).squeeze(1)  # U segment starts, then m
    return sorted_ids, order, torch.cat([starts, starts.new_full((1,), m)])


def sum_duplicate_rows(local_ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M], summed gradients [M, D]) from shard-major (ids [M], gradient rows [M, D]), with no
    device-to-host sync (on a GPU the host keeps queueing work ahead of the device).

    The first U entries are the unique rows in ascending order with their sums; the other M - U entries
    repeat real rows (entry k is row k mod U, with that row's sum), so that every write of a row carries the
    same values and the number of unique rows never has to reach the host. On the CPU, where reading U costs
    nothing, only the U unique rows come back (the same sums: the same segments, summed by the same op)."""
    if not local_ids.is_cuda:
        sorted_ids, order = torch.sort(local_ids, stable=True)
        rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return rows, ops.segment_sum(grads.index_select(0, order), offsets)
    m = local_ids.numel()
    sorted_ids, order, offsets = duplicate_segments(local_ids)
    sums = ops.segment_sum(grads.index_select(0, order), offsets)  # [M, D]; segments U.. are empty
    k = torch.arange(m, device=local_ids.device)
    unique = (offsets[:-1] < m).sum()
    pick = torch.where(k < unique, k, k % unique)
    return sorted_ids.index_select(0, offsets.index_select(0, pick)), sums.index_select(0, pick)


class RowWiseOptimizer:
    """Updates rows [K] of a local weight with their summed gradients [K, D]. A row may repeat, always with the
    same gradient (see :func:`sum_duplicate_rows`), so an implementation must read every row it needs before it
    writes any (index_select, then index_copy_) and never accumulate into the weight or state (no index_add_ or
    scatter-add): then repeated writes carry identical values and each row is updated exactly once."""

    name = "base"

    def init_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def update_rows(
        self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor, grad: torch.Tensor
    ) -> None:
        raise NotImplementedError

    def apply(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        local_ids: torch.Tensor,
        grads: torch.Tensor,
        impl: Union[Impl, str, None] = None,
    ) -> None:
        """Sums duplicates of shard-major (local_ids, grads) and updates those rows in place. ``impl``: Triton (the
        default for CUDA tensors) sums and updates in one kernel (kernels.triton.triton_rowwise), torch (the
        default elsewhere) by :func:`sum_duplicate_rows` and :meth:`update_rows`: the same arithmetic, each row's
        sum fixed by its entries in arrival order either way, equal up to fp32 rounding. A subclass's own
        ``update_rows`` always runs the torch way."""
        if local_ids.numel() == 0:
            return
        default = Impl.TRITON if weight.is_cuda else Impl.TORCH
        chosen = resolve(impl, op="fsembed.optim", supported=(Impl.TRITON, Impl.TORCH), default=default)
        if chosen is Impl.TRITON and _FUSED.get(type(self).update_rows) == self.name:
            from kernels.triton import triton_rowwise

            sorted_ids, order, offsets = duplicate_segments(local_ids)
            triton_rowwise.rowwise_update(
                self.name, weight, state, sorted_ids, order, offsets, grads, **self.hyperparameters()
            )
            return
        rows, summed = sum_duplicate_rows(local_ids, grads)
        self.update_rows(weight, state, rows, summed)

    def hyperparameters(self) -> dict[str, float]:
        """The fused kernel's scalars (kernels.triton.triton_rowwise.rowwise_update)."""
        return {key: getattr(self, key) for key in ("lr", "beta1", "beta2", "eps") if hasattr(self, key)}


@dataclass
class SGD(RowWiseOptimizer):
    """``w -= lr g``; no state."""

    lr: float = 0.01
    name = "sgd"

    def update_rows(self, weight, state, rows, grad):
        w = weight.index_select(0, rows).float()
        weight.index_copy_(0, rows, (w - self.lr * grad.float()).to(weight.dtype))


@dataclass
class RowWiseAdagrad(RowWiseOptimizer):
    """fbgemm's EXACT_ROWWISE_ADAGRAD: one fp32 accumulator per row (state ``sum``, initially 0),
    ``acc += mean over the dim of g^2``, then ``w -= lr g / (sqrt(acc) + eps)`` with the updated ``acc``."""

    lr: float = 0.01
    eps: float = 1e-8
    name = "rowwise_adagrad"

    def init_state(self, weight):
        return {"sum": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}

    def update_rows(self, weight, state, rows, grad):
        g = grad.float()
        acc = state["sum"].index_select(0, rows) + (g * g).sum(1) / g.shape[1]
        state["sum"].index_copy_(0, rows, acc)
        mult = self.lr / (acc.sqrt() + self.eps)
        w = weight.index_select(0, rows).float()
        weight.index_copy_(0, rows, (w - mult.unsqueeze(1) * g).to(weight.dtype))


@dataclass
class Adam(RowWiseOptimizer):
    """Lazy (sparse) Adam: moments of the touched rows only, bias correction by each row's own step count.
    State ``m``, ``v`` per element and ``step`` per row, initially 0; per touched row ``step += 1``,
    ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``, ``w -= lr m_hat / (sqrt(v_hat) + eps)`` with
    ``m_hat = m / (1 - beta1^step)``, ``v_hat = v / (1 - beta2^step)``."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "adam"

    def init_state(self, weight):
        z = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return {"m": z, "v": z.clone(), "step": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}

    def update_rows(self, weight, state, rows, grad):
        g = grad.float()
        step = state["step"].index_select(0, rows) + 1
        m = state["m"].index_select(0, rows) * self.beta1 + g * (1 - self.beta1)
        v = state["v"].index_select(0, rows) * self.beta2 + g * g * (1 - self.beta2)
        state["step"].index_copy_(0, rows, step)
        state["m"].index_copy_(0, rows, m)
        state["v"].index_copy_(0, rows, v)
        m_hat = m / (1 - self.beta1**step).unsqueeze(1)
        v_hat = v / (1 - self.beta2**step).unsqueeze(1)
        w = weight.index_select(0, rows).float()
        weight.index_copy_(0, rows, (w - self.lr * m_hat / (v_hat.sqrt() + self.eps)).to(weight.dtype))


#: The update_rows that the fused kernel computes, by the kernel's kind.
_FUSED = {SGD.update_rows: "sgd", RowWiseAdagrad.update_rows: "rowwise_adagrad", Adam.update_rows: "adam"}


def get_optimizer(name: str, **kwargs) -> RowWiseOptimizer:
    table = {"sgd": SGD, "rowwise_adagrad": RowWiseAdagrad, "adagrad": RowWiseAdagrad, "adam": Adam}
    if name not in table:
        raise ValueError(f"fsembed optimizer {name!r} unknown; choose one of {sorted(table)}")
    return table[name](**kwargs)
