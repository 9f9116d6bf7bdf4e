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

In the command, ``{index}`` is the host's index (0 .. N-1), ``{host}`` its name and ``{hosts}`` the number of hosts.
Each output line is prefixed with the host's name; the exit status is the largest of the hosts'. Ctrl-C kills
every host. tests/harness_hosts.py drives the same hosts from Python (one process per host, kill one, read each
one's output).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

PREFIX = "fsnode"
SHM_SIZE = "2g"  # a limit, not a reservation: tmpfs takes pages as they are written
LEFT_REPORT = "left.json"


def host_names(n: int, prefix: str = PREFIX) -> list[str]:
    if not 1 <= n <= 254:
        raise ValueError(f"emulated hosts: 1 to 254 hosts (one loopback address each), got {n}")
    return [f"{prefix}{i}" for i in range(n)]


def host_address(index: int) -> str:
    """Host ``index``'s own loopback address."""
    return f"127.0.1.{index + 1}"


def namespace_problem() -> Optional[str]:
    """Why hosts cannot be emulated here, or None: ``unshare`` must exist and make the namespaces (as root)."""
    if sys.platform != "linux":
        return f"emulated hosts need Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "emulated hosts need util-linux's unshare and mount on PATH"
    if os.geteuid() != 0:
        return f"emulated hosts need root to make namespaces and mount a tmpfs (uid {os.geteuid()})"
    probe = subprocess.run(
        [*_unshare(), "sh", "-c", "hostname fsprobe && mount -t tmpfs -o size=1m fsprobe /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        said = " ".join((probe.stderr or probe.stdout).split())[:200]
        return f"unshare could not make a host's namespaces here (exit {probe.returncode}: {said})"
    return None


def _unshare() -> list[str]:
    return [
        "unshare",
        "--uts",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
    ]


def write_hosts_file(directory: Path, names: Sequence[str]) -> Path:
    """The /etc/hosts of every emulated host: localhost, and each host's name at its own loopback address."""
    path = directory / "hosts"
    lines = ["127.0.0.1\tlocalhost", *(f"{host_address(i)}\t{name}" for i, name in enumerate(names)), "::1\tlocalhost"]
    path.write_text("\n".join(lines) + "\n")
    return path


def host_argv(name: str, argv: Sequence[str], hosts_file: Path, report_dir: Path, shm_size: str = SHM_SIZE) -> list:
    """The command that runs ``argv`` on the emulated host ``name`` (its init is this script, ``--inside``)."""
    inside = [sys.executable, os.path.abspath(__file__), "--inside", name, "--hosts-file", str(hosts_file)]
    inside += ["--report-dir", str(report_dir), "--shm-size", shm_size, "--"]
    return [*_unshare(), *inside, *argv]


def substitute(argv: Sequence[str], index: int, name: str, n: int) -> list[str]:
    return [a.replace("{index}", str(index)).replace("{host}", name).replace("{hosts}", str(n)) for a in argv]


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


def run_inside(name: str, hosts_file: str, report_dir: str, shm_size: str, argv: Sequence[str]) -> int:
    """The host's init (pid 1 of its namespace): sets the host up, runs ``argv``, reaps every orphan the command
    leaves (as an init must), forwards SIGTERM / SIGINT / SIGHUP to the command, and writes what the command left
    in /dev/shm to ``<report_dir>/<name>.left.json`` before the host goes."""
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


def run_hosts(n: int, argv: Sequence[str], prefix: str = PREFIX, shm_size: str = SHM_SIZE) -> int:
    """``argv`` (with its placeholders) on ``n`` emulated hosts; the largest exit status, after every host ended."""
    names = host_names(n, prefix)
    work = Path(tempfile.mkdtemp(prefix="fs-hosts-"))
    procs: list[subprocess.Popen] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # a SIGTERM ends the hosts too, as Ctrl-C does
        signal.signal(sig, _raise_interrupt)
    try:
        hosts_file = write_hosts_file(work, names)
        for i, name in enumerate(names):
            cmd = host_argv(name, substitute(argv, i, name, n), hosts_file, work, shm_size)
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            )
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
    finally:
        for p in procs:  # unshare --kill-child: the host's init, and with it every process of the host, goes too
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="emulate_hosts.py",
        description="Run a command on N emulated hosts of this machine (root; {index}, {host}, {hosts} in it).",
    )
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--prefix", default=PREFIX, help=f"host names: PREFIX0, PREFIX1, ... (default {PREFIX})")
    parser.add_argument("--shm-size", default=SHM_SIZE, help=f"each host's /dev/shm size (default {SHM_SIZE})")
    parser.add_argument("--inside", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--hosts-file", help=argparse.SUPPRESS)
    parser.add_argument("--report-dir", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run on every host")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    if args.inside:
        return run_inside(args.inside, args.hosts_file, args.report_dir, args.shm_size, command)
    if args.hosts < 1:
        parser.error(f"--hosts must be >= 1, got {args.hosts}")
    problem = namespace_problem()
    if problem:
        print(f"emulate_hosts.py: error: {problem}", file=sys.stderr)
        return 2
    return run_hosts(args.hosts, command, args.prefix, args.shm_size)


if __name__ == "__main__":
    sys.exit(main())
