"""Runs a command on N emulated hosts of this Linux machine, for multi-host tests without a second machine.

    python scripts/emulate_hosts.py --hosts 2 -- \\
        freescale train --nnodes 2 --node-rank {index} --rdzv-endpoint fsnode0:29400 --nproc 2 --device cpu

Each host is a set of namespaces made by ``unshare`` (root only): its own hostname (UTS), its own mounts with
private propagation, in which a tmpfs of its own is mounted on /dev/shm and a hosts file naming every emulated
host is bound over /etc/hosts, and its own process ids (a PID namespace with its own /proc). The network is the
machine's loopback, shared: host i has the loopback address 127.0.1.(i+1) (Linux answers on all of 127/8), so the
hosts reach one another by name, each one's name resolves to an address of its own both ways (torch's rendezvous
tells nodes apart by their fully qualified name and process id, and process ids repeat across PID namespaces),
and nothing leaves the machine.
What one host writes in /dev/shm the others cannot see, so fscomm's shared-memory path sees them as the separate
hosts they pretend to be, and a rank's process id is one of its host's.

Why a PID namespace: killing a host is then exact. The host's first process (this script, ``--inside``) is its
init; when it dies, the kernel kills every process of the host at once, as a lost machine would end them, and
``unshare --kill-child`` takes it down when ``unshare`` itself is killed. The tmpfs goes with the host's mount
namespace, so nothing is left on the machine; before a host that ends normally goes, its init writes what its
command left in its /dev/shm to a report (the tests check that it is nothing).

A network of their own, rate-limited (``--rate 1gbit``, optional ``--burst`` and ``--latency``): each host also gets
its own network namespace, joined to the others' by a veth pair to a Linux bridge in a namespace this script makes
(``fs-switch-<pid>-<k>``, the switch). Host i has the address 10.78.0.(i+1)/24 on its ``eth0`` and its own
loopback, and the hosts file names those addresses. A tbf qdisc limits the host's egress on its ``eth0`` and the
switch's egress toward it, so both what a host sends and what it receives run at the rate, as a machine's NIC
would; ranks of one host still reach one another over their host's own loopback, unlimited. Every veth is made in
the switch namespace and its host end moved into the host's namespace, so nothing of it is ever in the machine's
own: deleting the switch namespace at the end (also on Ctrl-C or an error) removes the bridge and every veth, and
a host's namespace goes with its last process. A host's init starts its command only once the parent has set its
network up (a byte on a pipe; the pipe closing first ends the host). Needs ``ip``, ``tc`` and ``nsenter``.

In the command, ``{index}`` is the host's index (0 .. N-1), ``{host}`` its name and ``{hosts}`` the number of hosts.
Each output line is prefixed with the host's name; the exit status is the largest of the hosts'. Ctrl-C kills
every host. tests/harness_hosts.py drives the same hosts from Python (one process per host, kill one, read each
one's output).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

PREFIX = "fsnode"
SHM_SIZE = "2g"  # a limit, not a reservation: tmpfs takes pages as they are written
LEFT_REPORT = "left.json"
SUBNET = "10.78.0"  # host i is SUBNET.(i+1)/24 on an emulated network; nothing outside its namespaces sees it
LATENCY = "50ms"  # tbf: how long a packet may wait for tokens before it is dropped (TCP then backs off)
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}  # tc's units: decimal
SWITCH_PREFIX = "fs-switch-"  # then the making process's id and a count: fs-switch-<pid>-<k>
_switches = itertools.count()


def host_names(n: int, prefix: str = PREFIX) -> list[str]:
    if not 1 <= n <= 254:
        raise ValueError(f"emulated hosts: 1 to 254 hosts (one loopback address each), got {n}")
    return [f"{prefix}{i}" for i in range(n)]


def host_address(index: int, networked: bool = False) -> str:
    """Host ``index``'s own address: on the machine's loopback, or on the emulated network."""
    return f"{SUBNET}.{index + 1}" if networked else f"127.0.1.{index + 1}"


def parse_rate(text: str) -> int:
    """A tc rate (``100mbit``, ``1gbit``, ``2.5gbit``) in bits per second."""
    match = _RATE.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--rate must be a positive rate in bit, kbit, mbit, gbit or tbit (e.g. 1gbit), got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def default_burst(rate_bits: int) -> int:
    """tbf's bucket: 2 ms at the rate (256 KB at 1 gbit), at least 64 KiB so that a whole GSO packet of the veth
    fits (a bucket smaller than one packet would never pass it)."""
    return max(64 << 10, rate_bits // 8 // 500)


def namespace_problem() -> Optional[str]:
    """Why hosts cannot be emulated here, or None: ``unshare`` must exist and make the namespaces (as root)."""
    if sys.platform != "linux":
        return f"emulated hosts need Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "emulated hosts need util-linux's unshare and mount on PATH"
    if os.geteuid() != 0:
        return f"emulated hosts need root to make namespaces and mount a tmpfs (uid {os.geteuid()})"
    return _probe(
        [*_unshare(), "sh", "-c", "hostname fsprobe && mount -t tmpfs -o size=1m fsprobe /dev/shm"],
        "unshare could not make a host's namespaces here",
    )


def _probe(argv: list[str], failure: str) -> Optional[str]:
    """None if ``argv`` succeeds; else ``failure`` with its exit status and what it said, in one line."""
    probe = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        said = " ".join((probe.stderr or probe.stdout).split())[:200]
        return f"{failure} (exit {probe.returncode}: {said})"
    return None


def network_problem() -> Optional[str]:
    """Why hosts cannot get a rate-limited network here, or None: ``ip``, ``tc`` and ``nsenter``, root, and a
    kernel that makes network namespaces, bridges, veth pairs and tbf qdiscs (probed in a namespace of its own)."""
    problem = namespace_problem()
    if problem:
        return problem
    missing = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"emulated networks (--rate) need {', '.join(missing)} on PATH (iproute2, util-linux)"
    return _probe(
        [
            "unshare",
            "--net",
            "sh",
            "-c",
            "ip link add fsprobe0 type bridge && ip link add fsprobe1 type veth peer name fsprobe2 && "
            "ip link set fsprobe1 master fsprobe0 && tc qdisc add dev fsprobe1 root tbf rate 1gbit burst 256kb "
            f"latency {LATENCY}",
        ],
        "no bridge, veth or tbf in a network namespace here, for --rate",
    )


def _unshare(net: bool = False) -> list[str]:
    return [
        "unshare",
        *(["--net"] if net else []),
        "--uts",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
    ]


def write_hosts_file(directory: Path, names: Sequence[str], networked: bool = False) -> Path:
    """The /etc/hosts of every emulated host: localhost, and each host's name at its own address."""
    path = directory / "hosts"
    named = (f"{host_address(i, networked)}\t{name}" for i, name in enumerate(names))
    lines = ["127.0.0.1\tlocalhost", *named, "::1\tlocalhost"]
    path.write_text("\n".join(lines) + "\n")
    return path


