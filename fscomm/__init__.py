"""fscomm: the Transport protocol and its backends (the SM-free host path: shared memory between ranks of one host,
gloo TCP across hosts; NCCL; NCCL copy-engine; the RDMA ring)."""

from fscomm.groups import new_thread_group
from fscomm.timing import Timer
from fscomm.transport import (
    CollectiveError,
    Handle,
    Transport,
    TransportUnavailableError,
    get_transport,
)

__all__ = [
    "CollectiveError",
    "Handle",
    "Timer",
    "Transport",
    "TransportUnavailableError",
    "get_transport",
    "new_thread_group",
]
