"""Multi-host test harness: N emulated hosts on this Linux machine (scripts/emulate_hosts.py makes them).

    def test_two_hosts(emulated_hosts):                    # skips, with the reason, where namespaces cannot be made
        hosts = emulated_hosts(2)
        for i in range(2):
            hosts.start(i, ["freescale", "train", "--nnodes", "2", "--node-rank", str(i), ...])
        codes = hosts.wait_all(timeout=120)
        assert hosts.left(0) == []                         # what host 0's command left in its /dev/shm

Each host has its own hostname, its own /dev/shm (a tmpfs of its own) and its own process ids, and reaches the
others by name over the machine's loopback; ``emulated_hosts(n, rate="1gbit")`` gives them a network of their own
instead, each host's link limited to the rate both ways (scripts/emulate_hosts.py, ``--rate``; the test skips with
the reason where it cannot be made). ``kill(i)`` ends host i as a lost machine ends: every process of it at once
(SIGKILL to its init), with its /dev/shm. The fixture kills whatever still runs at the end of the test, so no host
outlives it; the kernel removes their tmpfs and namespaces with their last process, and the fixture the network.

Tests that start ranks on the hosts carry the ``multiprocess`` marker (tests/conftest.py fails one that does not).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_emulator():
    spec = importlib.util.spec_from_file_location("emulate_hosts", ROOT / "scripts" / "emulate_hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


emulator = _load_emulator()
_problems: dict[str, Optional[str]] = {}


def namespace_problem() -> Optional[str]:
    """Why hosts cannot be emulated here (asked once per test session), or None."""
    if "hosts" not in _problems:
        _problems["hosts"] = emulator.namespace_problem()
    return _problems["hosts"]


def network_problem() -> Optional[str]:
    """Why emulated hosts cannot get a rate-limited network here (asked once per test session), or None."""
    if "network" not in _problems:
        _problems["network"] = emulator.network_problem()
    return _problems["network"]


def free_port() -> int:
    """A loopback port free now, for a rendezvous endpoint (every emulated host shares the loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Host:
    """One emulated host's command: its process (``unshare``, whose child is the host's init) and its output."""

    def __init__(self, name: str, proc: subprocess.Popen, out_path: Path):
        self.name, self.proc, self.out_path = name, proc, out_path
        self.killed_at: Optional[float] = None

    @property
    def output(self) -> str:
        """What the host's command wrote to its stdout and stderr so far."""
        try:
            return self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def lines(self) -> list[str]:
        return [line for line in self.output.replace("\r", "\n").splitlines() if line.strip()]


class EmulatedHosts:
    """``n`` emulated hosts named fsnode0 .. fsnode{n-1}, on a network of ``rate`` when given (``network`` then
    names its switch namespace); made by the ``emulated_hosts`` fixture."""

    def __init__(self, n: int, work: Path, shm_size: str = emulator.SHM_SIZE, rate: Optional[str] = None):
        self.names = emulator.host_names(n)
        self.work = work
        self.shm_size = shm_size
        self.network = emulator.Network(rate) if rate is not None else None
        self.hosts_file = emulator.write_hosts_file(work, self.names, networked=self.network is not None)
        self.hosts: dict[int, Host] = {}

    def start(self, index: int, argv: Sequence[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> Host:
        """Starts ``argv`` on host ``index`` (at most one command per host at a time)."""
        if index in self.hosts and self.hosts[index].proc.poll() is None:
            raise RuntimeError(f"host {self.names[index]} still runs its command")
        name = self.names[index]
        out_path = self.work / f"{name}.out"
        report = self.work / f"{name}.{emulator.LEFT_REPORT}"
        report.unlink(missing_ok=True)
        with open(out_path, "wb") as out:
            proc = emulator.spawn_host(
                index,
                name,
                argv,
                self.hosts_file,
                self.work,
                self.shm_size,
                self.network,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.hosts[index] = Host(name, proc, out_path)
        return self.hosts[index]

    def kill(self, index: int) -> None:
        """Ends host ``index`` at once, every process of it (SIGKILL to ``unshare``: ``--kill-child`` kills the host's
        init, and with it the kernel kills the rest of its PID namespace)."""
        host = self.hosts[index]
        host.killed_at = time.monotonic()
        if host.proc.poll() is None:
            host.proc.kill()
        host.proc.wait()

    def wait(self, index: int, timeout: float) -> Optional[int]:
        """Host ``index``'s exit status, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.hosts[index].proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_all(self, timeout: float) -> dict[int, Optional[int]]:
        """Every started host's exit status (None: still running at the deadline, shared by all)."""
        deadline = time.monotonic() + timeout
        return {i: self.wait(i, max(0.0, deadline - time.monotonic())) for i in sorted(self.hosts)}

    def left(self, index: int) -> Optional[list[str]]:
        """What host ``index``'s command left in its /dev/shm when it ended (None: killed, or still running)."""
        report = self.work / f"{self.names[index]}.{emulator.LEFT_REPORT}"
        try:
            return json.loads(report.read_text())["left"]
        except (FileNotFoundError, ValueError):
            return None

    def output(self, index: int) -> str:
        return self.hosts[index].output

    def close(self) -> None:
        """Kills every host still running (a failed test's leftovers): none outlives the test; then removes the
        network, if any (its switch namespace, the bridge and every veth)."""
        for index, host in self.hosts.items():
            if host.proc.poll() is None:
                self.kill(index)
        if self.network is not None:
            self.network.close()


@pytest.fixture
def emulated_hosts():
    """A factory of emulated hosts: ``emulated_hosts(n)``, or ``emulated_hosts(n, rate="1gbit")`` on a network of
    their own; skips the test, with the reason, where namespaces (or, with a rate, the network) cannot be made (not
    root, no unshare, ip or tc, a container that refuses them). Every host is killed, and every network removed, at
    the end."""
    problem = namespace_problem()
    if problem:
        pytest.skip(problem)
    made: list[EmulatedHosts] = []
    work = Path(tempfile.mkdtemp(prefix="fs-hosts-"))

    def make(n: int, shm_size: str = emulator.SHM_SIZE, rate: Optional[str] = None) -> EmulatedHosts:
        if rate is not None and network_problem():
            pytest.skip(network_problem())
        sub = work / str(len(made))
        sub.mkdir()
        made.append(EmulatedHosts(n, sub, shm_size, rate))
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
        shutil.rmtree(work, ignore_errors=True)
