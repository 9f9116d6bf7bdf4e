"""Job configuration: small nested dataclasses, one per builder, with a one-line help string per field.

Precedence: command-line flags > TOML file (``--config job.toml``) > defaults. The classes are the Python API
(``fsdata.build_loader`` takes a LoaderConfig, ``balancer_stages`` a BalancerConfig...); the command line and
the TOML file group their fields by what a user sets instead (``TABLES``): each field's metadata names its
``group`` (default: the one of its class, ``_CLASS_GROUP``), and that group is both the help section of
``freescale train --help`` and the TOML table that holds the field. Flags are named after the field
(``--batch-size``); the scheduling knobs of the ``tuning`` group are ``--tuning.NAME`` flags
(``--tuning.gil-switch-ms``, ``--tuning.stage-lookahead`` / ``--tuning.no-stage-lookahead``) in a ``[tuning]``
table, left out of ``--help`` (``--help-tuning`` lists them; docs/tuning.md explains them).

A field's type is its annotation (``int``, ``float``, ``bool``, ``str``, each possibly ``Optional``), checked in
one place (:func:`type_problem`) for a TOML value, a flag's text and a field set from Python: an integer field
takes no float and no bool (TOML's ``4.5`` or ``true`` would otherwise run as 5 steps or 1), a float field no
bool and nothing non-finite. A field's allowed values are its metadata's ``choices`` (None is allowed where the
default is None), checked for every class in one place (:func:`check_choices`). All validation happens in
:meth:`JobConfig.validate`, once, with ValueErrors that name the field and its flag; a TOML file's errors name
the file, table and key.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import numbers
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fsdata.balancer import BalancerConfig
from fsdata.loader import LoaderConfig
from fsdata.schema import ID_OVERFLOW_CHOICES
from fsembed.prioritized import EARLY_STARTS, EXCLUSIVE_STARTS
from pipelines.api.modes import BALANCING, MODES, SHARDED
from pipelines.api.numerics import PRECISIONS
from pipelines.api.wrap import EARLY_START, EXCLUSIVE_START
from pipelines.job.schedule import SCHEDULE_CHOICES
from pipelines.models.reference import ATTENTION_IMPLS


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


# nccl-ce (fscomm/nccl_ce.py) is not offered until it has run on two GPUs or more
TRANSPORT_CHOICES = ("host", "host-shm", "host-tcp", "nccl", "rdma")


DEVICES = ("cpu", "cuda", "auto")
OPTIMIZER_CHOICES = ("sgd", "rowwise_adagrad", "adam")
ALLREDUCE_STARTS = ("backward", "compute")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")


@dataclass
class DataConfig:
    """``id_overflow`` unset takes what the dataset declares (Parquet metadata ``freescale.id_overflow``, the
    synthetic preset), else ``error``. ``drop_bad_samples`` leaves out samples with non-finite dense values or
    labels, or labels outside [0, 1], and counts them in the summary's ``data_counts``; by default such a
    sample is an error naming it."""

    data: str = _f("synthetic", "'synthetic' or Parquet path", metavar="PATH")
    preset: str = _f("tiny", "synthetic preset (tiny, kuairand-1k, kuairand-27k, movielens-20m)")
    num_samples: int = _f(100_000, "synthetic samples per epoch")
    collision_rate: Optional[float] = _f(None, "synthetic: rows shared by consecutive batches")
    uih_cap: int = _f(21_000, "longest UIH kept (most recent)")
    data_seed: int = _f(0, "seed of the synthetic generator")
    id_overflow: Optional[str] = _f(None, "ids beyond the item table", choices=ID_OVERFLOW_CHOICES)
    drop_bad_samples: bool = _f(False, "Parquet: skip and count samples with bad values")
    eval_data: Optional[str] = _f(None, "held-out Parquet: NE and AUC at the end", metavar="PATH")


@dataclass
class ModelSection:
    """``model``: a reference preset (tiny, small, production), or a factory of your own model:
    ``module:function`` (on sys.path, the current directory first) or ``path/to/file.py:function``; it gets
    this job's config and returns a ``pipelines.ModelSpec`` (docs/api.md)."""

    model: str = _f("tiny", "tiny, small, production, or module:function")
    num_items: Optional[int] = _f(None, "override the preset's item table rows")
    dim: Optional[int] = _f(None, "override the preset's width d")
    num_layers: Optional[int] = _f(None, "override the preset's transformer blocks")
    max_uih: Optional[int] = _f(None, "override the preset's longest UIH in the encoder")
    attention: str = _f("jagged", "", choices=("jagged", "padded"))
    attention_impl: Optional[str] = _f(
        None,
        "jagged attention kernel on CUDA (default varlen; flex with --deterministic)",
        group="tuning",
        choices=ATTENTION_IMPLS,
    )


