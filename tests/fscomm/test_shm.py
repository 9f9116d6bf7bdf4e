"""The host transport's shared-memory path: locality choice, growth, lifecycle, refusals and dead peers."""

from __future__ import annotations

import datetime
import os
import shutil
import stat
import time

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _mine_in_shm(pids) -> list[str]:
    from fscomm.shm import PREFIX, SHM_DIR

    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and int(n[len(PREFIX) :].split("-")[0]) in pids]


def _growth_and_lifecycle(rank, world_size):
    import torch.distributed as dist

    from fscomm import get_transport

    t = get_transport("host")
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    after_setup = _mine_in_shm(pids)
    dist.barrier()
    results, gens = [], []
    for step, rows in enumerate([3, 5000, 0, 70000, 2]):  # grows twice; zero rows; shrinking needs no new segment
        x = torch.arange(rows * world_size * 4, dtype=torch.float32).reshape(rows * world_size, 4) + 1e6 * rank
        got = t.all_to_all(x, [rows] * world_size, [rows] * world_size).wait()
        want = torch.cat(
            [
                (torch.arange(rows * world_size * 4, dtype=torch.float32).reshape(rows * world_size, 4) + 1e6 * o)[
                    rows * rank : rows * (rank + 1)
                ]
                for o in range(world_size)
            ]
        )
        results.append(torch.equal(got, want))
        gens.append(t.shm._data_gen[rank])
    dist.barrier()
    # every data segment was unlinked once each peer had read it: nothing left behind for a crash to leak
    t.all_gather(torch.ones(1)).wait()
    dist.barrier()
    left = _mine_in_shm(pids)
    return t.active_path, after_setup, results, gens, left, t.pool_stats()


def test_shared_memory_is_chosen_on_one_host_grows_and_leaves_no_segment():
    for path, after_setup, results, gens, left, stats in run_ranks(_growth_and_lifecycle, 3, timeout=60):
        assert stats["allocations"] == gens[-1]  # one per growth: what a stall hunt counts
        assert stats["shm_bytes"] >= 70000 * 2 * 16  # the largest exchange's two outgoing blocks
        assert path == "shm"
        assert after_setup == []  # control segments are unlinked as soon as every peer has attached them
        assert all(results)
        assert gens[0] == 1 and gens[-1] == gens[-2] and gens[1] < gens[3], gens  # grows with the largest exchange
        assert left == [], left


def _forced_paths(rank, world_size, fake_other_host):
    from fscomm import TransportUnavailableError, get_transport, new_thread_group, shm

    if fake_other_host == "host" and rank == 1:
        shm._host_identity = lambda: ("elsewhere", "another-boot")
    if fake_other_host == "small-shm" and rank == 1:
        shm._free_bytes = lambda: 64 << 20
    tcp = get_transport("host-tcp", new_thread_group("tcp"))
    auto = get_transport("host", new_thread_group("auto"))
    with pytest.raises(ValueError, match="relay_cpu"):
        get_transport("host-shm", relay_cpu=True)
    try:
        forced = get_transport("host-shm", new_thread_group("forced")).active_path
    except TransportUnavailableError as exc:
        forced = str(exc)
    x = torch.arange(4) + 10 * rank
    out = [t.all_to_all(x, [2, 2], [2, 2]).wait().tolist() for t in (tcp, auto)]
    return tcp.active_path, auto.active_path, forced, out


@pytest.mark.parametrize("fake_other_host", [None, "host", "small-shm"])
def test_tcp_stays_selectable_and_ranks_on_other_hosts_use_it(fake_other_host):
    res = run_ranks(_forced_paths, 2, args=(fake_other_host,), timeout=60)
    for rank, (tcp, auto, forced, out) in enumerate(res):
        assert tcp == "tcp"
        assert auto == ("tcp" if fake_other_host else "shm")
        if fake_other_host == "host":
            assert "not all on one host" in forced and "elsewhere" in forced, forced
        elif fake_other_host == "small-shm":
            assert "less than 256 MiB free" in forced, forced
        else:
            assert forced == "shm"
        assert out[0] == out[1] == [2 * rank, 2 * rank + 1, 10 + 2 * rank, 10 + 2 * rank + 1]


