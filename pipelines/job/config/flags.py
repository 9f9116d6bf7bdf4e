"""The command line of `freescale train`: its flags, derived from the job config's fields (sections.py).

A field's flag is ``--KEY`` with dashes (``--batch-size``); a tuning knob's (``Flag.knob``) carries its table,
``--TABLE.KEY`` (``--process.gil-switch-ms``, ``--dense-sync.bucket-mb``); a boolean's is a pair, ``--KEY`` /
``--no-KEY`` (``--loader.no-stage-lookahead``). ``FLAGS`` holds each field's help line, and the flag's own name
where it keeps a spelling older than its key (``--checkpoint-dir`` sets ``[checkpoint] dir``, ``--data`` sets
``[data] path``): users' scripts run unchanged. The help sections of ``--help`` are the TOML tables; the knobs are
left out of it (``--help-tuning`` lists them; docs/tuning.md explains them).

Precedence: flags > the TOML file of ``--config`` > defaults. A flag's text is read as its field's type by the
same check as a TOML value (config.type_problem); the validation's errors name the flags (config.ConfigError).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pipelines.job.config.sections import (
    EXPECTED,
    SECTIONS,
    TABLES,
    ConfigError,
    JobConfig,
    config_fields,
    field_kind,
    shown,
    type_problem,
)
from pipelines.job.config.toml_file import read_toml


class Flag(NamedTuple):
    help: str
    name: Optional[str] = None  # where the flag is not --KEY (--TABLE.KEY): a spelling older than the key
    metavar: Optional[str] = None  # else NAME for a field with choices, N for an int, X for a float, KEY for a str
    knob: bool = False  # a tuning knob: --TABLE.KEY, listed by --help-tuning rather than --help


def _knob(help_text: str) -> Flag:
    return Flag(help_text, knob=True)


# Every field's flag, by the field's path; a test checks that every field has one and every entry a field.
FLAGS = {
    "data.path": Flag("'synthetic' or Parquet path", "--data", "PATH"),
    "data.preset": Flag("synthetic data (docs/schema.md)"),
    "data.num_samples": Flag("synthetic samples per epoch"),
    "data.collision_rate": Flag("synthetic: rows shared by consecutive batches"),
    "data.uih_cap": Flag("longest UIH kept (most recent)"),
    "data.seed": Flag("seed of the synthetic generator", "--data-seed"),
    "data.id_overflow": Flag("ids beyond the item table"),
    "data.drop_bad_samples": Flag("Parquet: skip and count samples with bad values"),
    "data.unordered_timestamps": Flag("histories out of time order", metavar="HOW"),
    "data.eval_path": Flag("held-out Parquet: NE and AUC at the end", "--eval-data", "PATH"),
    "model.name": Flag("tiny|small|production|hstu|hstu-large|module:function", "--model", "MODEL"),
    "model.num_items": Flag("override the preset's item table rows"),
    "model.dim": Flag("override the preset's width d"),
    "model.num_layers": Flag("override the preset's transformer blocks"),
    "model.max_uih": Flag("override the preset's longest UIH in the encoder"),
    "model.attention": Flag(""),
    "model.positions": Flag("HSTU positions"),
    "model.residual": _knob("the HSTU model's residual stream under bf16 autocast: fp32 or bf16"),
    "loader.batch_size": Flag("local batch size per rank"),
    "loader.prefetch_depth": Flag("batches read ahead of the model"),
    "loader.pin_memory": _knob("pin host memory of batches (forced on when the trainer trains on CUDA)"),
    "loader.background_stages": _knob("run the balancer / ID-prefetch stages one batch ahead in a worker thread"),
    "loader.worker_start": _knob(
        "when the stage worker starts the batch after next (default: backward under the trainer)"
    ),
    "loader.stage_lookahead": _knob("start each stage's exchange one batch early, even under the worker thread"),
    "balancer.partitioner": Flag("none|fbs|vbs|kk|module:function", metavar="NAME"),
    "balancer.alpha": Flag("cost exponent of L^alpha (fbs, vbs, kk)"),
    "balancer.autotune": Flag("vbs: tune per-rank budgets from step times"),
    "balancer.min_gain": Flag("least predicted gain to rebalance"),
    "balancer.memory_budget": Flag("tokens per rank at most: N, Nx (x mean) or auto", metavar="SPEC"),
    "embeddings.optimizer": Flag("", "--embedding-optimizer"),
    "embeddings.lr": Flag("sharded tables' learning rate", "--embedding-lr"),
    "embeddings.transport": Flag(""),
    "embeddings.early_start": _knob("freescale: when the next batch's fresh rows start"),
    "embeddings.exclusive_start": _knob("freescale: when deferred exclusive gradients leave"),
    "embeddings.schedule": _knob("freescale: auto probes both, keeps the faster"),
    "dense_sync.allreduce_start": _knob("when the dense all-reduce's last bucket is launched"),
    "dense_sync.bucket_mb": _knob("dense all-reduce bucket size in MiB (0: one all-reduce after the backward)"),
    "kernels.attention_impl": _knob(
        "attention kernel on CUDA (softmax model: varlen, flex with --deterministic; hstu: its Triton kernel)"
    ),
    "process.threads": _knob("torch intra-op threads per rank (default: cores / local ranks on CPU, at most 2 on GPU)"),
    "process.gil_switch_ms": _knob("Python's thread switch interval per rank (ms)"),
    "process.numa_binding": _knob("GPU runs: bind each rank's threads near its GPU"),
    "run.mode": Flag(""),
    "run.nproc": Flag("local ranks, not under torchrun"),
    "run.nnodes": Flag("hosts, each running freescale train"),
    "run.node_rank": Flag("0: the host serving the rendezvous"),
    "run.rdzv_endpoint": Flag("where the hosts meet: node 0's address", metavar="HOST:PORT"),
    "run.steps": Flag("training steps"),
    "run.warmup_steps": Flag("steps left out of the timings"),
    "run.lr": Flag("dense parameters' Adam lr"),
    "run.seed": Flag("model initialisation seed"),
    "run.device": Flag(""),
    "run.precision": Flag(""),
    "run.deterministic": Flag("bitwise reproducible steps (docs/tuning.md)"),
    "run.eval_every": Flag("evaluate every N steps too"),
    "run.summary_json": Flag("write the run summary here", metavar="PATH"),
    "run.metrics_jsonl": Flag("write one JSON line of metrics per step", metavar="PATH"),
    "run.progress": Flag("progress bar on rank 0"),
    "run.trace": Flag("profile a few steps to PATH.rank{r}.json", metavar="PATH"),
    "run.comm_timeout_s": Flag("timeout of waits between ranks"),
    "run.verbose": Flag("print a failed rank's full traceback"),
    "run.log_dir": Flag("where failed ranks' tracebacks go", metavar="DIR"),
    "checkpoint.dir": Flag("checkpoint directory", "--checkpoint-dir", "DIR"),
    "checkpoint.every": Flag("save every N steps, 0: never", "--checkpoint-every"),
    "checkpoint.resume": Flag("'latest' or a step directory", metavar="STEP"),
    "checkpoint.async_save": Flag("save checkpoints in the background", "--async-checkpoint"),
    "checkpoint.export": Flag("the trained model's state_dict, and PATH.json", metavar="PATH"),
}


def flag(path: str) -> str:
    """The command-line spelling of the field at ``path``: ``--batch-size``, ``--process.gil-switch-ms``,
    ``--checkpoint-dir`` (``checkpoint.dir``)."""
    table, key = (part.replace("_", "-") for part in path.split("."))
    return FLAGS[path].name or (f"--{table}.{key}" if FLAGS[path].knob else f"--{key}")


def knobs() -> list[str]:
    """The tuning knobs' paths, in the order of the tables and their fields."""
    return [path for path in config_fields() if FLAGS[path].knob]


