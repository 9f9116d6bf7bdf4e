"""`freescale data synth`: write synthetic samples (fsdata.synthetic) to a Parquet file.

The file holds exactly what SyntheticSource would serve for epoch ``--epoch``, so a run on the file and a run
on the generator see the same samples."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tqdm import tqdm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdata.synthetic import PRESETS

    parser.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="length/vocabulary shape (default: tiny)"
    )
    parser.add_argument("--num-samples", type=int, required=True, help="samples to write")
    parser.add_argument("--out", required=True, help="output Parquet file")
    parser.add_argument("--row-group-size", type=int, default=1024, help="samples per row group (default 1024)")
    parser.add_argument(
        "--collision-rate", type=float, default=None, help="share of unique rows consecutive global batches share"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size (local batch x world size) the collision rate refers to (default: the preset's, 128)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--epoch", type=int, default=0, help="which epoch of the generator to write")
    parser.add_argument("--uih-cap", type=int, default=None, help="longest UIH written (default 21000)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override any SyntheticConfig field, e.g. --set vocab_size=1000000 --set dense_dim=0 (repeatable)",
    )


def parse_overrides(items: list[str]) -> dict:
    """``FIELD=VALUE`` strings -> typed SyntheticConfig overrides (type taken from the field's default)."""
    from fsdata.synthetic import SyntheticConfig

    fields = {f.name: f for f in dataclasses.fields(SyntheticConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        default = getattr(SyntheticConfig(), name)
        if isinstance(default, bool):
            out[name] = value.lower() in ("1", "true", "yes")
        elif value.lower() == "none":
            out[name] = None
        elif isinstance(default, int) and default is not None:
            out[name] = int(value)
        else:
            out[name] = float(value)
    return out


def synthetic_config(args: argparse.Namespace, num_samples: int):
    from fsdata.synthetic import SyntheticConfig

    overrides = parse_overrides(args.set)
    for name, value in (
        ("collision_rate", args.collision_rate),
        ("collision_block_size", args.batch_size),
        ("seed", args.seed),
        ("uih_cap", args.uih_cap),
    ):
        if value is not None:
            overrides[name] = value
    return SyntheticConfig.from_preset(args.preset, num_samples=num_samples, **overrides)


def main(args: argparse.Namespace) -> int:
    from fsdata.schema import write_parquet
    from fsdata.synthetic import SyntheticSource

    if args.num_samples < 1:
        raise SystemExit("--num-samples must be >= 1")
    source = SyntheticSource(synthetic_config(args, args.num_samples))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, step = args.num_samples, args.row_group_size

    def batches():
        with tqdm(total=n, unit="sample", desc=f"synth {out.name}") as bar:
            for lo in range(0, n, step):
                batch = source.read(args.epoch, lo, min(n, lo + step))
                bar.update(batch.batch_size)
                yield batch

    written = write_parquet(batches(), str(out), row_group_size=step)
    print(f"wrote {written} samples to {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    print(f"  {source.describe()}")
    print(f"  truncated to the cap: {source.stats()['truncated_uih']} samples")
    return 0
