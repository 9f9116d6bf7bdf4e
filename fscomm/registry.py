"""Named transports and the threads bound to them, with one owner.

Every exchanging part (the balancer's loader stages, the ID prefetch's, the embedding exchanges' forward, backward,
bulk and collision roles, a checkpoint's writer) exchanges on a thread group of its own (fscomm.groups): two
threads never interleave collectives on one group (that deadlocks). :func:`named_transport` makes the group and
its transport collectively on the first call with a name, every rank alike, and returns the same transport to
later calls while its group lives; a closed group's transport is closed and made again. :func:`bound_thread` is
the thread of one role bound to a transport (the collision chain: a thread of its own, which submits to the
group's exchange worker and waits on it, so it cannot be that worker), made on first use and ended with
:func:`close_bound_threads`.
:func:`close_named_transports` ends everything made here: the bound threads, the transports, the groups
(collective: every rank calls it, after the last exchange).
"""

from __future__ import annotations

import threading
from typing import Optional

from fscomm.groups import close_thread_groups, group_state, live_groups, new_thread_group
from fscomm.transport import Transport, get_transport
from fscomm.worker import SerialWorker

_lock = threading.Lock()
_transports: dict[tuple[str, str], Transport] = {}
_threads: dict[tuple[int, str], tuple[Transport, SerialWorker]] = {}


def named_transport(name: str, backend: str = "host") -> Transport:
    """The ``backend`` transport on the thread group ``name`` (made collectively on the first call with this name
    and backend)."""
    key = (name, backend)
    with _lock:
        cached = _transports.get(key)
    if cached is not None and name not in live_groups():  # its group was closed (close_thread_groups)
        cached.close()
        cached = None
    if cached is None:
        group_backend = "nccl" if backend.startswith("nccl") else "gloo"
        cached = get_transport(backend, group=new_thread_group(name, backend=group_backend))
        with _lock:
            _transports[key] = cached
    return cached


def host_transport(name: str) -> Transport:
    """The SM-free host transport on a thread group of its own named ``name``, for a loader stage's exchanges (each
    exchanging stage gets its own name): :func:`named_transport` with the host backend. A loader built after
    another one was shut down reuses its groups; two loaders alive at once need names of their own."""
    return named_transport(name, "host")


def bound_thread(transport: Transport, role: str) -> SerialWorker:
    """The thread of ``role`` bound to ``transport``: the only thread that issues that role's work on the
    transport's group, whichever object of this process runs it (keyed by the transport object, which the
    registry keeps alive, so no later object can take over its key)."""
    key = (id(transport), role)
    with _lock:
        entry = _threads.get(key)
        if entry is None or entry[0] is not transport or not entry[1].alive:
            entry = _threads[key] = (transport, SerialWorker(role, join_timeout_s=transport_timeout_s(transport)))
        return entry[1]


def close_bound_threads(*transports: Optional[Transport], every: bool = False) -> None:
    """Ends the threads bound to ``transports`` (their queued work runs first); with ``every``, all of them."""
    with _lock:
        ids = {id(t) for t in transports if t is not None}
        keys = [k for k in _threads if every or k[0] in ids]
        workers = [_threads.pop(k)[1] for k in keys]
    for worker in workers:
        worker.shutdown()


def transport_timeout_s(transport: Transport) -> float:
    """The communication timeout of ``transport``'s group."""
    return group_state(transport.group).timeout_s


def close_named_transports() -> None:
    """Ends the bound threads, closes the transports made here and destroys every thread group."""
    close_bound_threads(every=True)
    with _lock:
        made = list(_transports.values())
        _transports.clear()
    for transport in made:
        transport.close()
    close_thread_groups()
