"""The embedding stage's two transports: one for exchanges issued by forwards, one for those issued by backwards.

Two process groups, because on CUDA autograd runs a backward in its own device thread, and fscomm lets one
thread only issue collectives on a group (two threads interleaving collectives on one group deadlock). The
forward group carries the ID exchanges (also those the collection starts for a next step), the flags and the
first step's lookup; the backward group carries every gradient exchange and the embeddings that a backward
sends (prioritized updates). On CPU both threads are the caller's, which is allowed. The loader's ID-prefetch
stage, when it runs in a loader thread, gets a group of its own from whoever builds it.

Groups are made collectively, once per process, on first use: every rank must build its first collection at
the same point of its program.
"""

from __future__ import annotations

import torch.distributed as dist

from fscomm import get_transport
from fscomm.groups import new_stage_group

FORWARD_GROUP = "fsembed-forward"
BACKWARD_GROUP = "fsembed-backward"

_transports: dict[tuple[str, str], object] = {}


def stage_transports(backend: str = "host") -> tuple[object, object]:
    """(forward, backward) transports of ``backend`` on the embedding stage's own groups (made on first use)."""
    if not dist.is_initialized():
        raise RuntimeError("fsembed: torch.distributed is not initialised (init_process_group before building a collection)")
    out = []
    for role in (FORWARD_GROUP, BACKWARD_GROUP):
        key = (role, backend)
        if key not in _transports:
            group_backend = "nccl" if backend.startswith("nccl") else "gloo"
            _transports[key] = get_transport(backend, group=new_stage_group(f"{role}-{backend}", backend=group_backend))
        out.append(_transports[key])
    return out[0], out[1]