@dataclass
class TrainConfig:
    """``mode``: see pipelines.job.trainer (``torchrec`` runs the real torchrec, a CPU reference).

    ``warmup_steps``: the first steps are left out of the summary's timings (samples/s, step time, straggler,
    bubbles): they pay one-time costs such as kernel compilation and the first pinned-memory allocations; their
    wall time is reported apart (``warmup_s``). ``comm_timeout_s`` bounds every collective and hand-over between
    ranks (and the stage worker's and embedding chains' waits); past it the job stops with an error naming it
    and the rank(s) that did not arrive (torch's own default is 30 minutes). ``transport``: host is SM-free
    (shared memory between ranks of one host, TCP across hosts), host-shm / host-tcp force one host path, rdma
    is the paper's SM-free ring over verbs (untested on real NICs); the loader's CPU-side exchanges always use
    host. ``log_dir``: where `freescale train` writes each failed rank's full traceback (default: a new
    temporary directory, named in the error line). The scheduling knobs (group ``tuning``) are explained in
    docs/tuning.md."""

    mode: str = _f("freescale", "", choices=tuple(MODES))
    embedding_optimizer: str = _f("sgd", "", group="embeddings", choices=OPTIMIZER_CHOICES)
    embedding_lr: float = _f(0.05, "sharded tables' learning rate", group="embeddings")
    nproc: int = _f(2, "local ranks, not under torchrun")
    steps: int = _f(20, "training steps")
    warmup_steps: int = _f(1, "steps left out of the timings")
    lr: float = _f(1e-3, "dense parameters' Adam lr")
    seed: int = _f(0, "model initialisation seed")
    device: str = _f("auto", "", choices=DEVICES)
    precision: str = _f("auto", "", choices=PRECISIONS)
    deterministic: bool = _f(False, "bitwise reproducible steps (docs/tuning.md)")
    eval_every: int = _f(0, "evaluate every N steps too")
    summary_json: Optional[str] = _f(None, "write the run summary here", metavar="PATH")
    metrics_jsonl: Optional[str] = _f(None, "write one JSON line of metrics per step", metavar="PATH")
    threads: Optional[int] = _f(
        None, "torch intra-op threads per rank (default: cores / local ranks on CPU, at most 2 on GPU)", group="tuning"
    )
    progress: bool = _f(True, "progress bar on rank 0")
    checkpoint_dir: Optional[str] = _f(None, "checkpoint directory", metavar="DIR", group="checkpoint")
    checkpoint_every: int = _f(0, "save every N steps, 0: never", group="checkpoint")
    resume: Optional[str] = _f(None, "'latest' or a step directory", group="checkpoint", metavar="STEP")
    async_checkpoint: bool = _f(False, "save checkpoints in the background", group="checkpoint")
    export: Optional[str] = _f(
        None, "save your model's state_dict at the end (and PATH.json)", group="checkpoint", metavar="PATH"
    )
    trace: Optional[str] = _f(None, "profile a few steps to PATH.rank{r}.json", metavar="PATH")
    gil_switch_ms: float = _f(1.0, "Python's thread switch interval per rank (ms)", group="tuning")
    allreduce_start: str = _f(
        "backward", "when the dense all-reduce's last bucket is launched", group="tuning", choices=ALLREDUCE_STARTS
    )
    bucket_mb: float = _f(
        1.0, "dense all-reduce bucket size in MiB (0: one all-reduce after the backward)", group="tuning"
    )
    early_start: str = _f(
        EARLY_START, "freescale: when the next batch's fresh rows start", group="tuning", choices=EARLY_STARTS
    )
    exclusive_start: str = _f(
        EXCLUSIVE_START, "freescale: when deferred exclusive gradients leave", group="tuning", choices=EXCLUSIVE_STARTS
    )
    numa_binding: Optional[str] = _f(
        None, "GPU runs: bind each rank's threads near its GPU", group="tuning", choices=NUMA_BINDINGS
    )
    embedding_schedule: str = _f(
        "auto", "freescale: auto probes both, keeps the faster", group="tuning", choices=SCHEDULE_CHOICES
    )
    comm_timeout_s: float = _f(300.0, "timeout of waits between ranks")
    verbose: bool = _f(False, "print a failed rank's full traceback")
    log_dir: Optional[str] = _f(None, "where failed ranks' tracebacks go", metavar="DIR")
    transport: str = _f("host", "", group="embeddings", choices=TRANSPORT_CHOICES)