def host_argv(
    name: str,
    argv: Sequence[str],
    hosts_file: Path,
    report_dir: Path,
    shm_size: str = SHM_SIZE,
    net_ready_fd: Optional[int] = None,
) -> list:
    """The command that runs ``argv`` on the emulated host ``name`` (its init is this script, ``--inside``); with
    ``net_ready_fd`` (a pipe's read end, passed to it) in a network namespace of its own, whose init waits for a
    byte on that pipe (``Network.attach`` has set the network up) before it starts ``argv``."""
    inside = [sys.executable, os.path.abspath(__file__), "--inside", name, "--hosts-file", str(hosts_file)]
    inside += ["--report-dir", str(report_dir), "--shm-size", shm_size]
    if net_ready_fd is not None:
        inside += ["--net-ready-fd", str(net_ready_fd)]
    return [*_unshare(net=net_ready_fd is not None), *inside, "--", *argv]


def spawn_host(
    index: int,
    name: str,
    argv: Sequence[str],
    hosts_file: Path,
    report_dir: Path,
    shm_size: str = SHM_SIZE,
    network: Optional["Network"] = None,
    **popen: object,
) -> subprocess.Popen:
    """Starts ``argv`` on emulated host ``index`` (``popen``: Popen's keywords); on a ``network``, joins the host to
    it before its init may start ``argv``. If that fails the host is killed and the error raised."""
    if network is None:
        return subprocess.Popen(host_argv(name, argv, hosts_file, report_dir, shm_size), **popen)
    read_end, write_end = os.pipe()
    try:
        cmd = host_argv(name, argv, hosts_file, report_dir, shm_size, net_ready_fd=read_end)
        proc = subprocess.Popen(cmd, pass_fds=(read_end,), **popen)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        network.attach(index, proc.pid)
        os.write(write_end, b"1")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        os.close(write_end)
    return proc


def substitute(argv: Sequence[str], index: int, name: str, n: int) -> list[str]:
    return [a.replace("{index}", str(index)).replace("{host}", name).replace("{hosts}", str(n)) for a in argv]