def _choices(path: str) -> Optional[tuple]:
    table, key = path.split(".")
    return getattr(SECTIONS[table], "CHOICES", {}).get(key)


def _parse_flag(kind: type) -> Callable[[str], Any]:
    """argparse's ``type`` for a flag of a field of type ``kind``: the flag's text as that type, with the same
    refusals as a TOML value (``--steps 4.5``, ``--lr nan``), reported as argparse reports a bad flag (exit 2)."""

    def parse(text: str) -> Any:
        try:
            value = int(text) if kind is int else float(text) if kind is float else text
        except ValueError:
            value = None
        if value is None or type_problem(kind, value) is not None:
            raise argparse.ArgumentTypeError(f"expected {EXPECTED[kind]}, got {shown(text)}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _help(path: str) -> str:
    choices, default = _choices(path), config_fields()[path].default
    parts = ["|".join(choices)] if choices else []
    if default is not None and field_kind(path) is not bool:
        parts.append(f"default: {default}")
    text = FLAGS[path].help
    if parts:
        text = f"{text} ({'; '.join(parts)})" if text else "; ".join(parts)
    return text.replace("%", "%%")


def _add(parser, path: str, show: bool) -> None:
    """One field's flag(s); ``dest`` is the field's path, default None: an unset flag never overrides the TOML."""
    kind, name = field_kind(path), flag(path)
    if kind is bool:  # --NAME / --no-NAME (--TABLE.no-NAME); help shows the one that changes the default
        default = config_fields()[path].default
        negative = name.replace(".", ".no-", 1) if "." in name else name.replace("--", "--no-", 1)
        for option, value in ((name, True), (negative, False)):
            listed = show and value != default
            help_text = f"{'off: ' if not value else ''}{FLAGS[path].help}" if listed else argparse.SUPPRESS
            parser.add_argument(option, dest=path, action="store_const", const=value, help=help_text)
        return
    derived = "NAME" if _choices(path) else {int: "N", float: "X"}.get(kind, path.split(".")[1].split("_")[-1].upper())
    parser.add_argument(
        name,
        dest=path,
        default=None,
        type=_parse_flag(kind),
        metavar=FLAGS[path].metavar or derived,
        help=_help(path) if show else argparse.SUPPRESS,
    )


def add_tuning_arguments(parser: argparse.ArgumentParser, show: bool = True) -> None:
    """The knobs' ``--TABLE.NAME`` flags alone (also for the benchmarks that run jobs: ``python -m benchmarks
    e2e``)."""
    for path in knobs():
        _add(parser, path, show)


def apply_tuning(args: argparse.Namespace, config: JobConfig) -> None:
    """Sets on ``config`` the knobs given as ``--TABLE.NAME`` flags (those left unset keep its values)."""
    for path in knobs():
        if getattr(args, path, None) is not None:
            table, key = path.split(".")
            setattr(getattr(config, table), key, getattr(args, path))


class _HelpTuning(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        tuning = argparse.ArgumentParser(
            prog=parser.prog,
            usage="%(prog)s [--TABLE.NAME VALUE ...]",
            add_help=False,
            formatter_class=parser.formatter_class,
            description="Tuning knobs, each in the table of --config it names (--dense-sync.bucket-mb: "
            "[dense_sync] bucket_mb); docs/tuning.md explains each and when to change it.",
        )
        for table in dict.fromkeys(path.split(".")[0] for path in knobs()):
            group = tuning.add_argument_group(table)
            for path in knobs():
                if path.startswith(f"{table}."):
                    _add(group, path, show=True)
        tuning.print_help()
        parser.exit()


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=30)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of every section, in help groups that are the TOML tables; the knobs' flags hidden."""
    parser.usage = "%(prog)s [--config job.toml] [options]"
    parser.formatter_class = _formatter
    parser.add_argument("--config", metavar="TOML", help="TOML: a table per group, and the knobs'")
    parser.add_argument("--help-tuning", action=_HelpTuning, help="the --TABLE.NAME knobs (docs/tuning.md)")
    shown_tables = [table for table in TABLES if any(p.startswith(f"{table}.") for p in FLAGS if not FLAGS[p].knob)]
    groups = {table: parser.add_argument_group(table) for table in shown_tables}
    for path in config_fields():
        if not FLAGS[path].knob:
            _add(groups[path.split(".")[0]], path, show=True)
    add_tuning_arguments(parser, show=False)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The job's config: flags (already of their fields' types, parsed by ``_add``'s parsers) over the TOML file
    of ``--config`` over the defaults, validated; errors name flags.
    ``config.explicit``: the paths the user set, for :func:`ignored_option_lines`."""
    file_values = read_toml(Path(args.config)) if getattr(args, "config", None) else {}
    given = {path: getattr(args, path) for path in FLAGS if getattr(args, path, None) is not None}
    config = JobConfig.from_values({**file_values, **given})
    try:
        config.validate()
    except ConfigError as error:
        raise ValueError(error.naming(flag)) from None
    config.explicit = frozenset(file_values) | frozenset(given)
    return config


def ignored_option_lines(config: JobConfig) -> list[str]:
    """One warning per option the user set (``config.explicit``) that the chosen mode ignores, naming its flag."""
    return config.ignored_options(getattr(config, "explicit", frozenset()), name=flag)
