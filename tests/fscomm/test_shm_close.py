"""A rank that closes its shared-memory transport right after an exchange does not take that exchange away from
a peer still reading it (fscomm/shm.py: the closing rank waits, bounded, for its peers to finish reading)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _closes_at_once(rank, world_size):
    from fscomm import get_transport, new_thread_group
    from fscomm.shm import ShmExchange

    if rank == 0:  # slow to map its peer's first data segment: the peer is done and closing by then
        read = ShmExchange._peer_block

        def late(self, *args, **kwargs):
            time.sleep(0.5)
            return read(self, *args, **kwargs)

        ShmExchange._peer_block = late
    t = get_transport("host", new_thread_group("ids", timeout=datetime.timedelta(seconds=20)))
    out = t.all_gather(torch.full((2,), float(rank))).wait().tolist()
    if rank == 1:
        t0 = time.monotonic()
        t.close()
        return out, time.monotonic() - t0
    return out, 0.0


def test_a_rank_closing_right_after_an_exchange_leaves_it_to_a_peer_still_reading():
    (out0, _), (out1, closed_in) = run_ranks(_closes_at_once, 2, timeout=60)
    assert out0 == out1 == [[0.0, 0.0], [1.0, 1.0]]
    assert 0.2 < closed_in < 5, closed_in  # it waited for rank 0's read, not for the bound
