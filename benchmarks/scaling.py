"""`python -m benchmarks scaling`: the scaling table and the replay cross-check from runs made elsewhere.

    python -m benchmarks scaling --e2e out/e2e_heavy_1.json out/e2e_heavy_8.json ... \
        [--replay out/replay.json]

Reads the JSON of ``python -m benchmarks e2e`` runs at several GPU counts (one rank per GPU, same case and local batch:
weak scaling) and prints, per case, mode and GPU count: samples/s per GPU, scaling efficiency (samples/s per
GPU against the same case and mode on 1 GPU), straggler share, bubbles (ms per step) and their parts, and
freescale's bubble reduction against sync at that GPU count. Repeated runs (``--repeats``) count by their median.

With ``--replay`` (the JSON of ``python -m benchmarks replay``), the replay simulation's straggler share at the
measured GPU counts beside the measured one: partitioner ``none`` against mode sync (nothing balanced), the
freescale partitioner (``--partitioner``, default fbs) against mode freescale, and how many points apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Iterable, Optional

PARTS = ("data", "ids_a2a", "emb_a2a", "grad_a2a", "balancer", "label_count", "dense_allreduce")


def _median(values: Iterable[Optional[float]]) -> Optional[float]:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def load_rows(paths: Iterable[str]) -> list[dict]:
    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read e2e records from {path}: {exc}") from exc
        if not isinstance(data, list) or any("world_size" not in r or "mode" not in r for r in data):
            raise ValueError(
                f"{path} is not the JSON of `python -m benchmarks e2e` (a list of records with world_size and mode)"
            )
        rows += data
    return rows


def scaling_rows(rows: list[dict]) -> list[dict]:
    """One row per (case, mode, GPU count), the median over repeats."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["mode"], int(r["world_size"])), []).append(r)
    out = []
    for (case, mode, world), runs in sorted(groups.items()):
        per_gpu = _median(r["samples_per_s"] / world for r in runs)
        out.append(
            {
                "case": case,
                "mode": mode,
                "gpus": world,
                "runs": len(runs),
                "samples_per_s_per_gpu": per_gpu,
                "straggler_pct": _median(r.get("straggler_pct") for r in runs),
                "bubble_ms": _median(r.get("bubble_ms") for r in runs),
                "exposed_ms": {p: _median((r.get("exposed_ms") or {}).get(p) for r in runs) for p in PARTS},
                "bubble_reduction": _median(r.get("bubble_reduction") for r in runs),
            }
        )
    base = {(r["case"], r["mode"]): r["samples_per_s_per_gpu"] for r in out if r["gpus"] == 1}
    for r in out:
        one = base.get((r["case"], r["mode"]))
        r["scaling_efficiency"] = r["samples_per_s_per_gpu"] / one if one else None
    return out


def crosscheck(replay: list[dict], rows: list[dict], partitioner: str = "fbs") -> list[dict]:
    """Replay's predicted straggler share beside the measured one, at every GPU count both have."""
    measured = {(r["mode"], r["gpus"]): r["straggler_pct"] for r in scaling_rows(rows) if r["case"] == "heavy"}
    out = []
    for rec in replay:
        if "error" in rec or "straggler_pct" not in rec:
            continue
        mode = {"none": "sync", partitioner: "freescale"}.get(rec.get("partitioner"))
        got = measured.get((mode, int(rec.get("ranks", -1))))
        if mode is None or got is None:
            continue
        out.append(
            {
                "gpus": int(rec["ranks"]),
                "partitioner": rec["partitioner"],
                "mode": mode,
                "replay_kernel": rec.get("replay_kernel"),
                "jitter": rec.get("jitter"),
                "predicted_pct": rec["straggler_pct"],
                "measured_pct": got,
                "apart_points": got - rec["straggler_pct"],
            }
        )
    return out


def _cell(v: Optional[float], width: int, digits: int, scale: float = 1.0, suffix: str = "") -> str:
    return f"{'-':>{width}}" if v is None else f"{v * scale:>{width - len(suffix)}.{digits}f}{suffix}"


def print_tables(table: list[dict], checks: list[dict]) -> None:
    head = (
        f"{'case':<6} {'mode':<10} {'GPUs':>4} {'runs':>4} {'QPS/GPU':>9} {'eff.':>6} {'strag %':>7} {'bubble ms':>9} "
    )
    print(head + " ".join(f"{p[:9]:>9}" for p in PARTS) + f" {'bubble red.':>11}")
    for r in table:
        print(
            f"{r['case']:<6} {r['mode']:<10} {r['gpus']:>4} {r['runs']:>4} {r['samples_per_s_per_gpu']:>9.1f} "
            f"{_cell(r['scaling_efficiency'], 6, 1, 100, '%')} {_cell(r['straggler_pct'], 7, 1)} "
            f"{_cell(r['bubble_ms'], 9, 2)} "
            + " ".join(_cell(r["exposed_ms"][p], 9, 2) for p in PARTS)
            + f" {_cell(r['bubble_reduction'], 11, 1, 100, '%')}"
        )
    if checks:
        print(
            f"\nreplay cross-check (heavy case): {'GPUs':>4} {'partitioner':>11} {'mode':>9} {'kernel':>7} "
            f"{'jitter':>8} "
            f"{'replay %':>9} {'measured %':>10} {'apart (points)':>14}"
        )
        for c in checks:
            print(
                f"{'':<33}{c['gpus']:>4} {c['partitioner']:>11} {c['mode']:>9} {str(c['replay_kernel']):>7} "
                f"{str(c['jitter']):>8} {c['predicted_pct']:>9.2f} {c['measured_pct']:>10.2f} "
                f"{c['apart_points']:>14.2f}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--e2e", nargs="+", required=True, metavar="JSON", help="JSON files of `python -m benchmarks e2e` runs"
    )
    parser.add_argument("--replay", metavar="JSON", help="JSON of `python -m benchmarks replay` for the cross-check")
    parser.add_argument("--partitioner", default="fbs", help="freescale's partitioner in the e2e runs (default fbs)")
    parser.add_argument("--json", metavar="PATH", help="write the tables as JSON here")


def main(args: argparse.Namespace) -> int:
    rows = load_rows(args.e2e)
    table = scaling_rows(rows)
    checks = []
    if args.replay:
        try:
            replay = json.loads(Path(args.replay).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read replay records from {args.replay}: {exc}") from exc
        checks = crosscheck(replay, rows, args.partitioner)
    print_tables(table, checks)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"scaling": table, "replay_crosscheck": checks}, indent=1))
    return 0
