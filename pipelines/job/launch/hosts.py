"""The hosts of a multi-node `freescale train` job as their launchers see them: a board at the rendezvous store.

torch's elastic agent on each host meets the others at ``--rdzv-endpoint`` (the c10d rendezvous) and runs the local
ranks. When a host is lost, the ranks of the others only see their connections to it close: each rank's error names
the ranks that did not take part, never the host, and a rank the agent stopped names nothing. So each launcher keeps
a record on the rendezvous store (:class:`HostBoard`): its host name, node rank, global ranks and a beat counter
advanced every ``BEAT_S``, and, once its agent has returned, how it ended. A launcher whose own ranks failed only
after their peers (no rank of its own is the root cause) reads the board: a host that posted a failure is named with
its line; a host whose beat stopped for ``LOST_AFTER_S`` is lost, named with its ranks; the store not answering
means node 0, which serves it, is lost.

Node 0's launcher serves the store itself (:class:`ServedStore`; torch's agent joins it as a client), so the store
outlives the agent by the moments the other hosts need: it waits until every other host has posted its end or is
lost (``linger``), and their agents' closing of the rendezvous still finds the store.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

PREFIX = "freescale/nodes"
BEAT_S = 0.5
LOST_AFTER_S = 2.0  # four beats missed: the launcher (and its host) is gone; an ending one beats until it returns
LINGER_S = 10.0  # at most this long, node 0 keeps the store up for the other hosts to end


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class ServedStore:
    """The rendezvous store at ``endpoint``, served by node 0's launcher for the job's whole life."""

    def __init__(self, endpoint: str, timeout_s: float):
        host, port = split_endpoint(endpoint)
        try:
            self.store = dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, ValueError) as exc:
            said = " ".join(str(exc).split())[:200]
            raise RendezvousFailed(
                f"node 0 cannot serve the rendezvous at {endpoint} (--rdzv-endpoint): {said} (is the port in use, or "
                "the address not this host's?)"
            ) from None

    def close(self) -> None:
        self.store = None


class RendezvousFailed(RuntimeError):
    """The hosts did not meet; the message is the one line the user sees."""


def wait_for_endpoint(endpoint: str, nnodes: int, timeout_s: float) -> None:
    """Waits until the rendezvous store at ``endpoint`` accepts connections (node 0 has started), at most
    ``timeout_s``; a plain socket, so that a store not yet served costs no C++ client's retries, each of which
    torch's store client prints with its stack trace."""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                said = exc.strerror or type(exc).__name__
                raise RendezvousFailed(
                    f"no rendezvous answered at {endpoint} (--rdzv-endpoint) within {timeout_s:g} s "
                    f"(--comm-timeout-s): node 0, which serves it, has not started or the address is not its own "
                    f"({said}); 1 of {nnodes} node(s) came (this one, {socket.gethostname()})"
                ) from None
        time.sleep(BEAT_S)


