"""The host relay: one exchange through a host work buffer, that is copies out of the device, a host-side exchange,
copies back.

Shared by the host (gloo) and RDMA backends. On CUDA tensors the copies run on a dedicated copy stream, so the
copy engines do them and no kernel is launched; the caller's stream is only made to wait on events. The host
exchange runs in the group's worker thread, so the call returns a handle at once, and exchanges complete in
issue order. The work buffer comes from the pinned pool and goes back to it once the copies back have read it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from fscomm import groups
from fscomm.pinned_pool import PinnedPool
from fscomm.transport import Handle, diagnose
from fscomm.worker import helper_event, worker_for

# (source bytes, destination bytes): views of equal length
Pieces = list[tuple[torch.Tensor, torch.Tensor]]


class RelayHandle(Handle):
    """An exchange in flight in the worker thread; on CUDA ``wait()`` orders the caller's stream after the copy
    back (an event wait: the host does not block on the GPU)."""

    def __init__(
        self,
        future: Future,
        copied_back: Optional["torch.cuda.Event"],
        device: torch.device,
        host_future: Optional[Future] = None,
    ):
        self._future = future
        self._copied_back = copied_back
        self._device = device
        self._host_future = host_future  # -> the result's bytes on the host, set before the copies back (keep_host)
        self.wait_time_s = 0.0

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out = self._future.result()
        finally:
            self.wait_time_s += time.perf_counter() - t0
        if self._copied_back is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copied_back)
        return out

    def host(self) -> torch.Tensor:
        if self._host_future is None:
            return super().host()
        t0 = time.perf_counter()
        try:
            return self._host_future.result()  # set once the exchange is done, before any copy back
        finally:
            self.wait_time_s += time.perf_counter() - t0

    def is_completed(self) -> bool:
        return self._future.done()


class HostRelay:
    """Runs exchanges through work buffers of its pinned pool, with one copy stream per device."""

    def __init__(self, pool: Optional[PinnedPool] = None):
        self.pool = pool if pool is not None else PinnedPool()
        self._copy_streams: dict[int, "torch.cuda.Stream"] = {}

    def copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(idx)
        if stream is None:
            stream = self._copy_streams[idx] = torch.cuda.Stream(device=idx)
        return stream

    def run(
        self,
        state: groups.GroupState,
        op: str,
        seq: int,
        x: torch.Tensor,
        out: torch.Tensor,
        work_nbytes: int,
        copy_out: Callable[[torch.Tensor], Pieces],
        exchange: Callable[[torch.Tensor], None],
        copy_back: Callable[[torch.Tensor, torch.Tensor], Pieces],
        keep_host: bool = False,
    ) -> Handle:
        """``copy_out(work)`` lists (x bytes, work bytes) copies, ``exchange(work)`` runs on the host in the
        worker thread, ``copy_back(work, result)`` lists (work bytes, result bytes) copies into ``out`` (or into
        a host tensor shaped like it: ``keep_host`` keeps such a copy for ``handle.host()``).

        One function on purpose: the CPU and CUDA jobs share, as closures, the work buffer's lifetime (back to the
        pool only once its copies have read it, never after a failed exchange), the host copy's future (failed too
        when the job fails, so ``host()`` never waits forever) and the error diagnosis; apart, each piece would
        take all of them as arguments and the ordering between them would no longer read in one place."""
        work_buf = self.pool.acquire(work_nbytes)
        work = work_buf.view
        # keep_host: a host copy of the result too (also on the CPU path, so CPU tests run its layout).
        host_future: Optional[Future] = Future() if keep_host else None

        def keep_on_host() -> None:
            if host_future is not None:
                host_out = torch.empty(out.shape, dtype=out.dtype)
                for src, dst in copy_back(work, host_out):
                    dst.copy_(src)
                host_future.set_result(host_out)

        def exchange_or_fail() -> None:
            try:
                exchange(work)
            except Exception as exc:  # the work buffer stays out of the pool: the peer may still write it
                raise diagnose(state, op, seq, exc) from exc
            keep_on_host()

        def submit(job: Callable[[], torch.Tensor]) -> Future:
            def run() -> torch.Tensor:
                try:
                    return job()
                except BaseException as exc:  # host() raises it too, rather than waiting forever
                    if host_future is not None and not host_future.done():
                        host_future.set_exception(exc)
                    raise

            return worker_for(state).submit(run)

        if not x.is_cuda:

            def cpu_job() -> torch.Tensor:
                for src, dst in copy_out(work):
                    dst.copy_(src)
                exchange_or_fail()
                for src, dst in copy_back(work, out):
                    dst.copy_(src)
                self.pool.release(work_buf)
                return out

            return RelayHandle(submit(cpu_job), None, x.device, host_future)

        device = x.device
        copy_stream = self.copy_stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            for src, dst in copy_out(work):
                dst.copy_(src, non_blocking=True)
        copied_out = helper_event()
        copied_out.record(copy_stream)
        copied_back = helper_event()
        # The caller may drop x right after this call, and out with the handle, while the copy stream still
        # reads or writes them: the job holds both until the host has seen those copies finish, so the caching
        # allocator cannot hand their memory out early. (Not record_stream: its deferred free is invisible to
        # TORCH_CUDA_SANITIZER, which then reports the memory's next user as racing with the copy.)
        source = [x]

        def job() -> torch.Tensor:
            copied_out.synchronize()
            source.clear()
            exchange_or_fail()
            with torch.cuda.stream(copy_stream):
                for src, dst in copy_back(work, out):
                    dst.copy_(src, non_blocking=True)
                copied_back.record(copy_stream)
            copied_back.synchronize()  # the work buffer may be reused only once the copies back have read it
            self.pool.release(work_buf)
            return out

        return RelayHandle(submit(job), copied_back, device, host_future)
