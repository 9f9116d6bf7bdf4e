"""The one transport interface every exchange goes through, and the choice of its backend.

    t = get_transport("host")                       # SM-free host path (default): shared memory between ranks
                                                    # of one host, TCP across hosts, per pair; "host-shm",
                                                    # "host-tcp", "nccl", "rdma"
    h = t.all_to_all(ids, send_splits, recv_splits)  # returns at once
    ...                                              # compute overlaps the exchange
    ids_here = h.wait()                              # on GPU: safe to use on the caller's current stream

Both collectives move whole rows (dim 0) of a contiguous tensor of any dtype, with per-rank row counts that may
be zero. A backend that cannot run on this machine is refused by ``get_transport`` with the reason, never
replaced by another one silently: a benchmark or a run must use what it asked for.
"""

from __future__ import annotations

import importlib
import time
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import torch
import torch.distributed as dist

from fscomm import groups

Splits = Union[Sequence[int], torch.Tensor]

BACKENDS: dict[str, str] = {
    "host": "fscomm.host:HostTransport",  # shared memory between ranks of one host, gloo TCP across hosts
    "host-shm": "fscomm.host:ShmHostTransport",
    "host-tcp": "fscomm.host:TcpHostTransport",
    "nccl": "fscomm.nccl:NcclTransport",
    "rdma": "fscomm.rdma:RdmaTransport",
}
# Not yet run on the GPUs they are written for, so --transport does not offer them; get_transport reaches them by
# name for the benchmarks and their tests (fscomm/experimental/).
EXPERIMENTAL_BACKENDS: dict[str, str] = {
    "nccl-ce": "fscomm.experimental.nccl_ce:NcclCeTransport",  # NCCL's zero-CTA copy-engine collectives
    "peer": "fscomm.experimental.peer:PeerTransport",  # copy-engine copies between GPUs of one host (CUDA IPC)
}


class TransportUnavailableError(RuntimeError):
    """The backend cannot run on this machine (no CUDA, old NCCL, one GPU, no verbs device...)."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation, the group and the suspect ranks."""


class Handle:
    """An exchange in flight. ``wait()`` returns the result (on GPU: ordered before later work on the caller's
    current stream, without blocking the host on the GPU); ``wait_time_s`` sums the host time spent blocked in
    ``wait()``, which is the exposed part of the exchange."""

    wait_time_s: float = 0.0

    def wait(self) -> torch.Tensor:
        raise NotImplementedError

    def host(self) -> torch.Tensor:
        """The result on the host, for sizes the caller must read. Here ``wait()`` copied to the CPU, which
        synchronises a GPU stream; the host relay's handle returns the bytes it received instead, with no device
        sync (the exchange passed through host memory anyway)."""
        return self.wait().cpu()

    def is_completed(self) -> bool:
        raise NotImplementedError


class WorkHandle(Handle):
    """A handle over a torch.distributed Work (gloo on CPU, NCCL): ``finalize`` turns the received buffer into
    the result (e.g. drops all_gather padding); failures are re-raised naming the op and the suspect ranks."""

    def __init__(self, work, finalize, state: "groups.GroupState", op: str, seq: int, keep: tuple = ()):
        self._work = work
        self._finalize = finalize
        self._state, self._op, self._seq = state, op, seq
        self._keep = keep  # inputs the backend reads until completion
        self._result: Optional[torch.Tensor] = None
        self.wait_time_s = 0.0

    def wait(self) -> torch.Tensor:
        if self._result is None:
            t0 = time.perf_counter()
            try:
                self._work.wait()
            except Exception as exc:
                raise diagnose(self._state, self._op, self._seq, exc) from exc
            finally:
                self.wait_time_s += time.perf_counter() - t0
            self._result = self._finalize()
            self._keep = ()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()


