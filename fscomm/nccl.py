"""The NCCL transport: torch.distributed's NCCL collectives, the baseline the host backend is measured against.

NCCL runs each collective as CUDA blocks on the SMs (one per channel), so the compute it overlaps loses those
SMs; that contention is what paper section 6.3 measured (about 10%) and what ``python -m benchmarks transport``
reproduces. Variable all_gather pads to the largest rank and drops the padding after (an SM copy, counted as
part of this baseline's cost).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.transport import (
    Handle,
    Splits,
    TransportBase,
    TransportUnavailableError,
    WorkHandle,
    check_all_gather,
    check_all_to_all,
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def nccl_unavailable_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device (NCCL needs one GPU per rank)"
    if not dist.is_nccl_available():
        return "this torch was built without NCCL"
    return None


class NcclTransport(TransportBase):
    name = "nccl"
    group_backend = "nccl"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return nccl_unavailable_reason()

    def __init__(self, group: dist.ProcessGroup):
        backend = dist.get_backend(group)
        if "nccl" not in backend:
            raise TransportUnavailableError(f"nccl transport: needs an NCCL group, got a {backend!r} group")
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        if not tensor.is_cuda:
            raise ValueError(
                f"fscomm nccl {op} on rank {self.rank}: NCCL needs a CUDA tensor, got one on {tensor.device}"
            )

    def all_to_all(
        self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, *, keep_host: bool = False
    ) -> Handle:
        """``keep_host`` changes nothing here: the data never touches the host, so ``handle.host()`` syncs."""
        state = groups.claim(self.group, "all_to_all")
        send, recv = check_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        self._check_device(tensor, "all_to_all")
        x = tensor.contiguous()
        out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        seq = state.take_seq()
        work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
        return WorkHandle(work, lambda: out, state, "all_to_all", seq, keep=(x,))

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        self._check_device(tensor, "all_gather")
        x = tensor.contiguous()
        W = self.world_size
        seq = state.take_seq()
        if sizes_l is None or len(set(sizes_l)) == 1:
            shape = (W, *x.shape) if sizes_l is None else (W * x.shape[0], *x.shape[1:])
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            work = _all_gather_single(out, x, group=self.group, async_op=True)
            return WorkHandle(work, lambda: out, state, "all_gather", seq, keep=(x,))
        biggest = max(sizes_l)
        padded = torch.zeros((biggest, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        gathered = torch.empty((W * biggest, *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _all_gather_single(gathered, padded, group=self.group, async_op=True)

        def unpad() -> torch.Tensor:
            return torch.cat([gathered[r * biggest : r * biggest + sizes_l[r]] for r in range(W)])

        return WorkHandle(work, unpad, state, "all_gather", seq, keep=(padded,))
