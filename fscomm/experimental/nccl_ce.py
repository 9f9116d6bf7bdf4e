"""The NCCL copy-engine transport: NCCL 2.28+ collectives that run on the copy engines, not on SMs.

They apply only within one NVLink domain (one node here), only to AllGather and equal-split AlltoAll, only
with the zero-CTA policy on the communicator (NCCL_CTA_POLICY_ZERO) and only on buffers registered in
symmetric memory windows (PyTorch's NCCL symmetric-memory backend). This module arranges all four and refuses
the rest with the reason, instead of letting NCCL quietly fall back to its SM kernels:

- unequal all_to_all splits need ``pad_to`` (the largest split of any rank, known to every rank, e.g. after the
  balancer's length AllGather): each block is padded to it, and the padding dropped on the way back;
- all_gather with sizes pads to the largest size (sizes are known everywhere);
- a job across nodes, one rank, NCCL older than 2.28 or a torch without the zero-CTA binding: refused.

The copies into and out of the symmetric buffers are device-to-device memcpys of contiguous byte ranges (the
copy engines; no kernel, padded or not). Buffers come from a bounded pool (``SLOTS`` pairs, used in turn): every
rank takes the same slot at the same call and grows the pool (a collective registration) at the same call,
because both depend only on the call's position in the issue order and on byte counts that are equal on every
rank (equal blocks, or ``pad_to`` and sizes that every rank knows). A slot is reused only after the exchange
that last held it has been finished on the caller's stream (stream order; the host does not block).

Not offered on the command line until it has run on two GPUs or more.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.nccl import nccl_unavailable_reason
from fscomm.transport import (
    Handle,
    Splits,
    TransportBase,
    TransportUnavailableError,
    WorkHandle,
    check_all_gather,
    check_all_to_all,
    row_bytes,
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ce_unavailable_reason(world_size: Optional[int] = None) -> Optional[str]:
    reason = nccl_unavailable_reason()
    if reason is not None:
        return reason
    version = tuple(torch.cuda.nccl.version())
    if version < (2, 28):
        return f"NCCL {'.'.join(map(str, version))} has no copy-engine collectives (needs 2.28 or newer)"
    if not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
        return "this torch cannot set NCCL's zero-CTA policy (no ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO)"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except Exception as exc:
        return f"this torch has no symmetric memory ({exc})"
    world_size = world_size if world_size is not None else dist.get_world_size()
    if world_size < 2:
        return "copy-engine collectives need two GPUs or more (world size is 1)"
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != world_size:
        return (
            f"the job spans several nodes (LOCAL_WORLD_SIZE {local} of WORLD_SIZE {world_size}); copy-engine "
            "collectives work within one NVLink domain only"
        )
    if local is None and torch.cuda.device_count() < world_size:
        return f"{world_size} ranks but {torch.cuda.device_count()} GPU(s) here: copy-engine collectives need one node"
    return None


def ce_group_options():
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    return opts


SLOTS = 2


class SlotPlan:
    """Which slot each call takes and when the pool grows: a pure function of the calls' order and byte counts,
    so every rank, fed the same sequence, decides the same at the same call (a registration is a collective)."""

    def __init__(self, slots: int = SLOTS):
        self.slots, self.capacity, self.calls = slots, 0, 0

    def next(self, nbytes: int) -> tuple[int, Optional[int]]:
        """(slot of this call, new capacity per buffer if the pool must grow first, else None)."""
        slot = self.calls % self.slots
        self.calls += 1
        if nbytes <= self.capacity:
            return slot, None
        self.capacity = max(nbytes, 2 * self.capacity)
        return slot, self.capacity


def pad_pieces(splits_b: Sequence[int], block: int) -> list[tuple[slice, slice]]:
    """(packed bytes, padded bytes) per non-empty block: block r of the packed buffer to r*block."""
    out, start = [], 0
    for r, n in enumerate(splits_b):
        if n:
            out.append((slice(start, start + n), slice(r * block, r * block + n)))
        start += n
    return out


class _SymmetricPool:
    """``SLOTS`` registered (send, recv) pairs of one capacity; grown by re-registering all of them."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        try:
            symm_mem.set_backend("NCCL")
        except Exception as exc:  # another backend was chosen earlier in this process
            if getattr(symm_mem, "get_backend", lambda *_: None)(device) != "NCCL":
                raise TransportUnavailableError(
                    f"transport 'nccl-ce': symmetric memory cannot use NCCL here ({exc})"
                ) from exc
        self._group, self._device = group, device
        self._mem_pool = symm_mem.get_mem_pool(device)
        self.plan = SlotPlan()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._holders: list[Optional[Handle]] = [None] * self.plan.slots
        self.registrations = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        slot, grow = self.plan.next(max(nbytes, 1))
        if grow is not None:
            for h in self._holders:  # finish every exchange on the old buffers first (stream order)
                if h is not None:
                    h.wait()
            self._holders = [None] * self.plan.slots
            self._pairs = []
            with torch.cuda.use_mem_pool(self._mem_pool):
                for _ in range(self.plan.slots):
                    pair = tuple(torch.empty(grow, dtype=torch.uint8, device=self._device) for _ in range(2))
                    for t in pair:  # collective: every rank registers here, at this same call
                        self._symm.rendezvous(t, group=self._group.group_name)
                    self._pairs.append(pair)
            self.registrations += 1
        elif self._holders[slot] is not None:
            self._holders[slot].wait()  # its copy out of the slot is queued before our copy in
        send, recv = self._pairs[slot]
        return slot, send, recv

    def hold(self, slot: int, handle: Handle) -> None:
        self._holders[slot] = handle