@runtime_checkable
class Transport(Protocol):
    """What every backend offers and callers may use (TransportBase gives the defaults)."""

    name: str
    group: dist.ProcessGroup
    active_path: Optional[str]  # the path this transport's group takes, where the backend chooses one

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Why this backend cannot run on this machine, or None."""
        ...

    def pool_stats(self) -> dict[str, int]:
        """Counters of its pinned relay memory; ``allocations`` stays flat after warm-up (0 without a pool)."""
        ...

    def close(self) -> None:
        """Releases what it holds beyond its group (segments, pinned pools, queue pairs). Idempotent."""
        ...

    def all_gather(self, tensor: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> Handle:
        """sizes None: every rank sends the same shape, result [W, *shape]. sizes: per-rank dim-0 sizes (this
        rank's must equal tensor.shape[0]), result [sum(sizes), *shape[1:]] in rank order."""
        ...

    def all_to_all(
        self, tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, *, keep_host: bool = False
    ) -> Handle:
        """Rows send_splits[r] go to rank r (in order along dim 0); result [sum(recv_splits), *shape[1:]].
        ``keep_host``: the caller will read the result on the host (``handle.host()``); a backend whose
        exchange passes through host memory keeps those bytes, so the read needs no device sync."""
        ...


class TransportBase:
    """The defaults of the :class:`Transport` methods a backend may not need: available anywhere, no relay pool,
    nothing to release, no choice of path."""

    active_path: Optional[str] = None  # where a backend picks its path per group (host: "shm", "shm+tcp", "tcp")
    pairs: Optional[dict] = None  # the host backend: the group's pairs of ranks per path (shm_pairs, tcp_pairs)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return None

    def pool_stats(self) -> dict[str, int]:
        return {"allocations": 0}

    def close(self) -> None:
        pass


# --- validation shared by every backend -------------------------------------------------------------------


def as_splits(splits: Splits, what: str, op: str, world_size: int, rank: int) -> list[int]:
    """A list of ``world_size`` non-negative ints from a list or a 1-D integer tensor, or a ValueError."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype == torch.bool:
            raise ValueError(
                f"fscomm {op} on rank {rank}: {what} must be a 1-D integer tensor, got {splits.dtype} "
                f"{tuple(splits.shape)}"
            )
        values = [int(v) for v in splits.tolist()]
    else:
        try:
            values = [int(v) for v in splits]
        except TypeError as exc:
            raise ValueError(
                f"fscomm {op} on rank {rank}: {what} must be a list of ints or a 1-D tensor, got "
                f"{type(splits).__name__}"
            ) from exc
    if len(values) != world_size:
        raise ValueError(f"fscomm {op} on rank {rank}: {what} has {len(values)} entries, world size is {world_size}")
    if any(v < 0 for v in values):
        raise ValueError(f"fscomm {op} on rank {rank}: {what} has negative entries: {values}")
    return values


def check_all_to_all(
    tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, world_size: int, rank: int
) -> tuple[list[int], list[int]]:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError(
            f"fscomm all_to_all on rank {rank}: need a tensor with at least one dimension, got "
            f"{getattr(tensor, 'shape', type(tensor))}"
        )
    send = as_splits(send_splits, "send_splits", "all_to_all", world_size, rank)
    recv = as_splits(recv_splits, "recv_splits", "all_to_all", world_size, rank)
    if sum(send) != tensor.shape[0]:
        raise ValueError(
            f"fscomm all_to_all on rank {rank}: send_splits sum to {sum(send)} but the tensor has {tensor.shape[0]} "
            "rows"
        )
    return send, recv


def prepare_all_to_all(
    tensor: torch.Tensor, send_splits: Splits, recv_splits: Splits, world_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Checks an all_to_all's arguments; returns (contiguous input, output, send bytes, recv bytes per rank)."""
    send, recv = check_all_to_all(tensor, send_splits, recv_splits, world_size, rank)
    x = tensor.contiguous()
    rb = row_bytes(x)
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return x, out, [s * rb for s in send], [r * rb for r in recv]


def check_all_gather(
    tensor: torch.Tensor, sizes: Optional[Sequence[int]], world_size: int, rank: int
) -> Optional[list[int]]:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"fscomm all_gather on rank {rank}: need a tensor, got {type(tensor).__name__}")
    if sizes is None:
        return None
    if tensor.dim() == 0:
        raise ValueError(f"fscomm all_gather on rank {rank}: sizes given, but the tensor is 0-dimensional")
    values = as_splits(sizes, "sizes", "all_gather", world_size, rank)
    if values[rank] != tensor.shape[0]:
        raise ValueError(
            f"fscomm all_gather on rank {rank}: sizes[{rank}]={values[rank]} but the tensor has {tensor.shape[0]} rows"
        )
    return values


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: every backend moves bytes, so any dtype (bf16, bool, int64)
    goes through gloo, which lacks some of them, without a conversion kernel."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def row_bytes(tensor: torch.Tensor) -> int:
    n = tensor.element_size()
    for d in tensor.shape[1:]:
        n *= d
    return n


# --- failures ---------------------------------------------------------------------------------------------

_GRACE_S = 1.0


def diagnose(state: "groups.GroupState", op: str, seq: int, exc: BaseException) -> CollectiveError:
    """Turns a backend's failure into an error naming the operation and the ranks that did not take part.

    No per-operation cost: only after a failure does each rank post "I failed op #seq" to the store and look,
    for a short grace period, which ranks of the group never posted; those died or never issued the operation.
    """
    group = state.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gname = getattr(group, "group_name", state.name)
    suspects: Optional[list[int]] = None
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"fscomm/failed/{gname}/{seq}/"
        store.set(prefix + str(rank), "1")
        deadline = time.monotonic() + min(_GRACE_S, max(0.2, state.timeout_s / 4))
        keys = [prefix + str(r) for r in range(world)]
        while True:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        suspects = missing
    except Exception:  # the store may have died with its host rank; say what we know
        suspects = None
    if suspects:
        who = f"rank(s) {suspects} of the group did not take part (died, or never issued it)"
    elif suspects == []:
        who = "every rank reached it and failed"
    else:
        who = "the store is unreachable, so the ranks that did not take part are unknown (rank 0 may have died)"
    kind = "timed out" if "timed out" in str(exc).lower() or "timeout" in str(exc).lower() else "failed"
    return CollectiveError(
        f"fscomm {op} #{seq} on group {state.name!r} {kind} on rank {rank} of {world} "
        f"(group timeout {state.timeout_s:.1f} s): {who}. Backend said: {exc}"
    )


# --- backend choice ---------------------------------------------------------------------------------------


def get_transport(name: str = "host", group: Optional[dist.ProcessGroup] = None, **options) -> Transport:
    """The transport ``name`` on ``group`` (None: fscomm's own group for that backend, made collectively on
    first use). Raises TransportUnavailableError with the reason when the backend cannot run here."""
    path = BACKENDS.get(name) or EXPERIMENTAL_BACKENDS.get(name)
    if path is None:
        raise ValueError(
            f"get_transport: unknown transport {name!r}; choose one of {sorted(BACKENDS)}"
            f" (experimental: {', '.join(sorted(EXPERIMENTAL_BACKENDS))})"
        )
    if not dist.is_initialized():
        raise TransportUnavailableError(f"get_transport({name!r}): torch.distributed is not initialised")
    module_name, cls_name = path.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise TransportUnavailableError(f"transport {name!r} cannot run on this machine: {reason}")
    if group is None:
        make = getattr(cls, "default_group", None)
        group = make() if make is not None else groups.default_group(cls.group_backend)
    return cls(group, **options)
