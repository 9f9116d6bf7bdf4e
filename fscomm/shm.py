"""The host transport's shared-memory path, between ranks of one host: no socket, no host copy on a GPU rank.

Split by locality: when a group's ranks are on several hosts and some host holds two or more of them (``connect``
with ``split``), each exchange goes through shared memory between the ranks of each host (``local``) and over gloo
point-to-point (the group's TCP pairs) between ranks of different hosts (``remote``), in one exchange: a rank
publishes its blocks for its host's peers, posts its sends to and receives from the other hosts' ranks, reads its
peers' blocks while those travel, then waits for them. On a GPU rank the blocks to other hosts are copied into its own
(pinned) segment and those from other hosts land in a receiving area of it, so gloo only ever touches host memory.
The ranks of each host are told apart by host name and boot id, gathered once when the transport is made.

Each rank owns one data segment (POSIX shared memory) where it publishes what it sends; its peers copy their
blocks straight out of it. On a GPU rank the segments are CUDA-registered (pinned), so an exchange is one
device-to-host copy into its own segment, the peers' reads, and one host-to-device copy out of each peer's
segment, all on a copy stream (the copy engines: no kernel). A CPU rank does the same with two host copies.

Control: each rank also owns a small control segment of counters that its peers poll: ``ready`` (the exchange
whose blocks are published), ``done`` (the last exchange whose blocks this rank has finished reading), the
data segment's generation and capacity, and a table of (offset, bytes) per destination. A rank republishes only
once every peer is ``done`` with its previous exchange. Waits sleep between polls (tens to hundreds of
microseconds), releasing the GIL, and end with a named error when the group timeout passes, when a peer's
process has gone, or when a peer closed its transport.

Lifecycle and safety: segments are created by their owner with O_EXCL and mode 0600 under names carrying the
owner's pid and a random token agreed through the process group (other users cannot guess or pre-create them);
a segment found with another owner, another mode or a wrong token is refused. Control segments are unlinked as
soon as every peer has attached; a data segment as soon as every peer has read from it once, so a crash leaves
nothing behind, except in that short window (and the last grown data segment, linked until the exchange after
it): the launchers (`freescale train`, the benches' local ranks) unlink the segments of their ranks' pids once
the ranks have exited, whatever ended them (``remove_segments_of``), and the next start unlinks segments of this
user whose owner process is gone (``clean_stale``: what a job under torchrun leaves). Data segments grow (new
generation) to the largest exchange seen.
"""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import socket
import stat
import time
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fscomm import groups
from fscomm.host_relay import RelayHandle
from fscomm.transport import CollectiveError, Handle, TransportUnavailableError, as_bytes, diagnose
from fscomm.worker import helper_event, worker_for

SHM_DIR = "/dev/shm"
PREFIX = "fscomm-"
# control slots (int64): magic (2), ready, done, generation, capacity, pid, closed, then (offset, bytes) x W
_READY, _DONE, _GEN, _CAP, _PID, _CLOSED, _TABLE = 2, 3, 4, 5, 6, 7, 8
_FAILED = 2  # in _CLOSED: the rank's exchange failed (a peer elsewhere was lost): its peers here stop waiting for it
_SLEEP_MIN_S, _SLEEP_MAX_S = 2e-5, 2e-4
_LIVENESS_EVERY_S = 0.05
_MIN_DATA, _PAGE = 1 << 16, 4096
MIN_FREE_BYTES = 256 << 20  # below this, "host" keeps to TCP: exchanges would soon outgrow the segments


class ShmUnavailable(TransportUnavailableError):
    """The ranks of the group cannot share memory (other hosts, no /dev/shm, a refused segment)."""


class PeerLostError(CollectiveError):
    """A peer's process ended, or it closed its transport, while this rank waited on it."""

    # It follows another rank's failure: the launcher names that rank as the cause (pipelines.job.launch.failure).
    root = False


