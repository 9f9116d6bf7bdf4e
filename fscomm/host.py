"""The host-staged, SM-free transport (the default).

On CUDA tensors an exchange is: a device-to-host copy into a pinned staging buffer on a dedicated copy stream
(the copy engines do it, no SM), the exchange between hosts on the CPU over gloo in fscomm's worker thread,
and a host-to-device copy back on the copy stream. No GPU kernel is launched, so compute that the exchange
overlaps keeps every SM (paper section 3.3: NCCL's channels each occupy an SM and slowed the overlapped
kernels by about 10%). The call returns a handle at once; ``wait()`` only makes the caller's stream wait on the
copy-back event, so the host does not block on the GPU.

On CPU tensors it is plain gloo (async). Every dtype travels as its bytes, so bf16, bool and int64 all work
without conversion kernels. all_gather with unequal sizes pads each rank's rows to the largest (gloo gathers
equal blocks) and drops the padding on the way back.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.staging import PinnedPool, StagingBuffer
from fscomm.transport import (
    Handle,
    Splits,
    WorkHandle,
    as_bytes,
    check_all_gather,
    check_all_to_all,
    diagnose,
    row_bytes,
)
from fscomm.worker import worker_for

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _StagedHandle(Handle):
    """A CUDA exchange in flight in the worker thread; ``wait()`` orders the caller's stream after the copy back."""

    def __init__(self, future: Future, copied_back: "torch.cuda.Event", device: torch.device):
        self._future = future
        self._copied_back = copied_back
        self._device = device
        self.wait_time_s = 0.0

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out = self._future.result()
        finally:
            self.wait_time_s += time.perf_counter() - t0
        torch.cuda.current_stream(self._device).wait_event(self._copied_back)
        return out

    def is_completed(self) -> bool:
        return self._future.done()


