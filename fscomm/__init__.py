"""fscomm: the Transport protocol and its backends (host-staged SM-free, NCCL, NCCL copy-engine, RDMA ring)."""

from fscomm.groups import new_stage_group
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
    "new_stage_group",
]
