"""The `freescale` command. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``main(args) -> int``; this file only routes to them (imported lazily, so
`freescale data ...` does not pay for what `freescale train` needs)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Optional, Sequence

# (command path, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (
        ("train",),
        "pipelines.job.train",
        "train the softmax model, HSTU or yours (--model) on local ranks or hosts",
    ),
    (("data", "synth"), "pipelines.cli.data_synth", "write synthetic heavy-tailed UIH data to Parquet"),
    (("data", "convert"), "pipelines.cli.data_convert", "convert MovieLens / Amazon / KuaiRand raw logs to Parquet"),
    (("data", "stats"), "pipelines.cli.data_stats", "length, sparsity and collision statistics of a dataset"),
    (("trace",), "pipelines.cli.trace_report", "where a traced run's host time went, per phase of the step and thread"),
    (("simulate",), "pipelines.simulate.simulator", "straggler simulation of N ranks, with and without balancing"),
]


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freescale",
        description="FreeScale: balanced, prefetched, SM-free distributed training of sequence recommenders.",
    )
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        if not _available(module):
            continue
        sub = top
        if len(path) == 2:
            if path[0] not in groups:
                group_parser = top.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group_parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            sub = groups[path[0]]
        cmd = sub.add_parser(path[-1], help=help_text, description=help_text)
        try:
            importlib.import_module(module).add_arguments(cmd)
        except ImportError as exc:  # e.g. torchdata absent: the other commands still work
            cmd.description = f"{help_text} [unavailable here: {exc}]"
            cmd.set_defaults(_unavailable=f"freescale {' '.join(path)} cannot run here: {exc}")
        cmd.set_defaults(_module=module)
    return parser


class _Terminated(BaseException):
    """SIGTERM while the command loads (a BaseException, as KeyboardInterrupt is): its default action would end
    the process silently with -15. A command that takes the stop signals itself (the launcher) replaces this."""


def _terminate(signum: int, frame) -> None:
    raise _Terminated


def main(argv: Optional[Sequence[str]] = None) -> int:
    import threading

    if threading.current_thread() is threading.main_thread():  # signal.signal works there only
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C while the command loads torch (seconds): one line, not the import's traceback
        return _interrupted(argv, signal.SIGINT)
    except _Terminated:
        return _interrupted(argv, signal.SIGTERM)


def _interrupted(argv: Optional[Sequence[str]], signum: signal.Signals) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = [w for w in (words[:2] if words[:1] == ["data"] else words[:1]) if not w.startswith("-")]
    print(f"{' '.join(['freescale', *command])}: interrupted ({signum.name})", file=sys.stderr)
    return 128 + signum


def _run(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "_unavailable", None):  # its flags are unknown here: say why, not "unrecognized arguments"
        raise SystemExit(args._unavailable)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except (ValueError, OSError) as error:  # bad user input, a missing or unreadable file: what and where, one line
        print(
            f"freescale {' '.join(a for a in (args.command, getattr(args, 'subcommand', None)) if a)}: error: {error}",
            file=sys.stderr,
        )
        return 2
