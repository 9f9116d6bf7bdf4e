"""`freescale data convert`: MovieLens / Amazon / KuaiRand raw logs -> the FreeScale Parquet schema."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", required=True, choices=["movielens", "amazon", "kuairand"], help="raw format")
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="raw file(s): ratings.dat|csv, reviews .jsonl, KuaiRand log CSVs; any of them gzipped (.gz)",
    )
    parser.add_argument("--out", required=True, help="output Parquet file (id mappings are written beside it)")
    parser.add_argument(
        "--candidates", type=int, default=10, help="events per sample that become its candidates (default 10)"
    )
    parser.add_argument(
        "--samples-per-user",
        type=int,
        default=1,
        help="windows per user, taken backwards from the latest events; 0 = all (output grows with history length "
        "squared)",
    )
    parser.add_argument("--min-history", type=int, default=1, help="shortest UIH of a sample (default 1)")
    parser.add_argument(
        "--max-uih", type=int, default=None, help="store at most this many most recent UIH events (default: all)"
    )
    parser.add_argument(
        "--labels", default="is_click", help="KuaiRand: comma-separated label columns (default is_click)"
    )
    parser.add_argument("--row-group-size", type=int, default=1024, help="samples per row group (default 1024)")
    parser.add_argument(
        "--bad-rows",
        choices=["error", "skip"],
        default="error",
        help="a malformed CSV row (wrong field count, unparsable or empty field, a last line cut short): error naming "
        "its line (default), or skip it and count it",
    )
    parser.add_argument(
        "--eval-out",
        default=None,
        metavar="PATH",
        help="also write a held-out split here: per user, its last --eval-candidates events (its "
        "history: every event before them), never trained on (leave-last-out)",
    )
    parser.add_argument(
        "--eval-candidates",
        type=int,
        default=None,
        help="events per user held out with --eval-out (default: --candidates)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    from fsdata.convert import convert

    report = convert(
        args.format,
        args.inputs,
        args.out,
        label_columns=tuple(c for c in args.labels.split(",") if c),
        progress=not args.no_progress,
        candidates=args.candidates,
        samples_per_user=args.samples_per_user,
        min_history=args.min_history,
        max_uih=args.max_uih,
        row_group_size=args.row_group_size,
        bad_rows=args.bad_rows,
        eval_out=args.eval_out,
        eval_candidates=args.eval_candidates,
    )
    rate = ", ".join(f"{r:.4f}" for r in report.positive_rate)
    print(
        f"{report.events} events of {report.users} users and {report.items} items -> {report.samples} training "
        f"samples ({report.skipped_users} users with too short a history skipped); positive rate {rate} (of "
        "their candidates' labels)"
    )
    if args.eval_out:
        held = ", ".join(f"{r:.4f}" for r in report.eval_positive_rate)
        print(
            f"  {report.eval_samples} held-out samples (each user's last events, never trained on); positive "
            f"rate {held}"
        )
    if report.skipped_rows:
        print(f"  {report.skipped_rows} malformed row(s) skipped (--bad-rows skip)")
    for path in report.outputs:
        print(f"  wrote {path}")
    return 0