# Options that only some modes read: the others ignore them (JobConfig.ignored_options warns).
MODE_OPTIONS = {
    "partitioner": BALANCING,
    "alpha": BALANCING,
    "autotune": BALANCING,
    "min_gain": BALANCING,
    "memory_budget": BALANCING,
    "transport": SHARDED,
    "embedding_lr": (*SHARDED, "torchrec"),
    "embedding_optimizer": (*SHARDED, "torchrec"),
    "early_start": ("freescale",),
    "exclusive_start": ("freescale",),
    "embedding_schedule": ("freescale",),
    "export": ("replicated", *SHARDED),
}

SECTIONS = {
    "data": DataConfig,
    "model": ModelSection,
    "loader": LoaderConfig,
    "balancer": BalancerConfig,
    "train": TrainConfig,
}

# The help sections of `freescale train --help`, and the TOML tables: a field's metadata "group", else its class's.
TABLES = ("data", "model", "balancer", "embeddings", "run", "checkpoint", "tuning")
_CLASS_GROUP = {"data": "data", "model": "model", "loader": "data", "balancer": "balancer", "train": "run"}
TUNING = "tuning"


def _fields() -> dict[str, tuple[str, str, dataclasses.Field]]:
    """field name -> (section, table, field), over every section (names are unique across sections)."""
    return {
        f.name: (section, f.metadata.get("group", _CLASS_GROUP[section]), f)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    }


def flag(name: str) -> str:
    """The command-line spelling of a field: ``--batch-size``, ``--tuning.gil-switch-ms``."""
    table = _fields()[name][1]
    return f"--{TUNING + '.' if table == TUNING else ''}{name.replace('_', '-')}"


EXPECTED = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


@functools.cache
def _kinds(cls: type) -> dict[str, type]:
    """field name -> the type its values must have, from the class's annotations (``Optional`` dropped: None only
    ever comes from a default)."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kind = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
        if kind not in EXPECTED:  # a new kind of field needs its own check here and its own flag parser in _add
            raise TypeError(f"{cls.__name__}.{name}: config fields are int, float, bool or str, not {hint}")
        kinds[name] = kind
    return kinds


def field_kind(name: str) -> type:
    """The type of the config field ``name`` (any section): int, float, bool or str."""
    return _kinds(SECTIONS[_fields()[name][0]])[name]


def shown(value: Any) -> str:
    """A value as a TOML file spells it (``"four"``, ``true``, ``[2]``): what the user wrote."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"[{', '.join(shown(v) for v in value)}]"
    return str(value)


def type_problem(kind: type, value: Any, spell: Callable[[Any], str] = shown) -> Optional[str]:
    """None when ``value`` fits a field of type ``kind``, else what is wrong: ``expected an integer, got "four"
    (str)``. bool is an int to Python but never an integer or a number here; an int is a fine float."""
    if kind is bool:
        fits = isinstance(value, bool)
    elif kind is int:
        fits = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        fits = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    else:
        fits = isinstance(value, kind)
    return None if fits else f"expected {EXPECTED[kind]}, got {spell(value)} ({type(value).__name__})"


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


def check_types(section: str, obj: Any) -> None:
    """Every field of ``obj`` (the dataclass of config section ``section``) holds a value of its type, or None
    where that is its default: for a config built or changed in Python (flags and TOML values are checked as
    they are read)."""
    for name, kind in _kinds(type(obj)).items():
        value = getattr(obj, name)
        default = next(f.default for f in dataclasses.fields(obj) if f.name == name)
        problem = None if value is None and default is None else type_problem(kind, value, spell=repr)
        if problem:
            raise ValueError(f"{section}.{name}: {problem} ({flag(name)})")


def check_choices(obj: Any) -> None:
    """Every field of the dataclass ``obj`` whose metadata has ``choices`` holds one of them (or None, the
    default of an option left unset)."""
    for f in dataclasses.fields(obj):
        choices, value = f.metadata.get("choices"), getattr(obj, f.name)
        if choices is not None and value is not None and value not in choices:
            where = f" ({flag(f.name)})" if f.name in _fields() else ""
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}{where}")


