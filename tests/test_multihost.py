"""Several hosts: the host transport's path per pair of ranks, and `freescale train --nnodes` on emulated hosts
(tests/harness_hosts.py: each host its own hostname, /dev/shm and process ids, on the machine's loopback).

2 hosts of 2 ranks train bit for bit as 1 host of 4, and 3 hosts of 1 rank as 1 host of 3, ranks in --node-rank
order; a lost host (every process of it killed at once) ends the others in one line naming it, within the
communication timeout, leaving no segment in any host's /dev/shm; hosts that do not meet end in one line naming the
endpoint, the node that never came and how many joined (docs/reliability.md, Multi-node); hosts on a network of their
own, rate-limited links to a bridge, train over it and leave no namespace or link."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import harness_hosts
from tests.harness import run_ranks
from tests.harness_hosts import free_port

pytestmark = pytest.mark.multiprocess
emulated_hosts = harness_hosts.emulated_hosts  # the fixture: hosts made per test, killed at its end

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TRAIN = (sys.executable, "-m", "pipelines.cli", "train", "--device", "cpu", "--model", "tiny", "--no-progress")


# --- the path per pair, hosts faked by their identity (one machine, real gloo groups) ------------------------


def _split_exchanges(rank, world_size, layout):
    from fscomm import get_transport, shm

    shm._host_identity = lambda: (f"host{layout[rank]}", "boot")  # the ranks' hosts as the transport sees them
    t = get_transport("host")
    if t.shm is not None:
        t.shm.host_copy_on_cpu = True  # a GPU rank's keep_host layout, on CPU tensors
    checks = []
    for it in range(3):  # uneven splits with zeros; unequal all_gather sizes; equal ones
        send = [(rank + d + it) % 3 for d in range(world_size)]
        recv = [(o + rank + it) % 3 for o in range(world_size)]
        x = torch.cat([torch.full((n, 2), 100 * rank + d, dtype=torch.int64) for d, n in enumerate(send)])
        handle = t.all_to_all(x, send, recv, keep_host=True)
        want = torch.cat([torch.full((n, 2), 100 * o + rank, dtype=torch.int64) for o, n in enumerate(recv)])
        checks.append(torch.equal(handle.wait(), want) and torch.equal(handle.host(), want))
        sizes = [(r + it) % 3 for r in range(world_size)]
        got = t.all_gather(torch.full((sizes[rank], 3), float(rank)), sizes).wait()
        checks.append(torch.equal(got, torch.cat([torch.full((n, 3), float(r)) for r, n in enumerate(sizes)])))
        same = t.all_gather(torch.tensor([rank, it])).wait()
        checks.append(torch.equal(same, torch.tensor([[r, it] for r in range(world_size)])))
    return t.active_path, t.pairs, checks


@pytest.mark.parametrize(
    "layout, path, pairs",
    [
        ([0, 0, 1, 1], "shm+tcp", {"shm_pairs": 2, "tcp_pairs": 4}),
        ([0, 1, 0], "shm+tcp", {"shm_pairs": 1, "tcp_pairs": 2}),  # rank 1 alone on its host: TCP for all it does
        ([0, 1, 2], "tcp", {"shm_pairs": 0, "tcp_pairs": 3}),
    ],
)
def test_ranks_of_one_host_share_memory_and_other_hosts_ranks_go_over_tcp_in_one_exchange(layout, path, pairs):
    for got_path, got_pairs, checks in run_ranks(_split_exchanges, len(layout), args=(layout,), timeout=90):
        assert (got_path, got_pairs) == (path, pairs)
        assert all(checks), checks


def _split_exchanges_on_a_gpu(rank, world_size, layout, devices):
    from fscomm import get_transport, shm

    shm._host_identity = lambda: (f"host{layout[rank]}", "boot")
    dev = torch.device(devices[rank])
    t = get_transport("host")
    checks = []
    for step, dtype in enumerate((torch.bfloat16, torch.int64, torch.bool, torch.float32)):
        rows = [
            [(s + 2 * d + step) % 4 * (40 if step == 3 else 1) for d in range(world_size)] for s in range(world_size)
        ]
        val = lambda s, d, n: (torch.arange(n * 3).reshape(n, 3) % 7 + 10 * s + d).to(dtype)  # noqa: E731
        x = torch.cat([val(rank, d, rows[rank][d]) for d in range(world_size)]).to(dev)
        keep = step % 2 == 0
        h = t.all_to_all(x, rows[rank], [rows[s][rank] for s in range(world_size)], keep_host=keep)
        y = val(rank, 9, 1 + rank).to(dev)
        g = t.all_gather(y, sizes=[1 + r for r in range(world_size)])
        del x, y  # the caller may drop its inputs at once
        want = torch.cat([val(s, rank, rows[s][rank]) for s in range(world_size)])
        got = h.wait()
        checks.append(torch.equal(got.cpu(), want) and (not keep or torch.equal(h.host(), want)))
        checks.append(torch.equal(g.wait().cpu(), torch.cat([val(s, 9, 1 + s) for s in range(world_size)])))
    torch.cuda.synchronize()
    pinned = t.shm._data[rank].tensor.is_pinned() if dev.type == "cuda" else None
    return t.active_path, checks, pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_split_exchange_on_gpu_ranks_stages_other_hosts_blocks_in_its_pinned_segment():
    devices = ("cuda", "cuda", "cuda", "cpu")  # 2 hosts: a GPU rank beside a GPU rank, a GPU rank beside a CPU rank
    results = run_ranks(_split_exchanges_on_a_gpu, 4, args=([0, 0, 1, 1], devices), timeout=240)
    for rank, (path, checks, pinned) in enumerate(results):
        assert path == "shm+tcp" and all(checks), (rank, checks)
        assert pinned is (True if devices[rank] == "cuda" else None), rank


# --- freescale train on emulated hosts ---------------------------------------------------------------------


def test_the_emulation_script_gives_each_host_its_name_and_its_own_dev_shm(emulated_hosts):
    script = ROOT / "scripts" / "emulate_hosts.py"
    command = "hostname; getent hosts fsnode1 | cut -f1 -d' '; touch /dev/shm/fs-probe-{index}; ls /dev/shm"
    proc = subprocess.run(
        [sys.executable, str(script), "--hosts", "2", "--", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for i in range(2):  # its name, the other host's address, and only its own file in its /dev/shm
        assert [line for line in proc.stdout.splitlines() if line.startswith(f"[fsnode{i}]")] == [
            f"[fsnode{i}] fsnode{i}",
            f"[fsnode{i}] 127.0.1.2",
            f"[fsnode{i}] fs-probe-{i}",
        ], proc.stdout
    assert sorted(proc.stderr.splitlines()) == [f"[fsnode{i}] left in its /dev/shm: fs-probe-{i}" for i in range(2)]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("fs-probe-")]  # the hosts' tmpfs went with them


def _node_argv(i: int, port: int, *extra: str, nnodes: int = 2, server: str = "fsnode0") -> list[str]:
    """Node ``i``'s command, node 0 on host ``server`` (serving the rendezvous there)."""
    return [*TRAIN, "--nnodes", str(nnodes), "--node-rank", str(i), "--rdzv-endpoint", f"{server}:{port}", *extra]


