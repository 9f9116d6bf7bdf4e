"""`freescale data stats`: length distribution, sparsity (the paper's Eq. 1) and the realised collision rate
of a Parquet dataset or of a synthetic preset.

Sparsity is measured on consecutive local batches of ``--batch-size`` samples; the collision rate on
consecutive global batches of ``--global-batch-size`` samples: the share of a batch's unique embedding rows
(UIH items and candidate content ids) that the batch before it also used. Samples whose UIH timestamps go
backwards are counted (the loader counts them too, and ``require_ordered_timestamps`` refuses them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdata.synthetic import PRESETS

    parser.add_argument("path", nargs="?", help="Parquet file or directory (or use --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="measure a synthetic preset instead of files")
    parser.add_argument(
        "--num-samples", type=int, default=None, help="samples to measure (default: all of PATH; 8192 for --preset)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=128, help="local batch size for sparsity (default 128, the paper's)"
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="global batch size for the collision rate (default: --batch-size)",
    )
    parser.add_argument("--collision-rate", type=float, default=None, help="--preset: the knob (default: the preset's)")
    parser.add_argument("--seed", type=int, default=None, help="--preset: generator seed")
    parser.add_argument("--uih-cap", type=int, default=21_000, help="UIH cap applied while reading (default 21000)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="--preset: override a SyntheticConfig field"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the statistics as JSON")


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    p = np.percentile(values, [50, 90, 99])
    return {
        "mean": float(values.mean()),
        "p50": float(p[0]),
        "p90": float(p[1]),
        "p99": float(p[2]),
        "min": int(values.min()),
        "max": int(values.max()),
    }


class _TimestampOrder:
    """Counts the samples whose UIH timestamps go backwards, and the first of them (None: no timestamps read)."""

    def __init__(self) -> None:
        self.samples, self.first_sample_id, self.seen = 0, None, False

    def add(self, batch) -> None:
        from fsdata.schema import unordered_timestamps

        if batch.uih_timestamps is None:
            return
        self.seen = True
        offsets = batch.uih_offsets.numpy()
        mask, _ = unordered_timestamps(offsets - offsets[0], batch.uih_timestamps.numpy())
        self.samples += int(mask.sum())
        if self.first_sample_id is None and mask.any():
            self.first_sample_id = int(batch.sample_ids[torch.from_numpy(mask)][0])

    def summary(self):
        return {"samples": self.samples, "first_sample_id": self.first_sample_id} if self.seen else None


#: Epoch timestamps of the years 2001-2286 in each unit: [1e9, 1e10) seconds, then x1000 per unit.
_EPOCH_UNITS = ("seconds", "milliseconds", "microseconds", "nanoseconds")


def timestamp_unit(timestamps: np.ndarray) -> dict:
    """The unit the timestamps look like, from the magnitude of their median read as time since 1970: one of
    :data:`_EPOCH_UNITS`, or None where it is no epoch time of the years 2001-2286 in any of them (relative times,
    say). The HSTU model's time buckets (its relative bias, its age embeddings) read seconds."""
    median = float(np.median(np.abs(timestamps))) if len(timestamps) else 0.0
    unit = None
    if median >= 1e9:
        power = int(np.floor(np.log10(median))) - 9
        if power % 3 == 0 and power // 3 < len(_EPOCH_UNITS):
            unit = _EPOCH_UNITS[power // 3]
    return {"unit": unit, "median": median}


def collect(source, num_samples: int, batch_size: int, global_batch_size: int) -> dict:
    """Reads ``num_samples`` samples of epoch 0 global batch by global batch and measures them."""
    from fsdata.balance_measures import sparsity
    from fsdata.synthetic import collision_rate, row_ids

    uih, ncand, clen, sparsities, rates, dup, times = [], [], [], [], [], [], []
    previous, order = None, _TimestampOrder()
    with tqdm(total=num_samples, unit="sample", desc="stats") as bar:
        for lo in range(0, num_samples, global_batch_size):
            batch = source.read(0, lo, min(num_samples, lo + global_batch_size))
            lengths = batch.uih_lengths
            (
                uih.append(lengths.numpy()),
                ncand.append(batch.num_candidates.numpy()),
                clen.append(batch.candidate_lengths.numpy()),
            )
            for s in range(0, batch.batch_size, batch_size):
                if s + batch_size <= batch.batch_size:  # whole local batches only: a short tail would bias Eq. 1
                    sparsities.append(sparsity(lengths[s : s + batch_size]))
            order.add(batch)
            if batch.uih_timestamps is not None and len(times) < 64:  # a sample of the events is enough
                times.append(batch.uih_timestamps.numpy())
            rows = row_ids(batch)
            ids = batch.uih_item_ids.numel() + batch.content_ids.numel()
            dup.append(rows.numel() / max(ids, 1))
            if previous is not None and batch.batch_size == global_batch_size:
                rates.append(collision_rate(previous, rows))
            previous = rows
            bar.update(batch.batch_size)
    rates_a = np.asarray(rates)
    out = {
        "source": source.describe(),
        "samples": num_samples,
        "uih_lengths": _percentiles(np.concatenate(uih)),
        "num_candidates": _percentiles(np.concatenate(ncand)),
        "candidate_lengths": _percentiles(np.concatenate(clen)),
        "batch_size": batch_size,
        "sparsity_eq1_mean": float(np.mean(sparsities)) if sparsities else None,
        "global_batch_size": global_batch_size,
        "collision_rate": (
            {
                "mean": float(rates_a.mean()),
                "min": float(rates_a.min()),
                "max": float(rates_a.max()),
                "pairs": len(rates),
            }
            if rates
            else None
        ),
        "unique_rows_per_id": float(np.mean(dup)),
        "unordered_timestamps": order.summary(),
        "timestamp_unit": timestamp_unit(np.concatenate(times)) if times else None,
    }
    if hasattr(source, "stats"):
        out["truncated_uih"] = source.stats()["truncated_uih"]
    return out


def print_stats(stats: dict) -> None:
    print(stats["source"])
    print(f"  samples: {stats['samples']}")
    for key in ("uih_lengths", "num_candidates", "candidate_lengths"):
        p = stats[key]
        print(
            f"  {key:18s} mean {p['mean']:9.1f}  p50 {p['p50']:8.0f}  p90 {p['p90']:8.0f}  p99 {p['p99']:8.0f}  min "
            f"{p['min']}  max {p['max']}"
        )
    if stats["sparsity_eq1_mean"] is not None:
        print(f"  sparsity (Eq. 1) at batch size {stats['batch_size']}: {stats['sparsity_eq1_mean']:.3f}")
    c = stats["collision_rate"]
    if c:
        print(
            f"  collision rate between consecutive global batches of {stats['global_batch_size']}: mean "
            f"{c['mean']:.4f} "
            f"(min {c['min']:.4f}, max {c['max']:.4f}, {c['pairs']} pairs)"
        )
    print(f"  unique rows / ids per global batch: {stats['unique_rows_per_id']:.3f}")
    if "truncated_uih" in stats:
        print(f"  UIH truncated to the cap: {stats['truncated_uih']} samples")
    order = stats["unordered_timestamps"]
    if order is not None:
        first = "" if order["first_sample_id"] is None else f" (the first: sample_id {order['first_sample_id']})"
        print(f"  UIH timestamps going backwards: {order['samples']} samples{first}")
    unit = stats.get("timestamp_unit")
    if unit is not None:
        looks = f"epoch {unit['unit']}" if unit["unit"] else "no epoch time in s, ms, us or ns"
        advice = "" if unit["unit"] == "seconds" else " (--model hstu reads seconds: convert them)"
        print(f"  UIH timestamps look like {looks} (median {unit['median']:.3g}){advice}")


def main(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.preset is None):
        raise SystemExit("give either PATH or --preset")
    global_batch = args.global_batch_size or args.batch_size
    if args.batch_size < 1 or global_batch < 1:
        raise SystemExit("batch sizes must be >= 1")
    if args.preset:
        from fsdata.synthetic import SyntheticSource
        from pipelines.cli.data_synth import synthetic_config

        ns = argparse.Namespace(
            preset=args.preset,
            set=args.set,
            collision_rate=args.collision_rate,
            batch_size=global_batch,
            seed=args.seed,
            uih_cap=args.uih_cap,
        )
        source = SyntheticSource(synthetic_config(ns, args.num_samples or 8192))
    else:
        from fsdata.parquet import ParquetSource

        source = ParquetSource(args.path, uih_cap=args.uih_cap)
    total = source.num_samples(0)
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    n = min(total, args.num_samples) if args.num_samples else total
    if n == 0:  # a source of no samples (a Parquet source refuses one itself): nothing to measure
        raise ValueError(f"{args.path or args.preset}: no samples")
    torch.set_num_threads(1)
    stats = collect(source, n, args.batch_size, global_batch)
    print_stats(stats)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(stats, indent=2))
    return 0
