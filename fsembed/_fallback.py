"""The one place where fsembed stands in for dependencies that had not landed when it was written.

``transport_for`` returns fscomm's host transport when ``fscomm.host`` exists, else a minimal gloo transport
with the frozen ``all_to_all(tensor, send_splits, recv_splits) -> Handle`` signature. Delete this file (and
call ``fscomm.get_transport`` directly) once the host backend is committed.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist


class _GlooHandle:
    def __init__(self, work, out: torch.Tensor, view: torch.Tensor, shape, dtype):
        self._work, self._out, self._view, self._shape, self._dtype = work, out, view, shape, dtype
        self._result: Optional[torch.Tensor] = None
        self.wait_time_s = 0.0

    def wait(self) -> torch.Tensor:
        if self._result is None:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            self.wait_time_s += time.perf_counter() - t0
            self._result = self._view.view(self._dtype).reshape(self._shape)
        return self._result

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class _GlooTransport:
    """Rows of any dtype as bytes through gloo's all_to_all_single (CPU tensors only)."""

    name = "gloo-fallback"

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group

    def all_to_all(self, tensor: torch.Tensor, send_splits: Union[Sequence[int], torch.Tensor], recv_splits) -> _GlooHandle:
        send = [int(x) for x in (send_splits.tolist() if isinstance(send_splits, torch.Tensor) else send_splits)]
        recv = [int(x) for x in (recv_splits.tolist() if isinstance(recv_splits, torch.Tensor) else recv_splits)]
        if sum(send) != tensor.shape[0]:
            raise ValueError(f"all_to_all: send_splits sum to {sum(send)}, tensor has {tensor.shape[0]} rows")
        row = tensor.element_size()
        for d in tensor.shape[1:]:
            row *= d
        src = tensor.contiguous().reshape(-1).view(torch.uint8)
        out = torch.empty(sum(recv) * row, dtype=torch.uint8)
        work = dist.all_to_all_single(
            out, src, [r * row for r in recv], [s * row for s in send], group=self.group, async_op=True
        )
        return _GlooHandle(work, out, out, (sum(recv), *tensor.shape[1:]), tensor.dtype)


def transport_for(group: Optional[dist.ProcessGroup] = None):
    """fscomm's host transport on ``group`` if it exists, else the gloo stand-in."""
    if importlib.util.find_spec("fscomm.host") is not None:
        from fscomm import transport

        return transport.get_transport("host", group=group)
    return _GlooTransport(group)