def _bad_lines(text: str) -> list[str]:
    """Lines of torch's own reports (tracebacks, C++ warnings and their frames, the agent's logs)."""
    pattern = re.compile(r"Traceback|^\[?[WE]\d{4}|^frame #|torch\.distributed|TCPStore|^\[rank\d+\]")
    return [line for line in text.splitlines() if pattern.search(line)]


def _loss_sums(metrics: Path) -> list[float]:
    return [json.loads(line)["loss_sum"] for line in metrics.read_text().splitlines() if '"loss_sum"' in line]


@pytest.mark.parametrize("mode, nnodes, nproc", [("freescale", 2, 2), ("sync", 3, 1)])
def test_hosts_train_bit_for_bit_as_one_host_of_as_many_ranks(emulated_hosts, tmp_path, mode, nnodes, nproc):
    """Losses and the reported loss sums alike (the sums are added in rank order, not in the backend's order). The
    nodes run on the hosts in the reverse of their names' order, which torch's rendezvous sorts by: the ranks
    follow --node-rank all the same (node 0 holds rank 0 and prints the summary)."""
    world = nnodes * nproc
    # the same intra-op threads per rank in both layouts: the default (cores / ranks on the host) gives a rank of a
    # 1-rank host more threads than one of 3 sharing the host, and ATen's CPU reductions split by thread (LayerNorm's
    # weight/bias gradients, softmax's backward) give other bits for another thread count
    common = ("--mode", mode, "--steps", "6", "--comm-timeout-s", "120", "--process.threads", "1")
    one = subprocess.run(
        [*TRAIN, "--nproc", str(world), *common, "--summary-json", "one.json", "--metrics-jsonl", "one.jsonl"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    hosts, port = emulated_hosts(nnodes), free_port()
    host_of = [nnodes - 1 - node for node in range(nnodes)]  # node 0 on the last host by name
    for node in range(nnodes):
        argv = _node_argv(node, port, "--nproc", str(nproc), *common, nnodes=nnodes, server=f"fsnode{host_of[0]}")
        argv += ["--summary-json", "many.json", "--metrics-jsonl", "many.jsonl"]
        hosts.start(host_of[node], argv, ENV, cwd=str(tmp_path))
    codes = hosts.wait_all(timeout=240)
    assert codes == dict.fromkeys(range(nnodes), 0), [hosts.output(i)[-2000:] for i in range(nnodes)]
    one_host, many_hosts = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "many"))
    assert many_hosts["world_size"] == world and many_hosts["steps"] == 6
    assert many_hosts["loss_curve"] == one_host["loss_curve"] and many_hosts["loss"] == one_host["loss"]
    sums = _loss_sums(tmp_path / "many.jsonl")
    assert len(sums) == 6 and sums == _loss_sums(tmp_path / "one.jsonl")
    paths = many_hosts["transport"]["host"]
    shm = nnodes * nproc * (nproc - 1) // 2  # the pairs of ranks that share a host
    tcp = world * (world - 1) // 2 - shm
    want = {"path": "shm+tcp" if shm else "tcp", "shm_pairs": shm, "tcp_pairs": tcp}
    assert paths and all(p == want for p in paths.values()), paths
    assert many_hosts["hosts"] == [f"fsnode{host_of[r // nproc]}" for r in range(world)]
    pairs = [[a, b] for a in range(world) for b in range(a + 1, world)]
    assert many_hosts["transport"]["pairs"] == {
        "shm": [p for p in pairs if p[0] // nproc == p[1] // nproc],
        "tcp": [p for p in pairs if p[0] // nproc != p[1] // nproc],
    }
    assert one_host["transport"]["pairs"] == {"shm": pairs, "tcp": []}
    ranks_of = "; ".join(f"fsnode{host_of[n]}: ranks {list(range(n * nproc, (n + 1) * nproc))}" for n in range(nnodes))
    summary = hosts.output(host_of[0])
    assert f"hosts            {ranks_of}\n" in summary
    assert all(p["path"] == "shm" for p in one_host["transport"]["host"].values())
    assert f"transport        host: {want['path']} ({shm} shm, {tcp} tcp pairs): " in summary
    assert all(hosts.output(host_of[n]).strip() == "" for n in range(1, nnodes))  # the summary is rank 0's, on node 0
    assert [hosts.left(i) for i in range(nnodes)] == [[]] * nnodes
    assert _bad_lines("".join(hosts.output(i) for i in range(nnodes))) == []


# after the command, what the host's tbf sent (the host's namespace and its links go with its last process)
_THEN_TBF_SENT = (
    "sh",
    "-c",
    '"$@"; code=$?; tc -s qdisc show dev eth0 | grep -o "Sent [0-9]* bytes"; exit $code',
    "sh",
)


def test_two_hosts_train_over_rate_limited_links_and_leave_no_namespace_or_link(emulated_hosts, tmp_path):
    hosts, port = emulated_hosts(2, rate="1gbit"), free_port()
    switch = hosts.network.switch
    common = ("--nproc", "2", "--steps", "4", "--comm-timeout-s", "60", "--summary-json", str(tmp_path / "s.json"))
    for i in range(2):
        hosts.start(i, [*_THEN_TBF_SENT, *_node_argv(i, port, *common)], ENV, cwd=str(tmp_path))
    codes = hosts.wait_all(timeout=120)
    assert codes == {0: 0, 1: 0}, [hosts.output(i)[-2000:] for i in range(2)]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 4
    paths = summary["transport"]["host"]
    assert paths and all(p == {"path": "shm+tcp", "shm_pairs": 2, "tcp_pairs": 4} for p in paths.values()), paths
    assert [hosts.left(i) for i in range(2)] == [[], []]
    for i in range(2):  # the ranks' traffic to the other host went through this host's limited link
        sent = re.fullmatch(r"Sent (\d+) bytes", hosts.hosts[i].lines()[-1])
        assert sent and int(sent.group(1)) > 100_000, hosts.output(i)[-2000:]
    hosts.close()
    assert switch not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not re.search(r"^\d+: (fsh\d|fse\d|fsbr)", links, re.MULTILINE), links


def _steps_done(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("lost", [1, 0], ids=["a-host", "the-store-host"])
def test_a_lost_host_ends_the_others_in_one_line_within_the_timeout_leaving_no_segment(emulated_hosts, tmp_path, lost):
    timeout_s = 20
    hosts, port = emulated_hosts(2), free_port()
    metrics = tmp_path / "metrics.jsonl"
    extra = ("--nproc", "2", "--steps", "400", "--comm-timeout-s", str(timeout_s), "--metrics-jsonl", str(metrics))
    for i in range(2):  # logs of their own: a failed job's temporary log folder stays, and a killed one's too
        hosts.start(i, _node_argv(i, port, *extra, "--log-dir", str(tmp_path / f"logs{i}")), ENV, cwd=str(tmp_path))
    deadline = time.monotonic() + 180
    while _steps_done(metrics) < 3:  # training is under way on every rank: rank 0 has written its third step
        assert time.monotonic() < deadline and all(h.proc.poll() is None for h in hosts.hosts.values()), [
            hosts.output(i)[-2000:] for i in range(2)
        ]
        time.sleep(0.2)
    hosts.kill(lost)
    survivor = 1 - lost
    code = hosts.wait(survivor, timeout=timeout_s + 30)
    took = time.monotonic() - hosts.hosts[lost].killed_at
    lines = hosts.hosts[survivor].lines()
    assert code == 1, lines
    assert took < timeout_s, (took, lines)  # the connections to the lost host closed: no timeout had to pass
    ranks, left = ([2, 3], [0, 1]) if lost == 1 else ([0, 1], [2, 3])
    how = "its launcher stopped answering" if lost == 1 else f"the rendezvous store it served at fsnode0:{port}"
    assert re.fullmatch(
        rf"freescale train: error: lost host fsnode{lost} \(node {lost}, ranks {re.escape(str(ranks))}\): {how}.*; "
        rf"this host's rank\(s\) {re.escape(str(left))} ended after it",
        lines[-1],
    ), lines
    others = [line for line in lines[:-1] if not line.startswith("[freescale] warning: the loader's item in flight")]
    assert others == [], lines  # the loader's warning on a failed exchange comes from the ranks' own unwinding
    assert hosts.left(survivor) == []  # the lost host's /dev/shm went with it
    assert _bad_lines(hosts.output(survivor)) == []


@pytest.mark.parametrize("nnodes, started", [(3, [0, 1]), (2, [1])], ids=["node-2-missing", "node-1-waits"])
def test_a_host_that_never_joins_is_one_line_naming_it_the_endpoint_and_who_came(
    emulated_hosts, tmp_path, nnodes, started
):
    hosts, port = emulated_hosts(nnodes), free_port()
    for i in started:
        argv = _node_argv(i, port, "--nproc", "1", "--comm-timeout-s", "4", nnodes=nnodes)
        hosts.start(i, [*argv, "--log-dir", str(tmp_path / f"logs{i}")], ENV, cwd=str(tmp_path))
    codes = hosts.wait_all(timeout=60)
    lines = {i: hosts.hosts[i].lines() for i in started}
    assert codes == dict.fromkeys(started, 1), lines
    endpoint = f"fsnode0:{port} \\(--rdzv-endpoint\\)"
    if nnodes == 3:  # the node whose timeout ran out first closed the rendezvous, the other found it closed
        missing = r"node 2 never joined \(no launcher with --node-rank 2 reached it, so no host is known for it\); "
        missing += r"2 of 3 node\(s\) joined \(node 0 on fsnode0, node 1 on fsnode1\)"
        why = r"( within 4 s \(--comm-timeout-s\):|: another host closed the rendezvous when its 4 s "
        why += r"\(--comm-timeout-s\) ran out;)"
        expected = dict.fromkeys(started, rf"the hosts did not meet at {endpoint}{why} {missing}")
    else:
        expected = {
            1: rf"no rendezvous answered at {endpoint} within 4 s \(--comm-timeout-s\): node 0, which serves it, "
            r"has not started .*; 1 of 2 node\(s\) came \(this one, fsnode1\)"
        }
    for i in started:
        assert len(lines[i]) == 1 and re.fullmatch(rf"freescale train: error: {expected[i]}", lines[i][0]), lines
        assert hosts.left(i) == []


def test_pairs_share_memory_on_one_host_unless_a_group_goes_over_tcp():
    from pipelines.job.run.summary import describe_pairs, pair_paths

    hosts = ["a", "a", "b"]
    shm = {"balancer": {"path": "shm+tcp"}, "id-prefetch": {"path": "shm+tcp"}}
    assert pair_paths(hosts, shm) == {"shm": [[0, 1]], "tcp": [[0, 2], [1, 2]]}
    assert pair_paths(hosts, {**shm, "embedding": {"path": "tcp"}}) == {"shm": [], "tcp": [[0, 1], [0, 2], [1, 2]]}
    assert describe_pairs(pair_paths(hosts, shm), most=1) == "shm 0-1; tcp 0-2 and 1 more"


def test_node_0_that_cannot_serve_the_endpoint_and_a_bad_node_config_are_one_line(tmp_path):
    import socket

    from pipelines.cli import build_parser
    from pipelines.job.config.flags import config_from_args

    for argv, message in (
        (["--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "a:1"], "--node-rank must be in 0..1 (--nnodes 2)"),
        (["--nnodes", "2", "--rdzv-endpoint", "a"], "--rdzv-endpoint must be HOST:PORT with a port in 1..65535"),
        (["--nnodes", "2", "--rdzv-endpoint", ":29515"], "--rdzv-endpoint ':29515' names no host: give node 0's"),
        (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            config_from_args(build_parser().parse_args(["train", *argv]))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = f"localhost:{port}"
        proc = subprocess.run(
            [*TRAIN, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc", "1", "--log-dir", str(tmp_path)],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"freescale train: error: node 0 cannot serve the rendezvous at {endpoint} (--rdzv-endpoint): The server "
        f"socket has failed to listen on any local network address. port: {port}, useIpv6: false, code: -98, name: "
        "EADDRINUSE, message: address already in use (is the port in use, or the address not this host's?)"
    ], proc.stderr