@dataclass
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "JobConfig":
        for section in SECTIONS:
            check_types(section, getattr(self, section))
            check_choices(getattr(self, section))
        if self.train.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.train.nproc}")
        if self.model.num_items is not None and self.model.num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {self.model.num_items}")
        if self.train.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.train.steps}")
        if self.train.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.train.warmup_steps}")
        if self.train.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.train.eval_every} (--eval-every)")
        if self.train.eval_every and self.data.eval_data is None:
            raise ValueError("--eval-every needs --eval-data (the held-out Parquet file)")
        if self.data.eval_data is not None and self.train.mode == "torchrec":
            raise ValueError("--eval-data: mode torchrec (the outside reference) has no held-out evaluation")
        if self.data.collision_rate is not None and not 0.0 <= self.data.collision_rate <= 1.0:
            raise ValueError(f"collision_rate must lie in [0, 1], got {self.data.collision_rate}")
        if self.data.uih_cap < 1:
            raise ValueError(f"uih_cap must be >= 1, got {self.data.uih_cap}")
        if self.data.data != "synthetic" and not Path(self.data.data).exists():
            raise ValueError(f"data path {self.data.data!r} does not exist (use 'synthetic' or a Parquet path)")
        if self.train.mode == "torchrec":
            self._validate_torchrec()
            if ":" in self.model.model:
                raise ValueError(f"mode torchrec runs the reference model only, not --model {self.model.model!r}")
        if self.train.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.train.checkpoint_every}")
        if (self.train.checkpoint_every or self.train.resume == "latest") and not self.train.checkpoint_dir:
            raise ValueError("checkpoint_every and resume=latest need --checkpoint-dir")
        if not self.train.gil_switch_ms > 0:
            raise ValueError(f"gil_switch_ms must be > 0, got {self.train.gil_switch_ms}")
        if not self.train.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0, got {self.train.bucket_mb}")
        if not self.train.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0, got {self.train.comm_timeout_s}")
        if (
            self.balancer.partitioner != "none"
        ):  # an unknown name or an unimportable module:function, before ranks start
            from fsdata.partition import get_partitioner

            get_partitioner(self.balancer.partitioner, alpha=self.balancer.alpha)
        if self.balancer.autotune and self.balancer.partitioner != "vbs":
            raise ValueError(f"--autotune applies to the vbs partitioner, not {self.balancer.partitioner!r}")
        if not 0.0 <= self.balancer.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.balancer.min_gain}")
        self.loader.validate()
        return self

    def _validate_torchrec(self) -> None:
        from pipelines.models.torchrec_ref import EMBEDDING_OPTIMIZERS, missing_packages, unavailable_message

        missing = missing_packages()
        if missing:
            raise ValueError(unavailable_message(missing))
        if self.train.device == "cuda":
            raise ValueError("mode torchrec is a CPU reference only: use --device cpu")
        if self.train.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(
                f"mode torchrec supports embedding_optimizer {' or '.join(EMBEDDING_OPTIMIZERS)}, not "
                f"{self.train.embedding_optimizer!r} (torchrec's fused Adam fails on CPU)"
            )
        if self.train.checkpoint_every or self.train.resume:
            raise ValueError("mode torchrec does not checkpoint or resume (it is a reference run, not a job)")

    def ignored_options(self, explicit: set[str]) -> list[str]:
        """One warning per option set explicitly (``explicit``: field names) that the chosen mode ignores."""
        mode = self.train.mode
        out = []
        for name, modes in MODE_OPTIONS.items():
            if name in explicit and mode not in modes:
                out.append(f"{flag(name)} is ignored in mode {mode} (it applies to mode(s) {', '.join(modes)})")
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _help(f: dataclasses.Field) -> str:
    choices = f.metadata.get("choices")
    parts = ["|".join(choices)] if choices else []
    if f.default is not None and f.type not in (bool, "bool"):
        parts.append(f"default: {f.default}")
    text = f.metadata["help"]
    if parts:
        text = f"{text} ({'; '.join(parts)})" if text else "; ".join(parts)
    return text.replace("%", "%%")


