"""`python -m benchmarks multihost`: the host transport's mixed path (shared memory within a host, TCP across
hosts: `host`) against TCP for every pair (`host-tcp`), on emulated hosts whose links are rate-limited
(scripts/emulate_hosts.py ``--rate``; root on Linux, with ip and tc).

Per layout (HOSTSxRANKS: 2x2 has same-host pairs, 4x1 none, where the two must cost the same) and link rate:
(a) all_to_all, `python -m benchmarks transport` under torchrun on the hosts with ``--backends host,host-tcp``:
    both in one run, interleaved repetition by repetition, rank 0's median. SIZE is what each rank sends in total
    (its all_to_all input, the world's blocks of SIZE / world bytes, its own block included); GB/s is SIZE over
    the median time. Repeated ``--a2a-runs`` times (fresh hosts each run); the table gives the median of the runs'
    medians and of their mixed/TCP time ratios.
(b) end to end, `freescale train --device cpu` with ``--transport host`` and ``--transport host-tcp``, alternated
    A B, B A, ... for ``--train-runs`` pairs: the median samples/s of each and of the pairs' ratios, with the
    paths the summary says each transport took.

Every run starts fresh hosts (a fresh network namespace each) on the layout's network; the network goes when the
layout is done, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from benchmarks.launch import write_json

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("host", "host-tcp")  # mixed (shm+tcp), every pair on TCP
SIZES = [1 << 20, 32 << 20]
PORT = 29400  # each host is a fresh network namespace: every port is free in it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    parser.add_argument("--rates", default="1gbit", help="comma-separated link rates (tc's units), one network each")
    parser.add_argument("--layouts", default="2x2,4x1", help="comma-separated HOSTSxRANKS (ranks per host)")
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in SIZES), help="all_to_all bytes each rank sends in total"
    )
    parser.add_argument("--a2a-reps", type=int, default=10, help="timed repetitions per all_to_all point and run")
    parser.add_argument("--a2a-runs", type=int, default=3, help="all_to_all runs per layout and rate")
    parser.add_argument("--train-runs", type=int, default=2, help="train pairs (host, host-tcp) per layout and rate")
    parser.add_argument("--steps", type=int, default=30, help="train steps per run")
    parser.add_argument("--warmup-steps", type=int, default=5, help="train steps left out of samples/s")
    parser.add_argument("--model", default="tiny", help="freescale train's --model")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")


def _emulator():
    spec = importlib.util.spec_from_file_location("emulate_hosts", ROOT / "scripts" / "emulate_hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_layout(text: str) -> tuple[int, int]:
    try:
        hosts, ranks = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--layouts: HOSTSxRANKS such as 2x2, got {text!r}") from None
    if hosts < 2 or ranks < 1:
        raise ValueError(f"--layouts: at least 2 hosts of at least 1 rank, got {text!r}")
    return hosts, ranks


class Hosts:
    """A layout's emulated hosts on a network of ``rate``; ``run`` starts one command per host on fresh hosts."""

    def __init__(self, n: int, rate: str, work: Path):
        self.emu = _emulator()
        problem = self.emu.network_problem()
        if problem:
            raise OSError(problem)
        self.n, self.work = n, work
        self.names = self.emu.host_names(n)
        self.network = self.emu.Network(rate)
        self.hosts_file = self.emu.write_hosts_file(work, self.names, networked=True)

    def run(self, argv_of, timeout: float, label: str) -> None:
        """``argv_of(i)`` on host i, every host at once; raises with the hosts' last lines if one fails."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs, outs = [], []
        try:
            for i, name in enumerate(self.names):
                out = open(self.work / f"{label}.{name}.out", "wb")
                outs.append(out)
                procs.append(
                    self.emu.spawn_host(
                        i,
                        name,
                        argv_of(i),
                        self.hosts_file,
                        self.work,
                        network=self.network,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=str(self.work),
                        start_new_session=True,
                    )
                )
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:  # the host's init, and with it every process of the host, goes with its unshare
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for out in outs:
                out.close()
        if any(codes):
            tails = [(self.work / f"{label}.{n}.out").read_text(errors="replace")[-600:] for n in self.names]
            raise RuntimeError(f"{label}: exit statuses {codes}; last output per host: {tails}")

    def close(self) -> None:
        self.network.close()


def run_a2a(hosts: Hosts, ranks: int, sizes: Sequence[int], reps: int, timeout: float, label: str) -> dict:
    """One run of the transport bench on every host: rank 0's rows, and the paths each backend took."""
    world = hosts.n * ranks
    out = hosts.work / f"{label}.json"
    blocks = ",".join(str(s // world) for s in sizes)  # the transport bench's sizes are per destination

    def argv(i: int) -> list[str]:
        return [
            sys.executable,
            *("-m", "torch.distributed.run", "--nnodes", str(hosts.n), "--nproc-per-node", str(ranks)),
            *("--node-rank", str(i), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.names[0]}:{PORT}"),
            *("--rdzv-id", label, "-m", "benchmarks", "transport", "--device", "cpu", "--no-contention"),
            *("--backends", ",".join(VARIANTS), "--sizes", blocks, "--reps", str(reps), "--json", str(out)),
        ]

    hosts.run(argv, timeout, label)
    result = json.loads(out.read_text())
    rows = [r for r in result["latency"] if r["op"] == "all_to_all"]
    return {"paths": result["paths"], "rows": rows, "load_average": result.get("load_average_before")}


def run_train(hosts: Hosts, ranks: int, transport: str, args: argparse.Namespace, label: str) -> dict:
    out = hosts.work / f"{label}.json"

    def argv(i: int) -> list[str]:
        return [
            *(sys.executable, "-m", "pipelines.cli", "train", "--device", "cpu", "--model", args.model),
            *("--no-progress", "--nnodes", str(hosts.n), "--node-rank", str(i), "--nproc", str(ranks)),
            *("--rdzv-endpoint", f"{hosts.names[0]}:{PORT}", "--transport", transport, "--steps", str(args.steps)),
            *("--warmup-steps", str(args.warmup_steps), "--summary-json", str(out)),
        ]

    hosts.run(argv, args.timeout, label)
    summary = json.loads(out.read_text())
    paths = sorted({p["path"] for p in summary["transport"]["host"].values()})
    return {"transport": transport, "samples_per_s": summary["samples_per_s"], "paths": paths}


def summarize(a2a_runs: list[dict], train_runs: list[dict], world: int) -> list[dict]:
    """The table's rows for one layout and rate: per all_to_all size, the medians over runs of each variant's
    median time and of the mixed/TCP time ratio; then the e2e samples/s and the pairs' mixed/TCP ratio."""
    rows = []
    for size in sorted({r["block_bytes"] for run in a2a_runs for r in run["rows"]}):
        per_run = [{r["backend"]: r["median_us"] for r in run["rows"] if r["block_bytes"] == size} for run in a2a_runs]
        total = size * world
        row: dict[str, Any] = {"measure": "all_to_all", "bytes_per_rank": total}
        for v in VARIANTS:
            row[f"{v}_ms"] = statistics.median(t[v] for t in per_run) / 1e3
            row[f"{v}_gb_per_s"] = total / (row[f"{v}_ms"] / 1e3) / 1e9
        row["mixed_over_tcp_time"] = statistics.median(t["host"] / t["host-tcp"] for t in per_run)
        row["paths"] = {v: sorted({run["paths"][v] for run in a2a_runs}) for v in VARIANTS}
        rows.append(row)
    if train_runs:
        by = {v: [r for r in train_runs if r["transport"] == v] for v in VARIANTS}
        row = {"measure": "e2e"}
        for v in VARIANTS:
            row[f"{v}_samples_per_s"] = statistics.median(r["samples_per_s"] for r in by[v])
        pairs = zip(by["host"], by["host-tcp"])
        row["mixed_over_tcp_samples"] = statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in pairs)
        row["paths"] = {v: sorted({p for r in by[v] for p in r["paths"]}) for v in VARIANTS}
        rows.append(row)
    return rows


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def table(result: dict) -> str:
    lines = [
        "| layout | link | measure | mixed (`host`) | all-TCP (`host-tcp`) | mixed / all-TCP |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for block in result["layouts"]:
        where = (block["layout"], block["rate"])
        for r in block["rows"]:
            if r["measure"] == "all_to_all":
                what = f"all_to_all {_mib(r['bytes_per_rank'])}: ms (GB/s)"
                cells = [f"{r[f'{v}_ms']:.2f} ({r[f'{v}_gb_per_s']:.3f})" for v in VARIANTS]
                ratio = f"{r['mixed_over_tcp_time']:.2f}x time"
            else:
                what = "e2e samples/s"
                cells = [f"{r[f'{v}_samples_per_s']:.0f}" for v in VARIANTS]
                ratio = f"{r['mixed_over_tcp_samples']:.2f}x samples/s"
            lines.append(f"| {where[0]} | {where[1]} | {what} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    layouts = [parse_layout(x) for x in args.layouts.split(",") if x.strip()]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    result: dict[str, Any] = {
        "sizes": "bytes each rank sends in total per all_to_all (its whole input)",
        "load_average_before": os.getloadavg(),
        "layouts": [],
    }
    with tempfile.TemporaryDirectory(prefix="fs-bench-multihost-") as tmp:
        for n, ranks in layouts:
            for rate in rates:
                work = Path(tmp) / f"{n}x{ranks}-{rate}"
                work.mkdir()
                hosts = Hosts(n, rate, work)
                try:
                    world = n * ranks
                    for s in sizes:
                        if s % world:
                            raise ValueError(f"--sizes: {s} bytes do not split into {world} equal blocks")
                    a2a = [
                        run_a2a(hosts, ranks, sizes, args.a2a_reps, args.timeout, f"a2a{k}")
                        for k in range(args.a2a_runs)
                    ]
                    train = []
                    for k in range(args.train_runs):  # A B, B A, ...: a drifting load falls on both alike
                        for v in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
                            train.append(run_train(hosts, ranks, v, args, f"train{k}-{v}"))
                finally:
                    hosts.close()
                block = {"layout": f"{n}x{ranks}", "rate": rate, "a2a_runs": a2a, "train_runs": train}
                block["rows"] = summarize(a2a, train, world)
                result["layouts"].append(block)
                print("\n".join(table({"layouts": [block]}).splitlines()[2:]), flush=True)  # as each layout ends
    result["load_average_after"] = os.getloadavg()
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    print(table(result))
    write_json(result, args.json)
    return 0