# --- segments -------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has crashed already
    except (OSError, IndexError):
        return True


def _owner(name: str) -> Optional[str]:
    """The owner pid in a segment's name (``fscomm-<pid>-...``), None for another file."""
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX) :].split("-")[0]
    return pid if pid.isdigit() else None


def _unlink_segments(shm_dir: str, dead_owner: Callable[[str], bool]) -> list[str]:
    """Unlinks this user's fscomm segments whose owner ``dead_owner(pid)`` says to remove; returns their names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        owner = _owner(name)
        if owner is None or not dead_owner(owner):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    return removed


def clean_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks this user's fscomm segments whose owner process is gone (what a crash left); returns their names."""
    return _unlink_segments(shm_dir, lambda pid: not _pid_alive(int(pid)))


def remove_segments_of(pids: Sequence[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks this user's fscomm segments owned by ``pids`` whose process has ended; returns their names.

    For a launcher once its ranks have exited: a rank that dies (killed, or ended by the launcher after a peer
    failed) runs no clean-up, and its segments would stay until some later start's ``clean_stale``. A pid
    that is alive again (reused) is left alone."""
    wanted = {str(p) for p in pids if not _pid_alive(int(p))}
    return _unlink_segments(shm_dir, lambda pid: pid in wanted)


def remove_own_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks this process's own segments; returns their names. For a rank that ends at once on a signal
    (``os._exit``, no transport closed): its peers are ending too, and mapped pages stay valid once unlinked."""
    me = str(os.getpid())
    return _unlink_segments(shm_dir, lambda pid: pid == me)


# Fault injection, for the tests of the launchers' clean-up: FSCOMM_SHM_FAULT=POINT:RANK kills rank RANK (of the
# world) with SIGKILL at POINT of the segments' life cycle, where a crash would leave them linked: "created" (its
# control segment made, no peer attached yet), "mapped" (the peers' segments attached, its own not yet unlinked),
# "exchange" (its first data segment published, before any peer read it).
FAULT_ENV = "FSCOMM_SHM_FAULT"
FAULT_POINTS = ("created", "mapped", "exchange")


def _fault_at() -> Optional[str]:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    point, _, rank = spec.partition(":")
    if point not in FAULT_POINTS or not rank.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected POINT:RANK with POINT one of {', '.join(FAULT_POINTS)}")
    return point if dist.is_initialized() and dist.get_rank() == int(rank) else None


def _maybe_fail(fault: Optional[str], point: str) -> None:
    if fault == point:
        os.kill(os.getpid(), signal.SIGKILL)


class Segment:
    """One mapped shared-memory file: ``tensor`` (uint8) over all of it; pinned for CUDA on request."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as exc:
            raise ShmUnavailable(
                f"shared-memory segment {path} exists already (pre-created by someone else?); refused"
            ) from exc
        try:
            if create:
                os.fchmod(fd, 0o600)  # whatever the umask
                try:  # reserve the pages now: a full tmpfs is an error here, not a SIGBUS at the first write
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    os.unlink(path)
                    raise ShmUnavailable(
                        f"cannot reserve {nbytes} bytes of shared memory for {path} ({exc}); "
                        f"{os.path.dirname(path)} is too small for this exchange"
                    ) from exc
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
                raise ShmUnavailable(
                    f"shared-memory segment {path} has owner uid {st.st_uid} and mode {oct(stat.S_IMODE(st.st_mode))}; "
                    f"only uid {os.getuid()} with mode 0o600 is accepted"
                )
            if st.st_size < nbytes:
                raise ShmUnavailable(f"shared-memory segment {path} has {st.st_size} bytes, expected at least {nbytes}")
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.nbytes, self.linked = path, nbytes, create
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.cuda_registered = False
        self.pin_refused = False

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def pin(self) -> None:
        """Registers the pages with CUDA (page-locked: copies to and from them run on the copy engines, async).
        Where the driver refuses, the copies still work, through the driver's own buffers and slower: warned once."""
        if not self.cuda_registered and not self.pin_refused:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 1)  # portable: any device
            if int(err) != 0:
                self.pin_refused = True
                warnings.warn(
                    f"fscomm: cudaHostRegister of shared-memory segment {self.path} failed (CUDA error "
                    f"{int(err)}); its copies run unpinned, synchronously and slower"
                )
                return
            self.cuda_registered = True

    def close(self) -> None:
        self.unlink()
        if self.cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.cuda_registered = False
        self.tensor = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


_LINGER_S = 5.0  # at most this long, a closing rank waits for its peers to read its last exchange


def _close_all(segments: list, ctl: np.ndarray, peers: list, linger_s: float) -> None:
    """Finalizer: tells the peers this rank is gone, then unlinks and unmaps what it holds.

    A data segment still linked holds an exchange that a peer may not have mapped yet (a rank's wait returns once
    it has read its peers, not once they have read it): unlinked now, the peer's read would find no segment. So
    the rank first waits, at most ``linger_s``, until every peer (``peers``: (control array, pid)) that is alive and
    has not closed has finished reading its last published exchange."""
    try:
        last = int(ctl[_READY])
        if last >= 0 and any(seg.linked and seg.path.rsplit("-", 1)[1].startswith("d") for seg in segments):
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and any(
                c[_DONE] < last and not c[_CLOSED] and _pid_alive(pid) for c, pid in peers
            ):
                time.sleep(1e-3)
    except Exception:
        pass
    try:
        ctl[_CLOSED] = 1
    except Exception:
        pass
    for seg in segments:
        try:
            seg.unlink()
        except Exception:
            pass


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _host_identity() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


# --- the exchange ---------------------------------------------------------------------------------------


class ShmExchange:
    """The shared-memory exchange of one group's ranks. Made collectively by ``connect``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        token: str,
        pids: Sequence[int],
        ctl_segs: list[Optional[Segment]],
        hosts: Sequence[tuple],
    ):
        """``hosts``: each rank's host (its name, boot id and user: ranks with the same share memory); ``ctl_segs``
        holds the control segments of this host's ranks (None for the others)."""
        self.group = group
        self.state = groups.group_state(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.token, self.pids = token, list(pids)
        self.hosts = list(hosts)
        self.local = [r for r in range(self.world_size) if self.hosts[r] == self.hosts[self.rank]]
        self.remote = [r for r in range(self.world_size) if r not in self.local]
        self._peers = [r for r in self.local if r != self.rank]
        self._ctl_segs = ctl_segs
        self._ctl = [np.frombuffer(s.mm, dtype=np.int64) if s is not None else None for s in ctl_segs]
        self._mine = self._ctl[self.rank]
        self._data: list[Optional[Segment]] = [None] * self.world_size  # mine, and peers' as mapped
        self._data_gen = [0] * self.world_size
        self._unlink_after: Optional[int] = None  # my newest data segment: unlinked once peers are done with this
        self._seq = 0
        self.host_copy_on_cpu = False  # CPU tests: run a GPU rank's keep_host layout on CPU tensors
        self.allocations = 0  # data segments this rank has made (one per growth)
        self._broken: Optional[BaseException] = None
        self._streams: dict[int, "torch.cuda.Stream"] = {}
        self._fault: Optional[str] = None  # a fault-injection point (FSCOMM_SHM_FAULT), tests only
        self._finalizer = self._make_finalizer()

    def _make_finalizer(self) -> weakref.finalize:
        peers = [(self._ctl[p], self.pids[p]) for p in self._peers]
        linger_s = min(_LINGER_S, self.state.timeout_s)
        return weakref.finalize(self, _close_all, self._owned(), self._mine, peers, linger_s)

    def _owned(self) -> list:
        own = [s for s in self._ctl_segs if s is not None and s.linked]
        return own + ([self._data[self.rank]] if self._data[self.rank] else [])

    @classmethod
    def connect(cls, group: dist.ProcessGroup, required: bool, split: bool = False) -> Optional["ShmExchange"]:
        """Collective on ``group``: the exchange when every rank is on this host and can map the others'
        segments; with ``split``, also when the ranks are on several hosts and some host holds two or more (shared
        memory within each host, gloo point-to-point across). None (or ShmUnavailable if ``required``) otherwise,
        on every rank alike."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        me = (
            *_host_identity(),
            os.getuid(),
            os.getpid(),
            _free_bytes() >= MIN_FREE_BYTES,
            secrets.token_hex(16) if rank == 0 else None,
        )
        everyone: list = [None] * world  # the one gather of the ranks' hosts, at set-up
        dist.all_gather_object(everyone, me, group=group)
        token = everyone[0][5]
        pids = [e[3] for e in everyone]
        hosts = [tuple(e[:3]) for e in everyone]
        local = [r for r in range(world) if hosts[r] == hosts[rank]]
        if len(local) < world:
            if not split:
                names = sorted({h[0] for h in hosts})
                return cls._refuse(required, f"the group's ranks are not all on one host ({names})")
            if len(set(hosts)) == world:
                return None  # no two ranks share a host: every pair goes over TCP
        if not all(e[4] for e in everyone):
            return cls._refuse(
                required,
                f"{SHM_DIR} is missing or has less than {MIN_FREE_BYTES >> 20} MiB free "
                "(a container's default of 64 MiB is too small: raise its --shm-size)",
            )
        clean_stale()
        fault = _fault_at()
        n_ctl = max(4096, 8 * (_TABLE + 2 * world))
        name = lambda r: os.path.join(SHM_DIR, f"{PREFIX}{pids[r]}-{token}-{r}-ctl")
        segs: list[Optional[Segment]] = [None] * world
        error = None
        try:
            segs[rank] = Segment(name(rank), n_ctl, create=True)
            ctl = np.frombuffer(segs[rank].mm, dtype=np.int64)
            ctl[:2] = np.frombuffer(bytes.fromhex(token), dtype=np.int64)
            ctl[_READY] = ctl[_DONE] = -1
            ctl[_PID] = os.getpid()
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        _maybe_fail(fault, "created")
        errors: list = [None] * world
        dist.all_gather_object(errors, error, group=group)
        if error is None and not any(errors):
            for r in local:
                if r == rank:
                    continue
                try:
                    segs[r] = Segment(name(r), n_ctl, create=False)
                    magic = np.frombuffer(segs[r].mm, dtype=np.int64)[:2].tobytes().hex()
                    if magic != token:
                        raise ShmUnavailable(f"segment {name(r)} does not carry the group's token; refused")
                except Exception as exc:
                    error = f"rank {rank} attaching rank {r}'s segment: {exc}"
                    break
            _maybe_fail(fault, "mapped")
            dist.all_gather_object(errors, error, group=group)  # every peer has attached mine (or failed)
        if segs[rank] is not None:
            segs[rank].unlink()
        if any(errors):
            for s in segs:
                if s is not None:
                    s.close()
            return cls._refuse(required, "; ".join(e for e in errors if e))
        exchange = cls(group, token, pids, segs, hosts)
        exchange._fault = fault
        return exchange

    def pairs(self) -> dict[str, int]:
        """The group's pairs of ranks by path: ``shm_pairs`` on one host, ``tcp_pairs`` across hosts."""
        counts: dict[tuple, int] = {}
        for host in self.hosts:
            counts[host] = counts.get(host, 0) + 1
        shm = sum(n * (n - 1) // 2 for n in counts.values())
        return {"shm_pairs": shm, "tcp_pairs": self.world_size * (self.world_size - 1) // 2 - shm}

    @staticmethod
    def _refuse(required: bool, why: str) -> None:
        if required:
            raise ShmUnavailable(f"shared-memory host path unavailable: {why}")
        return None

    def capacity(self) -> int:
        """Bytes of this rank's data segment (0 before the first exchange)."""
        seg = self._data[self.rank]
        return seg.nbytes if seg is not None else 0

    def close(self) -> None:
        """Tells the peers this rank has left (their waits fail at once), unlinks and unmaps the segments."""
        self._finalizer()
        for s in self._ctl_segs + self._data:
            if s is not None:
                s.close()

    # --- collectives (called by HostTransport after validation) ---------------------------------------

    def all_to_all(
        self,
        op: str,
        seq: int,
        x: torch.Tensor,
        out: torch.Tensor,
        send_b: list[int],
        recv_b: list[int],
        keep_host: bool,
    ) -> Handle:
        W, me, cuda = self.world_size, self.rank, x.is_cuda
        xb, ob = as_bytes(x), as_bytes(out)
        s_off, r_off = np.concatenate([[0], np.cumsum(send_b)]), np.concatenate([[0], np.cumsum(recv_b)])
        # the own block goes through the segment too, for the host copy (on CPU only when tests ask for the layout)
        host_copy = keep_host and (cuda or self.host_copy_on_cpu)
        plan = _Plan(table=[(0, 0)] * W, host_copy=host_copy)
        for d in range(W):
            block = xb[s_off[d] : s_off[d + 1]]
            if d in self.remote:
                plan.send(d, block, cuda)
            elif d != me or host_copy:
                plan.table[d] = (plan.publish_nbytes, send_b[d])
                plan.put(block)
        if not host_copy:
            plan.local.append((xb[s_off[me] : s_off[me + 1]], ob[r_off[me] : r_off[me + 1]]))
        plan.reads = [(o, ob[r_off[o] : r_off[o + 1]]) for o in self.local if o != me or host_copy]
        for o in self.remote:
            plan.receive(o, ob[r_off[o] : r_off[o + 1]], cuda)
        return self._submit(op, seq, x, out, plan)

    def all_gather(self, op: str, seq: int, x: torch.Tensor, out: torch.Tensor, pieces: list[slice]) -> Handle:
        """``pieces[r]``: rank r's bytes in ``out``'s bytes."""
        xb, ob = as_bytes(x), as_bytes(out)
        plan = _Plan(table=[(0, xb.numel())] * self.world_size)
        plan.put(xb)
        plan.local = [(xb, ob[pieces[self.rank]])]
        plan.reads = [(o, ob[pieces[o]]) for o in self._peers]
        for o in self.remote:
            plan.sends.append((o, (0, xb.numel()) if x.is_cuda else xb))  # on a GPU rank: from its copy in the segment
            plan.receive(o, ob[pieces[o]], x.is_cuda)
        return self._submit(op, seq, x, out, plan)

    # --- one exchange -----------------------------------------------------------------------------------

    def _submit(self, op: str, seq: int, x: torch.Tensor, out: torch.Tensor, plan: "_Plan") -> Handle:
        if self._broken is not None:
            raise CollectiveError(
                f"fscomm {op} #{seq} on group {self.state.name!r}: the shared-memory path "
                f"failed earlier and cannot be used again ({self._broken})"
            )
        cuda = x.is_cuda
        ready = None
        copied_back = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
            copied_back = helper_event()
        host_future: Optional[Future] = Future() if plan.host_copy else None
        k = self._seq
        self._seq += 1
        held = [x]  # the input lives until its bytes are published and sent (the caller may drop it at once)

        def job() -> torch.Tensor:
            try:
                return self._run(op, seq, k, held, out, plan, ready, copied_back, host_future)
            except BaseException as exc:
                self._broken = exc
                self._mine[_CLOSED] = _FAILED  # this host's peers waiting on this exchange fail now, not at timeout
                err = exc if isinstance(exc, CollectiveError) else diagnose(self.state, op, seq, exc)
                if host_future is not None and not host_future.done():
                    host_future.set_exception(err)
                if err is exc:
                    raise
                raise err from exc

        return RelayHandle(worker_for(self.state).submit(job), copied_back, x.device, host_future)

    def _copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = torch.cuda.Stream(device=idx)
        return self._streams[idx]

    def _run(self, op, seq, k, held, out, plan: "_Plan", ready, copied_back, host_future) -> torch.Tensor:
        me = self.rank
        cuda = ready is not None
        what = f"{op} #{seq}"
        # 1. every peer has finished reading my previous exchange: my segment may be rewritten
        self._wait(lambda p: self._ctl[p][_DONE] >= k - 1, what, "to finish reading the previous exchange")
        if self._unlink_after is not None and self._unlink_after < k:
            self._data[me].unlink()  # every peer has mapped it by now
            self._unlink_after = None
        seg = self._own_data(plan.publish_nbytes + plan.recv_nbytes, k, cuda)
        for d, (off, n) in enumerate(plan.table):
            self._mine[_TABLE + 2 * d] = off
            self._mine[_TABLE + 2 * d + 1] = n
        # 2. publish; then the own block, straight into the result, while the peers read
        if cuda:
            stream = self._copy_stream(out.device)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                for src, off in plan.publish:
                    if src.numel():
                        seg.tensor[off : off + src.numel()].copy_(src, non_blocking=True)
                published = helper_event()
                published.record(stream)
                for src, dst in plan.local:
                    if src.numel():
                        dst.copy_(src, non_blocking=True)
            published.synchronize()
            self._mine[_READY] = k
            _maybe_fail(self._fault, "exchange")
        else:
            for src, off in plan.publish:
                if src.numel():
                    seg.tensor[off : off + src.numel()].copy_(src)
            self._mine[_READY] = k
            _maybe_fail(self._fault, "exchange")
            for src, dst in plan.local:
                if src.numel():
                    dst.copy_(src)
        # 3. the other hosts' ranks: their sends and receives posted now, completed while this host's peers are read
        works = post_pairs(self.group, plan.pair_sends(seg), plan.pair_recvs(seg), tag=k & 0x7FFFFFFF)
        # 4. read each peer's block as soon as it is published, then take what came from the other hosts
        host_parts = self._read_peers(k, plan.reads, stream if cuda else None, what)
        for work in works:
            work.wait()
        for src, dst in plan.arrived(seg):  # on a GPU rank, from the receiving area; on CPU they landed in place
            if cuda and src.numel():
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            host_parts.append((src, dst))
        if host_future is not None:  # the bytes as they arrived, read on the host (no device sync for the caller)
            host_future.set_result(_host_copy(out, host_parts))
        if cuda:
            copied_back.record(stream)
            copied_back.synchronize()  # the peers may rewrite their segments once I say done
        held.clear()  # x was read until here (own block, sends); the allocator may now hand its memory out
        self._mine[_DONE] = k
        return out

    def _read_peers(self, k: int, reads: list, stream: Optional["torch.cuda.Stream"], what: str) -> list:
        """Copies each of this host's peers' blocks of exchange ``k`` as soon as it is published (on ``stream``
        for a GPU rank); returns the (source, destination) pairs it copied."""
        pending = dict(reads)
        parts = []
        while pending:
            posted = [o for o in pending if self._ctl[o][_READY] >= k]
            if not posted:
                self._wait(
                    lambda p: p not in pending or self._ctl[p][_READY] >= k,
                    what,
                    "to publish its blocks",
                    only=list(pending),
                    any_of=True,
                )
                continue
            for o in posted:
                dst = pending.pop(o)
                src = self._peer_block(o, dst.numel(), stream is not None, what)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        if src.numel():
                            dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src)
                parts.append((src, dst))
        return parts

    def _own_data(self, nbytes: int, k: int, cuda: bool) -> Segment:
        """My data segment, grown (a new generation, the old one dropped) when the exchange outgrows it."""
        me = self.rank
        seg = self._data[me]
        if seg is None and nbytes == 0 and not self._peers:
            return None  # alone on its host, on CPU: every block goes straight over TCP
        if seg is None or seg.nbytes < nbytes:
            cap = max(nbytes, 2 * seg.nbytes if seg is not None else 0)
            cap = max(_MIN_DATA, (cap + _PAGE - 1) // _PAGE * _PAGE)
            gen = self._data_gen[me] + 1
            new = Segment(os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{self.token}-{me}-d{gen}"), cap, create=True)
            if seg is not None:
                seg.close()
            self._data[me], self._data_gen[me] = new, gen
            self.allocations += 1
            self._finalizer.detach()
            self._finalizer = self._make_finalizer()
            self._mine[_CAP] = cap
            self._mine[_GEN] = gen
            self._unlink_after = k
            seg = new
        if cuda:
            seg.pin()
        return seg

    def _peer_block(self, o: int, nbytes: int, cuda: bool, what: str) -> torch.Tensor:
        ctl = self._ctl[o]
        off, n = int(ctl[_TABLE + 2 * self.rank]), int(ctl[_TABLE + 2 * self.rank + 1])
        if n != nbytes:
            raise ValueError(
                f"fscomm {what} on rank {self.rank}: rank {o} sends {n} bytes here but {nbytes} "
                "were expected (recv_splits / sizes disagree with the sender)"
            )
        gen = int(ctl[_GEN])
        if self._data_gen[o] != gen:
            if self._data[o] is not None:
                self._data[o].close()
                self._data[o] = None
            path = os.path.join(SHM_DIR, f"{PREFIX}{self.pids[o]}-{self.token}-{o}-d{gen}")
            try:
                self._data[o], self._data_gen[o] = Segment(path, int(ctl[_CAP]), create=False), gen
            except FileNotFoundError:  # its owner closed (or died) before this rank mapped it
                how = _closed_how(ctl) if ctl[_CLOSED] else f"removed its segment {path}"
                raise PeerLostError(
                    f"fscomm {what} on group {self.state.name!r} failed on rank {self.rank} of {self.world_size}: "
                    f"rank(s) [{o}] of the group {how} before this rank had read its blocks (shared-memory path)"
                ) from None
        seg = self._data[o]
        if cuda:
            seg.pin()
        return seg.tensor[off : off + n]

    def _wait(
        self, ok: Callable[[int], bool], what: str, doing: str, only: Optional[list[int]] = None, any_of: bool = False
    ) -> None:
        """Sleeps between polls until ``ok(peer)`` holds for every peer (or for one, ``any_of``); a named error
        on timeout, on a peer's process gone, or on a peer that closed its transport."""
        peers = only if only is not None else self._peers
        start = time.monotonic()
        deadline = start + self.state.timeout_s
        next_check = start + _LIVENESS_EVERY_S
        delay = _SLEEP_MIN_S
        while True:
            missing = [p for p in peers if not ok(p)]
            if not missing or (any_of and len(missing) < len(peers)):
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                for p in missing:
                    if self._ctl[p][_CLOSED]:
                        raise PeerLostError(self._message(what, p, _closed_how(self._ctl[p]), doing))
                    if not _pid_alive(self.pids[p]):
                        raise PeerLostError(self._message(what, p, f"process {self.pids[p]} has ended", doing))
                if now >= deadline:
                    raise CollectiveError(
                        f"fscomm {what} on group {self.state.name!r} timed out on rank {self.rank} of "
                        f"{self.world_size} (group timeout {self.state.timeout_s:.1f} s): rank(s) {missing} did not "
                        f"come {doing} (shared-memory path)"
                    )
            time.sleep(delay)
            delay = min(2 * delay, _SLEEP_MAX_S)

    def _message(self, what: str, peer: int, how: str, doing: str) -> str:
        return (
            f"fscomm {what} on group {self.state.name!r} failed on rank {self.rank} of {self.world_size}: "
            f"rank(s) [{peer}] of the group {how} while this rank waited for it {doing} (shared-memory path)"
        )


def _host_copy(out: torch.Tensor, parts: list) -> torch.Tensor:
    """A host tensor shaped like ``out`` holding what arrived: each (host source, destination in ``out``) pair."""
    host_out = torch.empty(out.shape, dtype=out.dtype)
    base, hb = as_bytes(out).data_ptr(), as_bytes(host_out)
    for src, dst in parts:
        start = dst.data_ptr() - base
        hb[start : start + src.numel()].copy_(src)
    return host_out


def _closed_how(ctl: np.ndarray) -> str:
    if ctl[_CLOSED] == _FAILED:
        return "failed its part of an exchange (with a rank that failed or was lost)"
    return "closed its transport"


# --- one exchange's layout, and its pairs across hosts ----------------------------------------------------


@dataclass
class _Plan:
    """Where one exchange's bytes go. ``publish``: (source, offset) copies into this rank's segment before it says
    ready; ``table``: per rank of this host, the (offset, bytes) of its block there; ``local``: (source, destination)
    copies of the own block; ``reads``: (peer, destination) blocks read from this host's peers' segments;
    ``sends``: (rank of another host, source bytes, or (offset, bytes) in this segment on a GPU rank);
    ``recvs``: (rank of another host, destination bytes, offset in the segment's receiving area or None: received in
    place on a CPU rank)."""

    table: list
    host_copy: bool = False
    publish: list = field(default_factory=list)
    publish_nbytes: int = 0
    local: list = field(default_factory=list)
    reads: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    recv_nbytes: int = 0

    def put(self, block: torch.Tensor) -> int:
        """``block`` copied into the segment at the next offset; returns it."""
        off = self.publish_nbytes
        self.publish.append((block, off))
        self.publish_nbytes += block.numel()
        return off

    def send(self, rank: int, block: torch.Tensor, cuda: bool) -> None:
        self.sends.append((rank, (self.put(block), block.numel()) if cuda else block))

    def receive(self, rank: int, dst: torch.Tensor, cuda: bool) -> None:
        self.recvs.append((rank, dst, self.recv_nbytes if cuda else None))
        if cuda:
            self.recv_nbytes += dst.numel()

    def pair_sends(self, seg: Optional[Segment]) -> list:
        return [(r, seg.tensor[src[0] : src[0] + src[1]] if isinstance(src, tuple) else src) for r, src in self.sends]

    def pair_recvs(self, seg: Optional[Segment]) -> list:
        return [(r, dst if off is None else self._received(seg, off, dst)) for r, dst, off in self.recvs]

    def arrived(self, seg: Optional[Segment]) -> list:
        """(where the bytes arrived, their destination) per rank of another host."""
        return [(dst if off is None else self._received(seg, off, dst), dst) for _, dst, off in self.recvs]

    def _received(self, seg: Segment, off: int, dst: torch.Tensor) -> torch.Tensor:
        start = self.publish_nbytes + off
        return seg.tensor[start : start + dst.numel()]


def post_pairs(group: dist.ProcessGroup, sends: list, recvs: list, tag: int) -> list:
    """Posts gloo's point-to-point sends and receives of one exchange with the ranks of other hosts (group ranks),
    all at once (async: gloo's threads move them while the caller reads its own host's peers); returns their works.
    A block of zero bytes is not sent: both ends know its size."""
    works = [dist.irecv(buf, group=group, group_src=r, tag=tag) for r, buf in recvs if buf.numel()]
    return works + [dist.isend(buf, group=group, group_dst=r, tag=tag) for r, buf in sends if buf.numel()]