def _add(parser, f: dataclasses.Field, show: bool) -> None:
    """One field's flag(s); ``dest`` is the field's name, default None: an unset flag never overrides the TOML."""
    kind = field_kind(f.name)
    name = flag(f.name)
    if kind is bool:  # --NAME / --no-NAME (--tuning.no-NAME); help shows the one that changes the default
        negative = name.replace(".", ".no-", 1) if "." in name else name.replace("--", "--no-", 1)
        for option, value in ((name, True), (negative, False)):
            listed = show and value != f.default
            help_text = f"{'off: ' if not value else ''}{f.metadata['help']}" if listed else argparse.SUPPRESS
            parser.add_argument(option, dest=f.name, action="store_const", const=value, help=help_text)
    else:
        metavar = f.metadata.get("metavar") or (
            "NAME"
            if "choices" in f.metadata
            else "N"
            if kind is int
            else "X"
            if kind is float
            else f.name.split("_")[-1].upper()
        )
        parser.add_argument(
            name,
            dest=f.name,
            default=None,
            type=_parse_flag(kind),
            metavar=metavar,
            help=_help(f) if show else argparse.SUPPRESS,
        )


def add_tuning_arguments(parser: argparse.ArgumentParser, show: bool = True) -> None:
    """The ``--tuning.NAME`` flags alone (also for the commands that run jobs: ``freescale bench e2e``)."""
    for name, (_, table, f) in _fields().items():
        if table == TUNING:
            _add(parser, f, show)


def apply_tuning(args: argparse.Namespace, config: "JobConfig") -> None:
    """Sets on ``config`` the tuning knobs given as ``--tuning.NAME`` flags (those left unset keep its values)."""
    for name, (section, table, _) in _fields().items():
        if table == TUNING and getattr(args, name, None) is not None:
            setattr(getattr(config, section), name, getattr(args, name))


class _HelpTuning(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        tuning = argparse.ArgumentParser(
            prog=parser.prog,
            usage="%(prog)s [--tuning.NAME VALUE ...]",
            add_help=False,
            formatter_class=parser.formatter_class,
            description="Scheduling knobs ([tuning] table of --config); docs/tuning.md "
            "explains each and when to change it.",
        )
        add_tuning_arguments(tuning.add_argument_group("tuning"))
        tuning.print_help()
        parser.exit()


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=30)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of every section, in help groups that are the TOML tables; tuning flags hidden."""
    parser.usage = "%(prog)s [--config job.toml] [options]"
    parser.formatter_class = _formatter
    parser.add_argument("--config", metavar="TOML", help="TOML: a table per group below, and [tuning]")
    parser.add_argument("--help-tuning", action=_HelpTuning, help="the --tuning.NAME knobs (docs/tuning.md)")
    groups = {table: parser.add_argument_group(table) for table in TABLES if table != TUNING}
    for name, (_, table, f) in _fields().items():
        if table != TUNING:
            _add(groups[table], f, show=True)
    add_tuning_arguments(parser, show=False)


def _toml_values(path: Path) -> dict[str, Any]:
    """field name -> value, from the TOML file ``path``: its tables are the help groups (``TABLES``), every key a
    field of its table, every value of its field's type; each error names the file (and the line, the table, the
    key)."""
    fields = _fields()
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        with path.open("rb") as fh:
            tables = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:  # its text gives the line and column
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})") from None
    for name, value in tables.items():
        if name in fields and name not in TABLES:
            raise ValueError(f"{path}: {name} = {shown(value)} is outside any table; it belongs in [{fields[name][1]}]")
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}; expected {', '.join(TABLES)}")
    values = {}
    for table, keys in tables.items():
        if not isinstance(keys, dict):
            raise ValueError(
                f"{path}: {table}: expected a table ([{table}]), got {shown(keys)} ({type(keys).__name__})"
            )
        for key, value in keys.items():
            if key not in fields or fields[key][1] != table:
                where = f" (it belongs in [{fields[key][1]}])" if key in fields else ""
                raise ValueError(f"{path}: [{table}] has unknown key {key!r}{where}")
            problem = type_problem(field_kind(key), value)
            if problem:
                raise ValueError(f"{path}: [{table}] {key}: {problem}")
            values[key] = float(value) if field_kind(key) is float else value
    return values


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The job's config: flags (already of their fields' types, parsed by ``_add``'s parsers) over the TOML file
    of ``--config`` over the defaults, validated."""
    fields = _fields()
    file_values = _toml_values(Path(args.config)) if getattr(args, "config", None) else {}
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    values: dict[str, dict] = {section: {} for section in SECTIONS}
    for name, value in {**file_values, **given}.items():
        values[fields[name][0]][name] = value
    config = JobConfig(**{section: cls(**values[section]) for section, cls in SECTIONS.items()}).validate()
    config.explicit = frozenset(file_values) | frozenset(given)  # what the user set: for JobConfig.ignored_options
    return config
