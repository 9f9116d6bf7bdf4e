"""fscomm: the Transport protocol and its backends (the SM-free host path: shared memory between ranks of one host,
gloo TCP across hosts; NCCL; NCCL copy-engine; the RDMA ring)."""

import warnings
from typing import Any

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

# Old names, answered for one release with a DeprecationWarning: old name -> new name.
_RENAMED = {"new_stage_group": "new_thread_group"}


def __getattr__(name: str) -> Any:
    if name not in _RENAMED:
        raise AttributeError(f"module 'fscomm' has no attribute {name!r}")
    warnings.warn(
        f"fscomm.{name} is deprecated and goes in the next release: use fscomm.{_RENAMED[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[_RENAMED[name]]
