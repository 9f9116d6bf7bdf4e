"""Thread groups: a process group per issuing thread, and the one-issuing-thread-per-group guard.

Why a group per thread: a collective queues behind every earlier collective of its group, so the balancer's
exchanges must not share a group with the dense AllReduce (they would wait for it), and two threads must never
issue collectives on one group: each rank would interleave them in its own thread order, rank 0 running op A
while rank 1 runs op B, and both hang. Every exchanging part (a loader stage, an embedding role, a checkpoint's
writer) therefore asks for its own group at set-up, and the first thread that issues a collective on a group owns
it; another thread is refused with an error that says so.

Groups are made collectively: every rank calls ``new_thread_group`` with the same names in the same order.

Timeouts. Every group made here gets the job's communication timeout (``set_comm_timeout``, the trainer's
``--comm-timeout-s``), not torch's 30-minute default: a rank that stops without dying ends its peers' waits in
an error after that long.

Records are keyed by the group's name (torch's ``group_name`` is unique in the process), never by ``id()``,
which a new object can reuse; ``forget(group)`` drops one group's record when its owner destroys it.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from fscomm.worker import close_worker

DEFAULT_GROUP_NAME = "fscomm-default"


@dataclass
class GroupState:
    """What fscomm knows about one group: its name for messages, its timeout, the owning thread and the
    sequence number of the next collective (identical on every rank, since ranks issue in the same order)."""

    name: str
    group: dist.ProcessGroup
    timeout_s: float
    owner: Optional[threading.Thread] = None
    next_seq: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    worker: Optional[object] = None  # its exchange thread (fscomm.worker.SerialWorker), made on first use

    def take_seq(self) -> int:
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            return seq


_lock = threading.Lock()
_by_name: dict[str, GroupState] = {}
_by_group: dict[str, GroupState] = {}  # torch's group_name -> state
_comm_timeout_s: Optional[float] = None


def set_comm_timeout(seconds: Optional[float]) -> None:
    """The timeout of every group made from now on, and of the waits bounded by :func:`comm_timeout_s`
    (None: torch's default)."""
    global _comm_timeout_s
    if seconds is not None and not seconds > 0:
        raise ValueError(f"comm timeout must be > 0 seconds, got {seconds}")
    _comm_timeout_s = seconds


def comm_timeout_s() -> float:
    """The job's communication timeout in seconds (torch's default when none was set)."""
    return _comm_timeout_s if _comm_timeout_s is not None else dist.default_pg_timeout.total_seconds()


def _default_timeout_s() -> float:
    return comm_timeout_s()


def _key(group: dist.ProcessGroup) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name else f"group@{id(group):x}"


def new_thread_group(
    name: str, *, backend: str = "gloo", timeout: Optional[datetime.timedelta] = None, pg_options=None
) -> dist.ProcessGroup:
    """A new process group over all ranks, for one issuing thread.

    Collective: call it on every rank with the same names in the same order, at set-up. ``backend`` is
    "gloo" for the host-relayed and CPU paths, "nccl" for the NCCL backends. ``timeout`` bounds every collective
    of the group: a peer that dies or never issues its part ends in an error after it, never in a hang.
    ``pg_options``: backend options (the copy-engine backend sets NCCL's zero-CTA policy through them).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"new_thread_group: name must be a non-empty string, got {name!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            f"new_thread_group({name!r}): torch.distributed is not initialised (init_process_group first)"
        )
    with _lock:
        if name in _by_name:
            raise ValueError(
                f"new_thread_group: a group named {name!r} exists already on rank {dist.get_rank()}; "
                "each thread's group is made once, at set-up"
            )
    if timeout is None:
        timeout = datetime.timedelta(seconds=_default_timeout_s())
    timeout_s = timeout.total_seconds()
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"fscomm/joined/{name}/{rank}", "1")  # set-up only: lets a failure name who never came
    start = time.monotonic()
    try:
        group = dist.new_group(backend=backend, timeout=timeout, group_desc=name, pg_options=pg_options)
    except Exception as exc:
        raise RuntimeError(_join_failure(name, rank, world, store, time.monotonic() - start, timeout_s, exc)) from exc
    state = GroupState(name=name, group=group, timeout_s=timeout_s)
    with _lock:
        _by_name[name] = state
        _by_group[_key(group)] = state
    return group


_PEER_CLOSED = ("connection closed by peer", "connection reset by peer", "connection refused", "broken pipe")


def _join_failure(name: str, rank: int, world: int, store, waited_s: float, timeout_s: float, exc: Exception) -> str:
    """What went wrong in a group's set-up, in one line: the time that actually passed (a peer's closed connection
    ends the set-up at once, long before the timeout), whether a peer closed its connection, who never came."""
    try:
        missing = [r for r in range(world) if not store.check([f"fscomm/joined/{name}/{r}"])]
        who = f"rank(s) {missing} never called it" if missing else "every rank called it"
    except Exception:
        who = "the store is unreachable"
    said = " ".join(str(exc).split())
    if any(s in said.lower() for s in _PEER_CLOSED):
        what = (
            f"a peer closed its connection after {waited_s:.1f} s (its process ended or failed while this rank "
            f"was still connecting; group timeout {timeout_s:.1f} s)"
        )
    elif waited_s >= 0.9 * timeout_s:
        what = f"not every rank joined within {timeout_s:.1f} s (the group timeout, run out: waited {waited_s:.1f} s)"
    else:
        what = f"failed after {waited_s:.1f} s (group timeout {timeout_s:.1f} s)"
    return f"new_thread_group({name!r}) on rank {rank} of {world}: {what}; {who} (backend said: {said[:400]})"


def group_state(group: dist.ProcessGroup) -> GroupState:
    """fscomm's state of ``group``; a group made outside fscomm is adopted under its torch group name."""
    with _lock:
        state = _by_group.get(_key(group))
        if state is None or state.group is not group:
            name = getattr(group, "group_desc", None) or _key(group)
            state = GroupState(name=str(name), group=group, timeout_s=_default_timeout_s())
            _by_group[_key(group)] = state
        return state