class HostTransport:
    name = "host"
    group_backend = "gloo"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return None if dist.is_gloo_available() else "this torch was built without gloo"

    def __init__(self, group: dist.ProcessGroup, pool: Optional[PinnedPool] = None):
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(f"host transport: needs a gloo group (the exchange runs on the CPU), got a {backend!r} group")
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.pool = pool if pool is not None else PinnedPool()
        self._copy_streams: dict[int, torch.cuda.Stream] = {}

    def pool_stats(self) -> dict[str, int]:
        return self.pool.stats()

    # --- public collectives ---------------------------------------------------------------------------

    def all_to_all(self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits) -> Handle:
        state = groups.claim(self.group, "all_to_all")
        send, recv = check_all_to_all(tensor, send_splits, recv_splits, self.world_size, self.rank)
        x = tensor.contiguous()
        rb = row_bytes(x)
        send_b, recv_b = [s * rb for s in send], [r * rb for r in recv]
        out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        seq = state.take_seq()

        def exchange(send_view: torch.Tensor, recv_view: torch.Tensor, async_op: bool):
            return dist.all_to_all_single(recv_view, send_view, recv_b, send_b, group=self.group, async_op=async_op)

        if not x.is_cuda:
            work = exchange(as_bytes(x), as_bytes(out), True)
            return WorkHandle(work, lambda: out, state, "all_to_all", seq, keep=(x,))
        n_out = sum(recv_b)
        return self._staged(state, "all_to_all", seq, x, out, x.numel() * x.element_size(), n_out,
                            lambda s, r: exchange(s, r, False), lambda recv_view: [(recv_view, slice(0, n_out))])

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        state = groups.claim(self.group, "all_gather")
        sizes_l = check_all_gather(tensor, sizes, self.world_size, self.rank)
        x = tensor.contiguous()
        W = self.world_size
        seq = state.take_seq()
        if sizes_l is None:
            out = torch.empty((W, *x.shape), dtype=x.dtype, device=x.device)
            block, pieces = x.numel() * x.element_size(), None
        else:
            rb = row_bytes(x)
            block = max(sizes_l) * rb  # gloo gathers equal blocks: pad every rank's rows to the largest
            out = torch.empty((sum(sizes_l), *x.shape[1:]), dtype=x.dtype, device=x.device)
            starts = [0]
            for s in sizes_l:
                starts.append(starts[-1] + s * rb)
            pieces = [(slice(r * block, r * block + sizes_l[r] * rb), slice(starts[r], starts[r + 1])) for r in range(W)]

        def exchange(send_view: torch.Tensor, recv_view: torch.Tensor, async_op: bool):
            return _all_gather_single(recv_view, send_view, group=self.group, async_op=async_op)

        if not x.is_cuda:
            if pieces is None:
                work = exchange(as_bytes(x), as_bytes(out), True)
                return WorkHandle(work, lambda: out, state, "all_gather", seq, keep=(x,))
            send = torch.zeros(block, dtype=torch.uint8)
            send[: x.numel() * x.element_size()] = as_bytes(x)
            recv = torch.empty(W * block, dtype=torch.uint8)
            work = exchange(send, recv, True)

            def unpad() -> torch.Tensor:
                out_b = as_bytes(out)
                for src, dst in pieces:
                    out_b[dst] = recv[src]
                return out

            return WorkHandle(work, unpad, state, "all_gather", seq, keep=(send, recv))
        if pieces is None:
            pieces_fn = lambda recv_view: [(recv_view, slice(0, W * block))]
        else:
            pieces_fn = lambda recv_view: [(recv_view[src], dst) for src, dst in pieces]
        return self._staged(state, "all_gather", seq, x, out, block, W * block,
                            lambda s, r: exchange(s, r, False), pieces_fn)

    # --- the CUDA path --------------------------------------------------------------------------------

    def _copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(idx)
        if stream is None:
            stream = self._copy_streams[idx] = torch.cuda.Stream(device=idx)
        return stream

    def _staged(
        self,
        state: groups.GroupState,
        op: str,
        seq: int,
        x: torch.Tensor,
        out: torch.Tensor,
        send_nbytes: int,
        recv_nbytes: int,
        exchange: Callable[[torch.Tensor, torch.Tensor], None],
        pieces: Callable[[torch.Tensor], list],
    ) -> Handle:
        """D2H (copy stream) -> exchange on CPU (worker thread) -> H2D (copy stream); only copies, no kernel."""
        device = x.device
        copy_stream = self._copy_stream(device)
        caller = torch.cuda.current_stream(device)
        send_buf: StagingBuffer = self.pool.acquire(send_nbytes)
        recv_buf: StagingBuffer = self.pool.acquire(recv_nbytes)
        x_bytes = as_bytes(x)
        ready = torch.cuda.Event()
        ready.record(caller)
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            send_buf.view[: x_bytes.numel()].copy_(x_bytes, non_blocking=True)
        staged_out = torch.cuda.Event()
        staged_out.record(copy_stream)
        # The caching allocator must not hand x's or out's memory to the caller stream while the copy stream
        # still reads or writes it (x may be freed right after this call returns, out if the handle is dropped).
        x.record_stream(copy_stream)
        out.record_stream(copy_stream)
        copied_back = torch.cuda.Event()
        out_bytes = as_bytes(out)

        def job() -> torch.Tensor:
            try:
                staged_out.synchronize()
                exchange(send_buf.view, recv_buf.view)
            except Exception as exc:  # buffers stay out of the pool: gloo may still touch them
                raise diagnose(state, op, seq, exc) from exc
            with torch.cuda.stream(copy_stream):
                for src, dst in pieces(recv_buf.view):
                    out_bytes[dst].copy_(src, non_blocking=True)
                copied_back.record(copy_stream)
            copied_back.synchronize()  # the staging buffers may be reused only once the copy back has read them
            self.pool.release(send_buf)
            self.pool.release(recv_buf)
            return out

        return _StagedHandle(worker_for(state).submit(job), copied_back, device)