class Network:
    """The hosts' network: a switch namespace holding a bridge, and per host a veth pair from the bridge to the
    host's own network namespace, tbf-limited both ways. ``close`` (idempotent) deletes the switch namespace, and
    with it the bridge and every veth; a host's namespace goes with its last process."""

    def __init__(self, rate: str, burst: Optional[str] = None, latency: str = LATENCY):
        self.rate_bits = parse_rate(rate)
        self.tbf = ["tbf", "rate", f"{self.rate_bits}bit", "burst", burst or str(default_burst(self.rate_bits))]
        self.tbf += ["latency", latency]
        remove_stale_switches()
        self.switch = f"{SWITCH_PREFIX}{os.getpid()}-{next(_switches)}"
        _ip("netns", "add", self.switch)
        try:
            _batch(["ip", "-n", self.switch], ["link set lo up", "link add fsbr type bridge", "link set fsbr up"])
        except BaseException:
            self.close()
            raise

    def attach(self, index: int, pid: int, timeout: float = 10.0) -> None:
        """Joins host ``index`` to the switch: ``pid`` is its ``unshare`` process, which enters the host's network
        namespace (unshare(2) moves the caller itself) before it starts the host's init."""
        ns = f"/proc/{pid}/ns/net"
        deadline = time.monotonic() + timeout
        own = os.stat("/proc/self/ns/net").st_ino
        while True:  # until unshare has made the namespace: a veth moved before that would land in the machine's
            try:
                if os.stat(ns).st_ino != own:
                    break
            except FileNotFoundError:
                raise RuntimeError(f"emulated host {index}: its unshare ended before its network was set up") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"emulated host {index}: no network namespace after {timeout:.0f} s")
            time.sleep(0.002)
        port, end = f"fsh{index}", f"fse{index}"
        sw = ["ip", "-n", self.switch]
        subprocess.run([*sw, "link", "del", port], capture_output=True)  # a restarted host's old link, if still there
        _batch(sw, [f"link add {port} type veth peer name {end}", f"link set {port} master fsbr"])
        _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *self.tbf], "--rate/--burst/--latency")
        _batch(sw, [f"link set {port} up", f"link set {end} netns {pid}"])
        inside = ["nsenter", f"--net={ns}"]
        address = host_address(index, networked=True)
        _batch(
            [*inside, "ip"],
            ["link set lo up", f"link set {end} name eth0", f"addr add {address}/24 dev eth0", "link set eth0 up"],
        )
        _run([*inside, "tc", "qdisc", "add", "dev", "eth0", "root", *self.tbf], "--rate/--burst/--latency")

    def close(self) -> None:
        if self.switch is not None:
            subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
            self.switch = None


