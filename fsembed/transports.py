"""The embedding exchanges' transports, one process group each: forward, backward (urgent), bulk and collision.

Forward and backward are separate groups because on CUDA autograd runs a backward in its own device thread, and
fscomm lets one thread only issue collectives on a group (two threads interleaving collectives on one group
deadlock). The forward group carries the ID exchanges (also those the collection starts for a next step), the
flags (kept on the host too: the backward counts them there), the first step's lookup and, without a collision
group, the collision rows' new values (which a prioritized forward then sends for its own step); the backward
group carries every gradient exchange and the embeddings that a backward sends. On CPU both threads are the caller's,
which is allowed. The loader's ID-prefetch stage, when it runs in a loader thread, gets a group of its own from
whoever builds it.

Bulk is separate from backward because a group's exchanges run one after another (fscomm's serial worker per
group): prioritized updates send the large, overlapped exchanges (the next step's exclusive rows, the deferred
exclusive gradients) and a small, urgent one (the collision gradients, which the next forward waits for) from
the same backward; on one group the urgent exchange would queue behind the large ones and the wait would be
as long as the synchronous path's.

Collision is separate from all three because its exchange (the collision rows' new values, line 21) is issued
by the collision chain's thread (prioritized.py): the moment the collision gradients arrive, that thread updates
the rows and sends them, while the model thread runs the dense all-reduce and the optimizer; a group takes one
issuing thread.

Groups are made collectively, once per process, on first use (fscomm.registry, which owns them and closes them):
every rank must build its first collection at the same point of its program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fscomm.registry import named_transport

ROLES = ("fsembed-forward", "fsembed-backward", "fsembed-bulk", "fsembed-collision")


@dataclass(frozen=True)
class EmbeddingTransports:
    forward: object  # exchanges issued by forwards (ids, flags, first step's rows, evaluation)
    backward: object  # urgent exchanges of backwards: gradients (sync), collision gradients and rows (prioritized)
    bulk: object  # overlapped exchanges of backwards: early exclusive rows, deferred exclusive gradients
    # the collision rows' new values, from the collision chain's thread; None: the next forward sends them itself
    collision: object = None

    def relay_allocations(self) -> int:
        """Pinned relay blocks ever allocated by these transports' pools (host-relayed ones; 0 for the others).
        Flat after warm-up, unless an exchange outgrows every block so far: then the allocation (cudaHostAlloc,
        which synchronises the device) stalls the step it falls in."""
        unique = {id(t): t for t in (self.forward, self.backward, self.bulk, self.collision) if t is not None}
        return sum(t.pool_stats()["allocations"] for t in unique.values())

    @classmethod
    def single(cls, transport) -> "EmbeddingTransports":
        """One transport for everything: fine on CPU tests; on CUDA the backward thread needs its own group."""
        return cls(transport, transport, transport)


def embedding_transports(backend: str = "host") -> EmbeddingTransports:
    """The embedding exchanges' transports of ``backend``, on groups of their own (made collectively on first use).
    "host" takes shared memory between ranks of one host and TCP otherwise, per group; "host-shm" / "host-tcp" force
    it."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fsembed: torch.distributed is not initialised (init_process_group before building a collection)"
        )
    return EmbeddingTransports(*(named_transport(f"{role}-{backend}", backend) for role in ROLES))