def default_group(backend: str = "gloo", kind: Optional[str] = None, pg_options=None) -> dist.ProcessGroup:
    """fscomm's own group for ``backend`` (``kind`` names variants, e.g. NCCL with zero-CTA options; made on first
    use, collectively, so every rank must reach the
    first ``get_transport`` of each backend in the same order). It is never the world group, so fscomm traffic
    does not queue behind the dense AllReduce."""
    kind = kind or backend
    name = DEFAULT_GROUP_NAME if kind == "gloo" else f"{DEFAULT_GROUP_NAME}-{kind}"
    with _lock:
        state = _by_name.get(name)
    if state is not None:
        return state.group
    return new_thread_group(name, backend=backend, pg_options=pg_options)


def claim(group: dist.ProcessGroup, op: str) -> GroupState:
    """Binds ``group`` to the calling thread on first use; refuses any other living thread.

    A thread that has ended releases its groups (a loader restarted after a resume gets a new thread)."""
    state = group_state(group)
    me = threading.current_thread()
    with state.lock:
        owner = state.owner
        if owner is None or owner is me or not owner.is_alive():
            state.owner = me
            return state
    raise RuntimeError(
        f"fscomm {op}: group {state.name!r} is used by thread {owner.name!r}; thread {me.name!r} may not issue "
        "collectives on it (two threads interleaving collectives on one group deadlock). Give this thread its "
        f"own group: fscomm.groups.new_thread_group('<group name>') at set-up, on every rank"
    )


def forget(group: dist.ProcessGroup) -> None:
    """Drops fscomm's record of ``group`` (and its exchange worker): call when destroying it."""
    with _lock:
        state = _by_group.pop(_key(group), None)
        if state is not None and _by_name.get(state.name) is state:
            del _by_name[state.name]
    if state is not None:
        close_worker(state)


def forget_all() -> None:
    """Drops fscomm's records of groups (after destroy_process_group, e.g. between tests in one process)."""
    with _lock:
        states = list(_by_group.values())
        _by_name.clear()
        _by_group.clear()
    for state in states:
        close_worker(state)


def close_thread_groups() -> None:
    """Destroys every group made here (collective in torch's sense: every rank calls it, after the last
    exchange), ending their exchange threads, and forgets them."""
    with _lock:
        states = list(_by_group.values())
    for state in states:
        forget(state.group)
        try:
            dist.destroy_process_group(state.group)
        except (ValueError, RuntimeError):  # already destroyed with the world group
            pass


def live_groups() -> list[str]:
    """Names of the groups fscomm holds records of (a test checks none is left after closing)."""
    with _lock:
        return sorted(s.name for s in _by_group.values())