class NcclCeTransport(TransportBase):
    name = "nccl-ce"
    group_backend = "nccl"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return ce_unavailable_reason()

    @classmethod
    def default_group(cls) -> dist.ProcessGroup:
        return groups.default_group("nccl", kind="nccl-ce", pg_options=ce_group_options())

    def __init__(self, group: dist.ProcessGroup):
        reason = ce_unavailable_reason(dist.get_world_size(group))
        if reason is not None:
            raise TransportUnavailableError(f"transport 'nccl-ce' cannot run on this group: {reason}")
        policy = _cta_policy(group)
        if policy is not None and policy != dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO:
            raise TransportUnavailableError(
                "transport 'nccl-ce': the group was made without NCCL_CTA_POLICY_ZERO, so NCCL would run its SM "
                "kernels; make it with fscomm.experimental.nccl_ce.ce_group_options() or pass group=None"
            )
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._buffers: Optional[_SymmetricPool] = None

    def _bufs(self, device: torch.device) -> _SymmetricPool:
        if self._buffers is None:
            self._buffers = _SymmetricPool(self.group, device)
        return self._buffers

    def _check(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if not tensor.is_cuda:
            raise ValueError(
                f"fscomm nccl-ce {op} on rank {self.rank}: needs a CUDA tensor, got one on {tensor.device}"
            )
        return tensor.contiguous()

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        x = self._check(tensor, "all_gather")
        W = self.world_size
        if sizes_l is None:  # one block of the whole tensor per rank
            block, rb = x.numel() * x.element_size(), 0
        else:
            rb = row_bytes(x)
            block = max(sizes_l) * rb
        pool = self._bufs(x.device)
        slot, send, recv = pool.take(W * block)
        xb = x.reshape(-1).view(torch.uint8)
        send[: xb.numel()].copy_(xb)
        seq = state.take_seq()
        work = _all_gather_single(recv[: W * block], send[:block], group=self.group, async_op=True)
        out_shape = (W, *x.shape) if sizes_l is None else (sum(sizes_l), *x.shape[1:])
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        counts = [block] * W if sizes_l is None else [n * rb for n in sizes_l]

        def finish() -> torch.Tensor:
            ob = out.reshape(-1).view(torch.uint8)
            for packed, padded in pad_pieces(counts, block):
                ob[packed].copy_(recv[padded])  # a memcpy per rank, not a gather kernel
            return out

        handle = WorkHandle(work, finish, state, "all_gather", seq, keep=(x,))
        pool.hold(slot, handle)
        return handle

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_splits: Splits,
        recv_splits: Splits,
        pad_to: Optional[int] = None,
        *,
        keep_host: bool = False,
    ) -> Handle:
        """``keep_host`` changes nothing here: the data never touches the host, so ``handle.host()`` syncs."""
        state = groups.claim(self.group, "all_to_all")
        send_l, recv_l = check_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        x = self._check(tensor, "all_to_all")
        W = self.world_size
        equal = len(set(send_l + recv_l)) == 1
        if pad_to is None and not equal:
            raise ValueError(
                f"fscomm nccl-ce all_to_all on rank {self.rank}: copy-engine AlltoAll moves equal blocks only, and "
                f"these splits are unequal (send {send_l}, recv {recv_l}); pass pad_to=<largest split of any rank> "
                "to pad every block, or use the 'host' transport"
            )
        block_rows = send_l[0] if pad_to is None else int(pad_to)
        if block_rows < max(send_l + recv_l):
            raise ValueError(
                f"fscomm nccl-ce all_to_all on rank {self.rank}: pad_to={pad_to} is smaller than a split "
                f"({max(send_l + recv_l)})"
            )
        rb = row_bytes(x)
        block = block_rows * rb
        pool = self._bufs(x.device)
        slot, send, recv = pool.take(W * block)  # W * block: equal on every rank
        xb = x.reshape(-1).view(torch.uint8)
        if pad_to is None:
            send[: xb.numel()].copy_(xb)
        else:
            for packed, padded in pad_pieces([n * rb for n in send_l], block):
                send[padded].copy_(xb[packed])
        seq = state.take_seq()
        work = dist.all_to_all_single(recv[: W * block], send[: W * block], group=self.group, async_op=True)
        out = torch.empty((sum(recv_l), *x.shape[1:]), dtype=x.dtype, device=x.device)

        def finish() -> torch.Tensor:
            ob = out.reshape(-1).view(torch.uint8)
            if pad_to is None:
                ob.copy_(recv[: W * block])
            else:
                for packed, padded in pad_pieces([n * rb for n in recv_l], block):
                    ob[packed].copy_(recv[padded])
            return out

        handle = WorkHandle(work, finish, state, "all_to_all", seq, keep=(x,))
        pool.hold(slot, handle)
        return handle


def _cta_policy(group: dist.ProcessGroup) -> Optional[int]:
    """The group's NCCL CTA policy where torch lets us read it, else None (unknown)."""
    try:
        backend = group._get_backend(torch.device("cuda"))
        return int(backend.options.config.cta_policy)
    except Exception:
        return None
