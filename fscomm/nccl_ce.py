"""The NCCL copy-engine transport: NCCL 2.28+ collectives that run on the copy engines, not on SMs.

They apply only within one NVLink domain (one node here), only to AllGather and equal-split AlltoAll, only
with the zero-CTA policy on the communicator (NCCL_CTA_POLICY_ZERO) and only on buffers registered in
symmetric memory windows (PyTorch's NCCL symmetric-memory backend). This module arranges all four and refuses
the rest with the reason, instead of letting NCCL quietly fall back to its SM kernels:

- unequal all_to_all splits need ``pad_to`` (the largest split of any rank, known to every rank, e.g. after the
  balancer's length AllGather): each block is padded to it, and the padding dropped on the way back;
- all_gather with sizes pads to the largest size (sizes are known everywhere);
- a job across nodes, one rank, NCCL older than 2.28 or a torch without the zero-CTA binding: refused.

The copies into and out of the symmetric buffers are device-to-device memcpys. Symmetric buffers are kept per
size and reused; a new one is registered (a collective) when more exchanges of a size are outstanding than
before, which every rank reaches at the same call because every rank issues and waits in the same order.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.nccl import nccl_unavailable_reason
from fscomm.transport import Handle, Splits, TransportUnavailableError, WorkHandle, check_all_gather, check_all_to_all, row_bytes

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
        return (f"the job spans several nodes (LOCAL_WORLD_SIZE {local} of WORLD_SIZE {world_size}); copy-engine "
                "collectives work within one NVLink domain only")
    if local is None and torch.cuda.device_count() < world_size:
        return f"{world_size} ranks but {torch.cuda.device_count()} GPU(s) here: copy-engine collectives need one node"
    return None


def ce_group_options():
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    return opts


class _SymmetricBuffers:
    """Registered (send, recv) pairs per byte size, handed out one per outstanding exchange."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        try:
            symm_mem.set_backend("NCCL")
        except Exception as exc:  # another backend was chosen earlier in this process
            if getattr(symm_mem, "get_backend", lambda *_: None)(device) != "NCCL":
                raise TransportUnavailableError(f"transport 'nccl-ce': symmetric memory cannot use NCCL here ({exc})") from exc
        self._group, self._device = group, device
        self._pool = symm_mem.get_mem_pool(device)
        self._free: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.registrations = 0

    def acquire(self, send_bytes: int, recv_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (send_bytes, recv_bytes)
        free = self._free.setdefault(key, [])
        if free:
            return free.pop()
        with torch.cuda.use_mem_pool(self._pool):
            send = torch.empty(max(send_bytes, 1), dtype=torch.uint8, device=self._device)
            recv = torch.empty(max(recv_bytes, 1), dtype=torch.uint8, device=self._device)
        for t in (send, recv):  # collective: every rank registers the same sizes in the same order
            self._symm.rendezvous(t, group=self._group.group_name)
        self.registrations += 1
        return send, recv

    def release(self, key: tuple[int, int], pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._free[key].append(pair)


class NcclCeTransport:
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
                "kernels; make it with fscomm.nccl_ce.ce_group_options() or pass group=None")
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._buffers: Optional[_SymmetricBuffers] = None

    def _bufs(self, device: torch.device) -> _SymmetricBuffers:
        if self._buffers is None:
            self._buffers = _SymmetricBuffers(self.group, device)
        return self._buffers

    def _check(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if not tensor.is_cuda:
            raise ValueError(f"fscomm nccl-ce {op} on rank {self.rank}: needs a CUDA tensor, got one on {tensor.device}")
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
        key = (block, W * block)
        send, recv = self._bufs(x.device).acquire(*key)
        xb = x.reshape(-1).view(torch.uint8)
        send[: xb.numel()].copy_(xb)
        seq = state.take_seq()
        work = _all_gather_single(recv[: W * block], send[:block], group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if sizes_l is None:
                out = recv[: W * block].clone().view(x.dtype).view(W, *x.shape)
            else:
                parts = [recv[r * block : r * block + sizes_l[r] * rb] for r in range(W)]
                out = torch.cat(parts).view(x.dtype).view(sum(sizes_l), *x.shape[1:])
            self._buffers.release(key, (send, recv))
            return out

        return WorkHandle(work, finish, state, "all_gather", seq, keep=(x,))

    def all_to_all(self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, pad_to: Optional[int] = None,
                   *, keep_host: bool = False) -> Handle:
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
                "to pad every block, or use the 'host' transport")
        block_rows = send_l[0] if pad_to is None else int(pad_to)
        if block_rows < max(send_l + recv_l):
            raise ValueError(f"fscomm nccl-ce all_to_all on rank {self.rank}: pad_to={pad_to} is smaller than a split ({max(send_l + recv_l)})")
        rb = row_bytes(x)
        block = block_rows * rb
        key = (W * block, W * block)
        send, recv = self._bufs(x.device).acquire(*key)
        xb = x.reshape(-1).view(torch.uint8)
        if pad_to is None:
            send[: xb.numel()].copy_(xb)
        else:
            start = 0
            for d, n in enumerate(send_l):
                send[d * block : d * block + n * rb].copy_(xb[start : start + n * rb])
                start += n * rb
        seq = state.take_seq()
        work = dist.all_to_all_single(recv[: W * block], send[: W * block], group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if pad_to is None:
                flat = recv[: W * block].clone()
            else:
                flat = torch.cat([recv[o * block : o * block + recv_l[o] * rb] for o in range(W)])
            self._buffers.release(key, (send, recv))
            return flat.view(x.dtype).view(sum(recv_l), *x.shape[1:])

        return WorkHandle(work, finish, state, "all_to_all", seq, keep=(x,))


def _cta_policy(group: dist.ProcessGroup) -> Optional[int]:
    """The group's NCCL CTA policy where torch lets us read it, else None (unknown)."""
    try:
        backend = group._get_backend(torch.device("cuda"))
        return int(backend.options.config.cta_policy)
    except Exception:
        return None