def rank_offset(endpoint: str, node_rank: int, timeout_s: float) -> int:
    """The global rank of local rank 0 on node ``node_rank``: the ranks of the nodes before it come first, so ranks
    follow ``--node-rank`` (node 0 holds rank 0), whatever order torch's rendezvous put the hosts in. Read by each
    rank from the launchers' records on the rendezvous store (each posts its ``--nproc``)."""
    host, port = split_endpoint(endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    keys = [f"{PREFIX}/{node}" for node in range(node_rank)]
    try:
        store.wait(keys)
    except RuntimeError:  # the store's own timeout: a launcher of a node before this one never posted
        missing = [node for node, key in enumerate(keys) if not store.check([key])]
        raise ValueError(
            f"node(s) {missing} posted no record at {endpoint} (--rdzv-endpoint) within {timeout_s:g} s "
            "(--comm-timeout-s), though the hosts met: is some --node-rank given to two hosts?"
        ) from None
    return sum(json.loads(store.get(key))["nproc"] for key in keys)


@dataclass
class NodeRecord:
    node: int
    host: str
    ranks: list[int]
    beat: int
    nproc: int = 0  # its local ranks (--nproc): the ranks of later nodes come after them (rank_offset)
    ended: Optional[str] = None  # "ok", or the host's failure line
    root: bool = False  # its failure began on this host (not only after peers elsewhere)
    changed_at: float = 0.0  # when this launcher last saw its beat advance (its own clock)

    def named(self) -> str:
        ranks = f", ranks {self.ranks}" if self.ranks else ""
        return f"host {self.host} (node {self.node}{ranks})"


class HostBoard:
    """This launcher's record on the rendezvous store, posted every ``BEAT_S`` by a thread, and the others' as read.
    The first post comes as the launcher starts, before any rank of the job does: every rank finds the records of
    the nodes before its own (rank_offset waits for them, at most the communication timeout).

    ``ranks``: called at every beat, this host's global ranks (known once they have started)."""

    def __init__(self, endpoint: str, nnodes: int, node_rank: int, nproc: int, timeout_s: float, ranks):
        self.endpoint, self.nnodes, self.node_rank, self.nproc = endpoint, nnodes, node_rank, nproc
        self.timeout_s = timeout_s
        self.host = socket.gethostname()
        self._ranks = ranks
        self._store: Optional[dist.TCPStore] = None
        self._beat = 0
        self._ended: Optional[str] = None
        self._root = False
        self.joined: Optional[int] = None  # launchers that reached the store, as last read
        self.seen: dict[int, NodeRecord] = {}
        self.unreachable_since: Optional[float] = None  # the store stopped answering (node 0 lost)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freescale-node-board", daemon=True)

    def start(self) -> "HostBoard":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def _key(self, node: int) -> str:
        return f"{PREFIX}/{node}"

    def _connect(self) -> bool:
        host, port = split_endpoint(self.endpoint)
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                self._store = dist.TCPStore(
                    host, port, is_master=False, timeout=datetime.timedelta(seconds=min(5.0, self.timeout_s))
                )
                self.joined = self._store.add(f"{PREFIX}/joined", 1)
                return True
            except (RuntimeError, ValueError):  # not served yet (node 0 not started): try again
                self._stop.wait(BEAT_S)
        return False

    def _run(self) -> None:
        if not self._connect():
            return
        while self.unreachable_since is None:  # a store gone stays gone: no more calls (each prints a C++ warning)
            self._post()
            self._read()
            if self._stop.wait(BEAT_S):
                self._post()  # the end, if one was set after the last beat
                return

    def _post(self) -> None:
        try:
            ranks = sorted(self._ranks())
        except Exception:
            ranks = []
        with self._lock:
            self._beat += 1
            record = {
                "node": self.node_rank,
                "host": self.host,
                "ranks": ranks,
                "beat": self._beat,
                "nproc": self.nproc,
            }
            record.update(ended=self._ended, root=self._root)
        try:
            self._store.set(self._key(self.node_rank), json.dumps(record))
        except Exception:  # the store is gone with node 0
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()

    def _read(self) -> None:
        now = time.monotonic()
        if self.unreachable_since is not None:
            return
        try:
            self.joined = self._store.add(f"{PREFIX}/joined", 0)
            for node in range(self.nnodes):
                if node == self.node_rank or not self._store.check([self._key(node)]):
                    continue
                fields = json.loads(self._store.get(self._key(node)))
                record = NodeRecord(**fields, changed_at=now)
                with self._lock:
                    old = self.seen.get(node)
                    if old is not None and old.beat == record.beat:
                        record.changed_at = old.changed_at
                    self.seen[node] = record
            self.unreachable_since = None
        except Exception:
            if self.unreachable_since is None:
                self.unreachable_since = now

    # --- what the launcher asks ---------------------------------------------------------------------------

    def post_end(self, how: str, root: bool = False) -> None:
        """``how``: "ok", or this host's failure line (``root``: the failure began here), for the other hosts'
        launchers; posted at the next beat and at :meth:`close`."""
        with self._lock:
            self._ended, self._root = how, root

    def others(self) -> dict[int, Optional[NodeRecord]]:
        with self._lock:
            return {n: self.seen.get(n) for n in range(self.nnodes) if n != self.node_rank}

    def verdict(self) -> tuple[Optional[str], Optional[str]]:
        """After this host's ranks failed: (the hosts lost, a failure that began on another host), each a clause or
        None. Waits until one is known, at most ``LOST_AFTER_S`` and two beats (a silent host counts as lost only
        after that long without a beat)."""
        deadline = time.monotonic() + LOST_AFTER_S + 2 * BEAT_S
        while True:
            now = time.monotonic()
            if self.unreachable_since is not None:
                return self._store_lost(), None
            records = [r for r in self.others().values() if r is not None]
            lost = [r for r in records if r.ended is None and now - r.changed_at > LOST_AFTER_S]
            if lost:
                names = "; ".join(r.named() for r in lost)
                whose = "its launcher" if len(lost) == 1 else "their launchers"
                return f"lost {names}: {whose} stopped answering at the rendezvous {self.endpoint}", None
            failed = [r for r in records if r.ended not in (None, "ok") and r.root]
            if failed:
                first = min(failed, key=lambda r: r.node)
                return None, f"{first.named()} failed: {first.ended}"
            if now >= deadline:
                return None, None
            time.sleep(BEAT_S / 4)

    def _store_lost(self) -> str:
        zero = self.seen.get(0)
        who = zero.named() if zero is not None else "node 0"
        return f"lost {who}: the rendezvous store it served at {self.endpoint} stopped answering"

    def linger(self) -> None:
        """Node 0: keeps the store up until every other host has posted its end or is lost (at most ``LINGER_S``)."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            records = self.others()
            if all(r is None or r.ended is not None or now - r.changed_at > LOST_AFTER_S for r in records.values()):
                return
            time.sleep(BEAT_S / 2)

    def joined_line(self) -> str:
        """How many hosts reached the rendezvous, and which, for a rendezvous that timed out; first the nodes that
        never came, by number (no launcher of theirs posted a record, so their hosts are unknown)."""
        count = self.joined if self.joined is not None else 0
        others = self.others()
        hosts = sorted([(self.node_rank, self.host)] + [(r.node, r.host) for r in others.values() if r])
        came = ", ".join(f"node {n} on {h}" for n, h in hosts) if self.joined is not None else "none reached its store"
        joined = f"{count} of {self.nnodes} node(s) joined ({came})"
        missing = [n for n, r in others.items() if r is None]
        if self.joined is None or not missing:
            return joined
        which = f"node {missing[0]}" if len(missing) == 1 else f"nodes {missing}"
        flags = " or ".join(f"--node-rank {n}" for n in missing)
        return f"{which} never joined (no launcher with {flags} reached it, so no host is known for it); {joined}"