def _peer_dies(rank, world_size):
    from fscomm import get_transport, new_thread_group
    from fscomm.shm import PeerLostError

    t = get_transport("host", new_thread_group("ids", timeout=datetime.timedelta(seconds=30)))
    pids = t.all_gather(torch.tensor([float(os.getpid())])).wait().view(-1).long().tolist()
    if rank == 1:
        # grown just before dying: its new data segment is still linked (peers have not read it yet)
        t.all_to_all(torch.ones(1 << 20, dtype=torch.uint8), [1 << 19] * 2, [1 << 19] * 2)
        time.sleep(0.5)
        os._exit(0)  # as a crash would: no clean-up runs
    time.sleep(1.0)
    x = torch.ones(1 << 20, dtype=torch.uint8)
    t.all_to_all(x, [1 << 19] * 2, [1 << 19] * 2).wait()  # the peer had published before dying
    t0 = time.monotonic()
    try:
        t.all_to_all(x, [1 << 19] * 2, [1 << 19] * 2).wait()
    except PeerLostError as exc:
        msg, took = str(exc), time.monotonic() - t0
    else:
        return "no error", 0.0, [], []
    from fscomm.shm import remove_segments_of

    # Only the dead peer's own segments: another job's start-up clean_stale may have removed them already.
    return msg, took, remove_segments_of([pids[1]]), _mine_in_shm({pids[1]})


def _run_rank0_only(fn, world_size: int, timeout: float):
    """Like run_ranks, for a test where the other ranks die on purpose: returns rank 0's result."""
    import pickle
    import queue
    import tempfile

    from tests import harness

    ctx = harness._context()
    stage_dir = tempfile.mkdtemp(prefix="fs-ranks-")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=harness._rank_main,
            daemon=True,
            args=(
                fn,
                r,
                world_size,
                (),
                stage_dir,
                os.path.join(stage_dir, "store"),
                timeout,
                "gloo",
                {"OMP_NUM_THREADS": "1"},
                results,
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            if rank == 0:
                return pickle.loads(payload)
    except queue.Empty:
        raise TimeoutError(f"{fn.__name__}: rank 0 did not finish within {timeout} s") from None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(stage_dir, ignore_errors=True)


def test_peer_that_dies_mid_exchange_ends_the_wait_with_a_named_error_and_its_segment_is_cleaned():
    msg, took, cleaned, left = _run_rank0_only(_peer_dies, 2, timeout=60)
    assert "all_to_all #2" in msg and "rank(s) [1]" in msg and "has ended" in msg, msg
    assert took < 5, took  # seen by the liveness check, well before the 30 s group timeout
    # the crash left at most its grown data segment (unless another job's start-up cleaned it first); none stays
    assert all(n.endswith("-1-d2") for n in cleaned) and len(cleaned) <= 1, cleaned
    assert left == [], left


def _idle_wait(rank, world_size):
    from fscomm import get_transport

    t = get_transport("host")
    t.all_gather(torch.ones(1)).wait()
    if rank == 1:
        time.sleep(1.5)
        return t.all_gather(torch.ones(1)).wait().tolist()
    h = t.all_gather(torch.ones(1))
    cpu0 = time.process_time()
    h.wait()  # about 1.5 s of waiting on the peer
    return time.process_time() - cpu0


def test_waiting_on_a_slow_peer_sleeps_instead_of_spinning():
    cpu_s = run_ranks(_idle_wait, 2, timeout=60)[0]
    assert cpu_s < 0.5, cpu_s  # a spinning wait would burn about 1.5 s of CPU


def test_segments_are_private_and_foreign_ones_refused(tmp_path):
    from fscomm.shm import Segment, ShmUnavailable

    path = str(tmp_path / "fscomm-1-tok-0-ctl")
    seg = Segment(path, 4096, create=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(ShmUnavailable, match="exists already"):
        Segment(path, 4096, create=True)  # a name someone pre-created is never adopted
    os.chmod(path, 0o644)
    with pytest.raises(ShmUnavailable, match="mode 0o644"):
        Segment(path, 4096, create=False)
    os.chmod(path, 0o600)
    with pytest.raises(ShmUnavailable, match="expected at least"):
        Segment(path, 8192, create=False)
    os.symlink(path, str(tmp_path / "link"))
    with pytest.raises(OSError):
        Segment(str(tmp_path / "link"), 4096, create=False)
    seg.close()
    assert not os.path.exists(path)