def switches() -> list[str]:
    """The switch namespaces of emulated networks on this machine (``ip netns list``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listed if name.startswith(SWITCH_PREFIX)]


def remove_stale_switches() -> None:
    """Deletes the switch namespaces whose maker is gone (a killed script or test leaves its switch, which no
    clean-up of its own could remove); a switch whose maker still runs is someone else's network, in use."""
    for name in switches():
        pid = name[len(SWITCH_PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _run(cmd: list[str], flags: str = "") -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        said = " ".join((proc.stderr or proc.stdout).split())[:200]
        raise RuntimeError(f"emulated network: {' '.join(cmd)} failed{f' ({flags})' if flags else ''}: {said}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _batch(prefix: list[str], lines: list[str]) -> None:
    """Several ``ip`` commands in one process (``ip -batch``)."""
    proc = subprocess.run([*prefix, "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    if proc.returncode != 0:
        said = " ".join((proc.stderr or proc.stdout).split())[:200]
        raise RuntimeError(f"emulated network: {' '.join(prefix)} {'; '.join(lines)} failed: {said}")


# --- inside a host: its init ------------------------------------------------------------------------------


def _set_up_host(name: str, hosts_file: str, shm_size: str) -> None:
    socket.sethostname(name)
    for cmd in (
        ["mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", f"{name}-shm", "/dev/shm"],
        ["mount", "--bind", hosts_file, "/etc/hosts"],
    ):
        subprocess.run(cmd, check=True)


def _left_in_shm() -> list[str]:
    return sorted(os.listdir("/dev/shm"))


def run_inside(
    name: str, hosts_file: str, report_dir: str, shm_size: str, argv: Sequence[str], net_ready_fd: Optional[int] = None
) -> int:
    """The host's init (pid 1 of its namespace): waits for its network (with ``net_ready_fd``), sets the host up,
    runs ``argv``, reaps every orphan the command leaves (as an init must), forwards SIGTERM / SIGINT / SIGHUP to
    the command, and writes what the command left in /dev/shm to ``<report_dir>/<name>.left.json`` before the
    host goes."""
    if net_ready_fd is not None:
        ready = os.read(net_ready_fd, 1)
        os.close(net_ready_fd)
        if not ready:  # the parent closed the pipe without a byte: its network could not be made
            print(f"emulated host {name}: its network was not set up; the command does not run", file=sys.stderr)
            return 1
    _set_up_host(name, hosts_file, shm_size)
    child = subprocess.Popen(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    status = None
    while status is None:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(raw)
    (Path(report_dir) / f"{name}.{LEFT_REPORT}").write_text(json.dumps({"host": name, "left": _left_in_shm()}))
    code = status if status is not None else 1
    return code if code >= 0 else 128 - code


# --- the command line -------------------------------------------------------------------------------------


def _pump(stream, name: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(f"[{name}] ".encode() + line)
        sys.stdout.buffer.flush()


def _raise_interrupt(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the hosts' clean-up below runs to its end
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_hosts(
    n: int,
    argv: Sequence[str],
    prefix: str = PREFIX,
    shm_size: str = SHM_SIZE,
    rate: Optional[str] = None,
    burst: Optional[str] = None,
    latency: str = LATENCY,
) -> int:
    """``argv`` (with its placeholders) on ``n`` emulated hosts, on a network of ``rate`` when given; the largest
    exit status, after every host ended (2 with one line when the network cannot be made)."""
    names = host_names(n, prefix)
    work = Path(tempfile.mkdtemp(prefix="fs-hosts-"))
    procs: list[subprocess.Popen] = []
    network: Optional[Network] = None
    for sig in (signal.SIGTERM, signal.SIGINT):  # a SIGTERM ends the hosts too, as Ctrl-C does
        signal.signal(sig, _raise_interrupt)
    try:
        if rate is not None:
            network = Network(rate, burst, latency)
        hosts_file = write_hosts_file(work, names, networked=network is not None)
        for i, name in enumerate(names):
            out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(spawn_host(i, name, substitute(argv, i, name, n), hosts_file, work, shm_size, network, **out))
        pumps = [threading.Thread(target=_pump, args=(p.stdout, name), daemon=True) for p, name in zip(procs, names)]
        for t in pumps:
            t.start()
        codes = [p.wait() for p in procs]
        for t in pumps:
            t.join()
        for name in names:
            report = work / f"{name}.{LEFT_REPORT}"
            left = json.loads(report.read_text())["left"] if report.exists() else None
            if left:
                print(f"[{name}] left in its /dev/shm: {', '.join(left)}", file=sys.stderr)
        return max(codes)
    except KeyboardInterrupt:
        return 130  # the hosts are killed below
    except (RuntimeError, ValueError) as error:  # the network could not be made: one line, the hosts go below
        print(f"emulate_hosts.py: error: {error}", file=sys.stderr)
        return 2
    finally:
        for p in procs:  # unshare --kill-child: the host's init, and with it every process of the host, goes too
            if p.poll() is None:
                p.kill()
                p.wait()
        if network is not None:
            network.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="emulate_hosts.py",
        description="Run a command on N emulated hosts of this machine (root; {index}, {host}, {hosts} in it).",
    )
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--prefix", default=PREFIX, help=f"host names: PREFIX0, PREFIX1, ... (default {PREFIX})")
    parser.add_argument("--shm-size", default=SHM_SIZE, help=f"each host's /dev/shm size (default {SHM_SIZE})")
    parser.add_argument(
        "--rate",
        help="give the hosts a network of their own, each host's link limited to RATE both ways (tc's units: "
        "100mbit, 1gbit, 10gbit); without it the hosts share the machine's loopback, unlimited",
    )
    parser.add_argument("--burst", help="with --rate: tbf's bucket in bytes or tc's units (default 2 ms at the rate)")
    parser.add_argument(
        "--latency", default=LATENCY, help=f"with --rate: tbf's queue limit in time (default {LATENCY})"
    )
    parser.add_argument("--inside", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--net-ready-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hosts-file", help=argparse.SUPPRESS)
    parser.add_argument("--report-dir", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run on every host")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    if args.inside:
        return run_inside(args.inside, args.hosts_file, args.report_dir, args.shm_size, command, args.net_ready_fd)
    if args.hosts < 1:
        parser.error(f"--hosts must be >= 1, got {args.hosts}")
    if args.rate is not None:
        try:
            parse_rate(args.rate)
        except ValueError as error:
            parser.error(str(error))
    elif args.burst is not None:
        parser.error("--burst needs --rate")
    problem = namespace_problem() if args.rate is None else network_problem()
    if problem:
        print(f"emulate_hosts.py: error: {problem}", file=sys.stderr)
        return 2
    return run_hosts(args.hosts, command, args.prefix, args.shm_size, args.rate, args.burst, args.latency)


if __name__ == "__main__":
    sys.exit(main())
