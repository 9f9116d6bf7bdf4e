"""The paper's ring (Figure 6): AllGather and AllToAll between host buffers, one neighbour to the next.

Every rank talks only to its two ring neighbours: it sends to rank+1 and receives from rank-1 (one RC queue
pair each way in the RDMA backend). The ring works on byte views of host buffers and on a ``RingLink``, so the
send order and the buffer handling are the same code whether the link is real verbs queue pairs or the
in-memory fake of the tests.

AllGather: chunk c starts at rank c. At step s (0..W-2) rank r sends chunk (r-s) mod W, which it owns or got at
the previous step, and receives chunk (r-s-1) mod W. Chunks may differ in size (zero too): no padding.

AllToAll: the block from origin o to destination d travels (d-o) mod W hops. At step s (1..W-1) rank r receives
from rank r-1 the *bundle* of origin o=(r-s) mod W: o's blocks for the ranks at distance s..W-1 from o, ordered
by distance, so the first block is r's own and the rest, contiguous, is exactly what r forwards at step s+1.
Forwarding is zero-copy (a send from the tail of the receive area). Each link carries W(W-1)/2 blocks instead
of W-1 for direct exchange: the price of a ring, which needs two queue pairs per rank whatever W is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class RingLink(Protocol):
    """A rank's two ring connections: sends go to rank+1, receives come from rank-1, in posting order."""

    def post_recv(self, view: torch.Tensor) -> None:
        """Posts a receive into ``view`` (uint8, inside a registered buffer)."""

    def post_send(self, view: torch.Tensor) -> None:
        """Sends the bytes of ``view`` (uint8, inside a registered buffer) to the right neighbour."""

    def wait(self, sends: int, recvs: int, timeout_s: float) -> list[int]:
        """Waits for that many more send and receive completions; returns the received byte counts."""


class RingError(RuntimeError):
    pass


def all_gather_steps(rank: int, world_size: int, offsets: Sequence[int]) -> list[tuple[slice, slice]]:
    """(send slice, receive slice) of each step; chunk c lives at offsets[c]:offsets[c+1]."""
    W = world_size
    chunk = lambda c: slice(offsets[c], offsets[c + 1])
    return [(chunk((rank - s) % W), chunk((rank - s - 1) % W)) for s in range(W - 1)]


def _expect(got: list[int], want: list[int], what: str, left: int) -> None:
    if got != want:
        raise RingError(
            f"ring {what}: expected {want} bytes from rank {left}, received {got}: the ranks disagree on sizes"
        )


def ring_all_gather(
    link: RingLink, buf: torch.Tensor, offsets: Sequence[int], rank: int, world_size: int, timeout_s: float
) -> None:
    """In place in ``buf``: this rank's chunk must be at its offsets; all chunks are there on return."""
    steps = all_gather_steps(rank, world_size, offsets)
    left = (rank - 1) % world_size
    for _, recv in steps:  # every receive posted up front: a send never finds its peer unready
        link.post_recv(buf[recv])
    for s, (send, recv) in enumerate(steps):
        link.post_send(buf[send])
        _expect(link.wait(1, 1, timeout_s), [recv.stop - recv.start], f"all_gather step {s}", left)


@dataclass
class AllToAllPlan:
    """Byte layout of one ring AllToAll on this rank; ``scratch_bytes`` is the ring buffer's size.

    send_area: where each own block (to dest d) goes, ordered by distance; steps[s-1] = (send, recv, mine):
    the slices of the scratch buffer sent and received at step s and the received block that is this rank's."""

    scratch_bytes: int
    send_area: dict[int, slice]
    steps: list[tuple[slice, slice, slice]]
    mine: dict[int, slice]  # origin -> slice of scratch holding its block for this rank (origin != rank)


def all_to_all_plan(rank: int, world_size: int, matrix: Sequence[Sequence[int]]) -> AllToAllPlan:
    """``matrix[o][d]``: bytes origin o sends destination d (every rank's row, identical everywhere)."""
    W = world_size
    send_area: dict[int, slice] = {}
    pos = 0
    for k in range(1, W):
        d = (rank + k) % W
        send_area[d] = slice(pos, pos + matrix[rank][d])
        pos += matrix[rank][d]
    send = slice(0, pos)
    steps, mine = [], {}
    for s in range(1, W):
        o = (rank - s) % W
        length = sum(matrix[o][(o + k) % W] for k in range(s, W))
        recv = slice(pos, pos + length)
        own = matrix[o][rank]
        mine[o] = slice(pos, pos + own)
        steps.append((send, recv, mine[o]))
        send = slice(pos + own, pos + length)  # forwarded as is at the next step
        pos += length
    return AllToAllPlan(scratch_bytes=pos, send_area=send_area, steps=steps, mine=mine)


def ring_all_to_all(
    link: RingLink,
    scratch: torch.Tensor,
    plan: AllToAllPlan,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> None:
    """Runs the steps in ``scratch`` (own blocks already at ``plan.send_area``); blocks for this rank end up at
    ``plan.mine``."""
    left = (rank - 1) % world_size
    for _, recv, _ in plan.steps:
        link.post_recv(scratch[recv])
    for s, (send, recv, _) in enumerate(plan.steps, start=1):
        link.post_send(scratch[send])
        _expect(link.wait(1, 1, timeout_s), [recv.stop - recv.start], f"all_to_all step {s}", left)


def exchange_rows(
    link: RingLink, buf: torch.Tensor, row: Sequence[int], rank: int, world_size: int, timeout_s: float
) -> list[list[int]]:
    """Ring AllGather of one int64 row per rank (the split matrix an AllToAll needs everywhere); ``buf`` is a
    registered scratch of at least 8*W*W bytes."""
    W = world_size
    n = 8 * W
    meta = buf[: n * W]
    meta[rank * n : (rank + 1) * n].copy_(torch.tensor(list(row), dtype=torch.int64).view(torch.uint8))
    ring_all_gather(link, meta, [r * n for r in range(W + 1)], rank, W, timeout_s)
    return meta.view(torch.int64).view(W, W).tolist()
