"""fscomm: the Transport protocol and its backends (the SM-free host path: shared memory between ranks of one host,
gloo TCP across hosts; NCCL; NCCL copy-engine; the RDMA ring)."""

from typing import Any

from fscomm.groups import new_thread_group
from fscomm.renamed import warn_renamed
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

# Old names, answered for one release with a DeprecationWarning: old name -> new name.
_RENAMED = {"new_stage_group": "new_thread_group"}


def __getattr__(name: str) -> Any:
    if name not in _RENAMED:
        raise AttributeError(f"module 'fscomm' has no attribute {name!r}")
    warn_renamed("fscomm", name, _RENAMED[name])
    return globals()[_RENAMED[name]]
