"""The job's configuration: one small dataclass per TOML table, at the attribute path the table names.

    [data]        config.data        JobDataSection        what the job reads
    [model]       config.model       JobModelSection       the softmax model's preset or the user's factory
    [loader]      config.loader      fsdata.LoaderConfig   batches per rank, read-ahead, the stage worker
    [balancer]    config.balancer    fsdata.BalancerConfig the sequence load balancer (the library's own)
    [embeddings]  config.embeddings  JobEmbeddingsSection  the sharded tables: optimizer, transport, schedule
    [dense_sync]  config.dense_sync  JobDenseSyncSection   the dense gradients' all-reduce
    [kernels]     config.kernels     JobKernelsSection     which kernel runs the attention
    [process]     config.process     JobProcessSection     each rank's threads and their placement
    [run]         config.run         JobRunSection         mode, ranks, steps, devices, outputs
    [checkpoint]  config.checkpoint  JobCheckpointSection  saving, resuming, exporting

Each component owns its table: the loader and the balancer are configured by the library's own classes, declared
once there; every other section is given to its component's builder alone. A tuning knob (when and where work
runs, never what a step computes: docs/tuning.md) lives in the table of the component it tunes. ``[checkpoint]
dir`` is ``config.checkpoint.dir``; every field is documented where it is declared. The command line
(pipelines.job.config.flags) derives its flags from these fields; nothing here knows a flag.

A field's type is its annotation (``int``, ``float``, ``bool``, ``str``, each possibly ``Optional``), checked in
one place (:func:`type_problem`) for a TOML value, a flag's text and a field set from Python: an integer field
takes no float and no bool (TOML's ``4.5`` or ``true`` would otherwise run as 5 steps or 1), a float field no
bool and nothing non-finite. :meth:`JobConfig.validate` is the one validation: the types of every section, then
each section's own ``validate()`` (its ranges and ``CHOICES``), then what spans sections. Its errors
(:class:`ConfigError`) name each field by its path (``run.steps``); the command line names the flag instead. The
TOML file is read in pipelines.job.config.toml_file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import numbers
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from fsdata.balancer import BalancerConfig
from fsdata.loader import LoaderConfig
from fsdata.schema import ID_OVERFLOW_CHOICES
from fsembed.prioritized import EARLY_STARTS, EXCLUSIVE_STARTS
from pipelines.api.modes import BALANCING, MODES, SHARDED, TORCHREC_MODES
from pipelines.api.numerics import PRECISIONS
from pipelines.api.step import TrainStep
from pipelines.api.wrap import EARLY_START, EXCLUSIVE_START
from pipelines.job.run.schedule_probe import SCHEDULE_CHOICES
from pipelines.models.hstu import HSTU_PRESETS, RESIDUALS
from pipelines.models.softmax import ATTENTION_IMPLS

# nccl-ce and peer (fscomm/experimental/) are not offered until they have run on the hardware they are written for
TRANSPORT_CHOICES = ("host", "host-shm", "host-tcp", "nccl", "rdma")
DEVICES = ("cpu", "cuda", "auto")
OPTIMIZER_CHOICES = ("sgd", "rowwise_adagrad", "adam")
ALLREDUCE_STARTS = ("backward", "compute")
# One default for the dense all-reduce's bucket, the public TrainStep's: a job and a user's own loop run alike.
BUCKET_MB = inspect.signature(TrainStep).parameters["bucket_mb"].default
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
ATTENTIONS = ("jagged", "padded")
#: How the HSTU model sees positions and time: ``rab`` (relative attention bias, inside the attention), ``embeddings``
#: (learned input embeddings: recsys-examples' and generative-recommenders' preprocessors), ``both``, ``none``.
POSITIONS = ("rab", "embeddings", "both", "none")


class ConfigError(ValueError):
    """A value the job cannot run with. The message's ``{}`` slots name ``fields`` (paths: ``run.steps``), in order:
    here by their paths; the command line names their flags instead (:meth:`naming`)."""

    def __init__(self, template: str, *fields: str) -> None:
        self.template, self.fields = template, fields
        super().__init__(self.naming(lambda path: path))

    def __reduce__(self) -> tuple:  # pickled (to another process) with its fields, not as the message alone
        return type(self), (self.template, *self.fields)

    def naming(self, name: Callable[[str], str]) -> str:
        """The message with each field named by ``name(path)``."""
        return self.template.format(*(name(path) for path in self.fields))


def _literal(text: str) -> str:
    """``text`` as a part of a ConfigError template: its braces are not slots."""
    return text.replace("{", "{{").replace("}", "}}")


def refuse(path: str, problem: str) -> ConfigError:
    """``steps must be >= 0, got -1 (run.steps)``: the key, what is wrong, and the field (its flag on the command
    line)."""
    return ConfigError(f"{path.split('.')[1]} {_literal(problem)} ({{}})", path)


def check_choices(table: str, section: Any) -> None:
    """Every field of ``section`` named in its ``CHOICES`` holds one of them, or None (an option left unset)."""
    for key, choices in section.CHOICES.items():
        value = getattr(section, key)
        if value is not None and value not in choices:
            raise refuse(f"{table}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class JobDataSection:
    """The ``[data]`` table of the job config (``config.data``): the training and held-out data. How much of it each
    rank takes per step is the loader's (``[loader] batch_size``)."""

    TABLE: ClassVar[str] = "data"
    CHOICES: ClassVar[dict] = {"id_overflow": ID_OVERFLOW_CHOICES, "unordered_timestamps": ("sort", "drop")}

    path: str = "synthetic"
    """``synthetic`` (the generator of ``preset``), a Parquet file, or a directory of ``*.parquet`` files."""
    preset: str = "tiny"
    """The synthetic generator's preset: tiny, kuairand-1k, kuairand-27k or movielens-20m (fsdata.synthetic)."""
    num_samples: int = 100_000
    """Synthetic samples per epoch."""
    collision_rate: Optional[float] = None
    """Synthetic: the share of rows consecutive global batches share, in [0, 1]; unset: the preset's."""
    uih_cap: int = 21_000
    """The longest UIH kept per sample: its most recent events."""
    seed: int = 0
    """The synthetic generator's seed."""
    id_overflow: Optional[str] = None
    """Ids beyond the item table: ``error``, ``modulo`` or ``hash`` (fsdata.id_overflow). Unset takes what the
    dataset declares (Parquet metadata ``freescale.id_overflow``, the synthetic preset), else ``error``."""
    drop_bad_samples: bool = False
    """Parquet: leave out samples with non-finite dense values or labels, or labels outside [0, 1], counted in the
    summary's ``data_counts``. Off, such a sample is an error naming it."""
    unordered_timestamps: Optional[str] = None
    """Parquet: histories whose timestamps go backwards or are negative, for a model that reads time gaps (one that
    declares ``reads_time_gaps``, as the HSTU model does): ``sort`` (each history sorted oldest first; a negative
    time is still refused) or ``drop`` (left out, counted). Unset: refused for such a model, in one line naming
    file, row group and sample; served and counted for any other."""
    eval_path: Optional[str] = None
    """Held-out Parquet data: NE and AUC at the end, and every ``run.eval_every`` steps."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)
        if self.collision_rate is not None and not 0.0 <= self.collision_rate <= 1.0:
            raise refuse("data.collision_rate", f"must lie in [0, 1], got {self.collision_rate}")
        if self.uih_cap < 1:
            raise refuse("data.uih_cap", f"must be >= 1, got {self.uih_cap}")
        if self.path != "synthetic" and not Path(self.path).exists():
            raise ConfigError(
                f"{{}} {_literal(repr(self.path))} does not exist (use 'synthetic' or a Parquet path)", "data.path"
            )


@dataclass
class JobModelSection:
    """The ``[model]`` table of the job config (``config.model``): the model to train. Which kernel runs its
    attention is ``[kernels] attention_impl``."""

    TABLE: ClassVar[str] = "model"
    CHOICES: ClassVar[dict] = {"attention": ATTENTIONS, "positions": POSITIONS, "residual": RESIDUALS}

    name: str = "tiny"
    """A built-in preset (the softmax model's tiny, small, production; HSTU's hstu, hstu-large), or a factory of
    your own model: ``module:function`` (on sys.path, the current directory first) or ``path/to/file.py:function``;
    it gets this job's config and returns a ``pipelines.ModelSpec`` (docs/api.md)."""
    num_items: Optional[int] = None
    """The preset's item table rows, overridden."""
    dim: Optional[int] = None
    """The preset's width d, overridden."""
    num_layers: Optional[int] = None
    """The preset's transformer blocks, overridden."""
    max_uih: Optional[int] = None
    """The preset's longest UIH in the encoder, overridden."""
    attention: str = "jagged"
    """``jagged`` (each sample's own length) or ``padded`` (every sample padded to the batch's longest)."""
    positions: Optional[str] = None
    """The HSTU model's positions and time gaps: ``rab`` (a learned bias inside the attention, work per score),
    ``embeddings`` (learned input embeddings, a gather per token: recsys-examples' configuration), ``both`` or
    ``none``; unset: ``rab``. The HSTU presets' alone."""
    residual: Optional[str] = None
    """The HSTU model's residual stream under bf16 autocast (the CUDA default): ``fp32`` (unset) or ``bf16``, as
    Megatron-based trainers keep it (half the bytes of every pass over it, each layer's sum rounded to bf16;
    HSTUConfig.fp32_residual). The HSTU presets' alone."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)
        if self.num_items is not None and self.num_items < 1:
            raise refuse("model.num_items", f"must be >= 1, got {self.num_items}")
        for name in ("positions", "residual"):
            if getattr(self, name) is not None and self.name not in HSTU_PRESETS:
                raise refuse(f"model.{name}", f"is the HSTU presets' ({', '.join(HSTU_PRESETS)}), not {self.name}'s")


@dataclass
class JobEmbeddingsSection:
    """The ``[embeddings]`` table of the job config (``config.embeddings``): the row-wise sharded tables of the
    sharded modes (sync, sdd, semisync, freescale; optimizer and lr also torchrec's and torchrec-pec's), and when
    freescale's exchanges run."""

    TABLE: ClassVar[str] = "embeddings"
    CHOICES: ClassVar[dict] = {
        "optimizer": OPTIMIZER_CHOICES,
        "transport": TRANSPORT_CHOICES,
        "early_start": EARLY_STARTS,
        "exclusive_start": EXCLUSIVE_STARTS,
        "schedule": SCHEDULE_CHOICES,
    }

    optimizer: str = "sgd"
    """The tables' row-wise optimizer, fused into the backward: sgd, rowwise_adagrad or adam (fsembed)."""
    lr: float = 0.05
    """The tables' learning rate."""
    transport: str = "host"
    """What carries the embedding exchanges: ``host`` is SM-free (shared memory between ranks of one host, TCP
    across hosts), ``host-shm`` / ``host-tcp`` force one host path, ``rdma`` is the paper's SM-free ring over verbs
    (untested on real NICs), ``nccl`` NCCL's collectives. The loader's CPU-side exchanges always use host."""
    early_start: str = EARLY_START
    """freescale: when the next batch's fresh rows start."""
    exclusive_start: str = EXCLUSIVE_START
    """freescale: when deferred exclusive gradients leave."""
    schedule: str = "auto"
    """freescale's embedding schedule: prioritized, sdd, or auto (probes both, keeps the faster)."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)


@dataclass
class JobDenseSyncSection:
    """The ``[dense_sync]`` table of the job config (``config.dense_sync``): the dense gradients' all-reduce
    (pipelines.api.dense_sync), in buckets that start while the backward runs."""

    TABLE: ClassVar[str] = "dense_sync"
    CHOICES: ClassVar[dict] = {"allreduce_start": ALLREDUCE_STARTS}

    allreduce_start: str = "backward"
    """When the last bucket (with the step's bookkeeping block) is launched: ``backward`` or ``compute``."""
    bucket_mb: float = BUCKET_MB
    """The bucket size in MiB (the API's TrainStep default); 0: one all-reduce after the backward."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)
        if not self.bucket_mb >= 0:
            raise refuse("dense_sync.bucket_mb", f"must be >= 0, got {self.bucket_mb}")


@dataclass
class JobKernelsSection:
    """The ``[kernels]`` table of the job config (``config.kernels``): which kernel runs where a model leaves the
    choice to the job."""

    TABLE: ClassVar[str] = "kernels"
    CHOICES: ClassVar[dict] = {"attention_impl": ATTENTION_IMPLS}

    attention_impl: Optional[str] = None
    """The softmax model's jagged attention kernel on CUDA; unset: varlen (flex with ``run.deterministic``)."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)


@dataclass
class JobProcessSection:
    """The ``[process]`` table of the job config (``config.process``): each rank's process, its threads and where
    they run."""

    TABLE: ClassVar[str] = "process"
    CHOICES: ClassVar[dict] = {"numa_binding": NUMA_BINDINGS}

    threads: Optional[int] = None
    """torch intra-op threads per rank; unset: cores / local ranks on CPU, at most 2 on GPU."""
    gil_switch_ms: float = 1.0
    """Python's thread switch interval per rank, in ms."""
    numa_binding: Optional[str] = None
    """GPU runs: bind each rank's threads near its GPU."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)
        if not self.gil_switch_ms > 0:
            raise refuse("process.gil_switch_ms", f"must be > 0, got {self.gil_switch_ms}")


@dataclass
class JobRunSection:
    """The ``[run]`` table of the job config (``config.run``): how the job runs and what it writes."""

    TABLE: ClassVar[str] = "run"
    CHOICES: ClassVar[dict] = {"mode": tuple(MODES), "device": DEVICES, "precision": PRECISIONS}

    mode: str = "freescale"
    """How the embeddings train (pipelines.job.trainer): replicated, sync, sdd, semisync, freescale, torchrec (the
    real torchrec on CPU: the outside baseline) or torchrec-pec (torchrec's prioritized embedding communication)."""
    nproc: int = 2
    """Local ranks that `freescale train` launches (torchrun launches its own); per host with ``nnodes`` > 1."""
    nnodes: int = 1
    """Hosts of the job: `freescale train` runs on each, with its ``node_rank``, and their launchers (torch's elastic
    agents) meet at ``rdzv_endpoint`` (docs/reliability.md, Multi-node)."""
    node_rank: int = 0
    """This host's place among ``nnodes``: 0 on the host whose launcher serves the rendezvous at ``rdzv_endpoint``
    (its own address); the ranks' order among hosts is the rendezvous' (sorted by host name)."""
    rdzv_endpoint: Optional[str] = None
    """``HOST:PORT`` where the hosts meet (node 0's address and a free port); needed with ``nnodes`` > 1. Hosts that
    have not all joined within ``comm_timeout_s`` end the job."""
    steps: int = 20
    """The step the job trains to (after a resume too)."""
    warmup_steps: int = 1
    """The first steps, left out of the summary's timings (samples/s, step time, straggler, bubbles): they pay
    one-time costs such as kernel compilation and the first pinned-memory allocations; their wall time is reported
    apart (``warmup_s``)."""
    lr: float = 1e-3
    """The dense parameters' Adam learning rate."""
    seed: int = 0
    """The model's initialisation seed (the same initial weights on every rank)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda where available)."""
    precision: str = "auto"
    """bf16 (autocast), fp32, or auto: bf16 on CUDA, fp32 on CPU (docs/tuning.md)."""
    deterministic: bool = False
    """Bitwise reproducible steps (docs/tuning.md)."""
    eval_every: int = 0
    """Evaluate the held-out data (``data.eval_path``) every N steps too; 0: at the end only."""
    summary_json: Optional[str] = None
    """Where rank 0 writes the run summary (JSON)."""
    metrics_jsonl: Optional[str] = None
    """Where rank 0 writes one JSON line of metrics per step."""
    progress: bool = True
    """Rank 0's progress bar."""
    trace: Optional[str] = None
    """Profile a few steps past the warm-up; rank r writes ``PATH.rank{r}.json``."""
    comm_timeout_s: float = 300.0
    """Bounds every collective and hand-over between ranks (and the stage worker's and embedding chains' waits);
    past it the job stops with an error naming it and the rank(s) that did not arrive (torch's own default is
    30 minutes)."""
    verbose: bool = False
    """Print a failed rank's full traceback too."""
    log_dir: Optional[str] = None
    """Where `freescale train` writes each failed rank's full traceback; unset: a new temporary directory, named
    in the error line."""

    def validate(self) -> None:
        check_choices(self.TABLE, self)
        for key, low in (("nproc", 1), ("steps", 0), ("warmup_steps", 0), ("eval_every", 0)):
            if getattr(self, key) < low:
                raise refuse(f"run.{key}", f"must be >= {low}, got {getattr(self, key)}")
        if not self.comm_timeout_s > 0:
            raise refuse("run.comm_timeout_s", f"must be > 0, got {self.comm_timeout_s}")
        self._validate_nodes()

    def _validate_nodes(self) -> None:
        # named by their flags first (the field names of `refuse` read as a second vocabulary beside --node-rank)
        if self.nnodes < 1:
            raise ConfigError(f"{{}} must be >= 1, got {self.nnodes}", "run.nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"{{}} must be in 0..{self.nnodes - 1} ({{}} {self.nnodes}), got {self.node_rank}",
                "run.node_rank",
                "run.nnodes",
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(
                "{} > 1 needs {} HOST:PORT (node 0's address and a free port)", "run.nnodes", "run.rdzv_endpoint"
            )
        if self.rdzv_endpoint is not None:
            endpoint = _literal(repr(self.rdzv_endpoint))
            host, colon, port = self.rdzv_endpoint.rpartition(":")
            if colon and not host.strip("[]"):
                raise ConfigError(
                    f"{{}} {endpoint} names no host: give node 0's address before the port (HOST:PORT)",
                    "run.rdzv_endpoint",
                )
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"{{}} must be HOST:PORT with a port in 1..65535, got {endpoint}", "run.rdzv_endpoint"
                )


@dataclass
class JobCheckpointSection:
    """The ``[checkpoint]`` table of the job config (``config.checkpoint``): saving, resuming and exporting."""

    TABLE: ClassVar[str] = "checkpoint"
    CHOICES: ClassVar[dict] = {}

    dir: Optional[str] = None
    """The checkpoint directory (one job at a time holds it)."""
    every: int = 0
    """Save every N steps; 0: never."""
    resume: Optional[str] = None
    """``latest`` (the newest complete checkpoint in ``dir``) or a step directory."""
    async_save: bool = False
    """Save checkpoints in the background."""
    export: Optional[str] = None
    """Save the model's state_dict at the end (and ``PATH.json``, what built it); modes replicated and sharded."""

    def validate(self) -> None:
        if self.every < 0:
            raise refuse("checkpoint.every", f"must be >= 0, got {self.every}")
        if (self.every or self.resume == "latest") and not self.dir:
            raise ConfigError("{} and {}=latest need {}", "checkpoint.every", "checkpoint.resume", "checkpoint.dir")


# The sections, in the order of the TOML tables (and of `freescale train --help`).
SECTIONS = {
    "data": JobDataSection,
    "model": JobModelSection,
    "loader": LoaderConfig,
    "balancer": BalancerConfig,
    "embeddings": JobEmbeddingsSection,
    "dense_sync": JobDenseSyncSection,
    "kernels": JobKernelsSection,
    "process": JobProcessSection,
    "run": JobRunSection,
    "checkpoint": JobCheckpointSection,
}
TABLES = tuple(SECTIONS)

# Options that only some modes read: the others ignore them (JobConfig.ignored_options warns).
MODE_OPTIONS = {
    "balancer.partitioner": BALANCING,
    "balancer.alpha": BALANCING,
    "balancer.autotune": BALANCING,
    "balancer.min_gain": BALANCING,
    "balancer.memory_budget": BALANCING,
    "embeddings.transport": SHARDED,
    "embeddings.lr": (*SHARDED, *TORCHREC_MODES),
    "embeddings.optimizer": (*SHARDED, *TORCHREC_MODES),
    "embeddings.early_start": ("freescale",),
    "embeddings.exclusive_start": ("freescale",),
    "embeddings.schedule": ("freescale",),
    "checkpoint.export": ("replicated", *SHARDED),
}


def config_fields() -> dict[str, dataclasses.Field]:
    """Every field of every section, by its path (``run.steps``), in the order of the tables and their fields."""
    return {f"{table}.{f.name}": f for table, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


EXPECTED = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


@functools.cache
def _kinds(cls: type) -> dict[str, type]:
    """field name -> the type its values must have, from the class's annotations (``Optional`` dropped: None only
    ever comes from a default)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kind = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
        if kind not in EXPECTED:  # a new kind of field needs its own check here and its own flag parser
            raise TypeError(f"{cls.__name__}.{f.name}: config fields are int, float, bool or str, not {hint}")
        kinds[f.name] = kind
    return kinds


def field_kind(path: str) -> type:
    """The type of the config field at ``path`` (``run.steps``): int, float, bool or str."""
    table, key = path.split(".")
    return _kinds(SECTIONS[table])[key]


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


def check_types(table: str, section: Any) -> None:
    """Every field of ``section`` (the dataclass of ``table``) holds a value of its type, or None where that is its
    default: for a config built or changed in Python (flags and TOML values are checked as they are read)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        kind = _kinds(type(section))[f.name]
        problem = None if value is None and f.default is None else type_problem(kind, value, repr)
        if problem:
            raise ConfigError(f"{{}}: {_literal(problem)}", f"{table}.{f.name}")


@dataclass
class JobConfig:
    """The job's config: one section per TOML table (see the module's docstring). Validate it (``validate()``)
    before use: building one checks nothing."""

    data: JobDataSection = field(default_factory=JobDataSection)
    model: JobModelSection = field(default_factory=JobModelSection)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    embeddings: JobEmbeddingsSection = field(default_factory=JobEmbeddingsSection)
    dense_sync: JobDenseSyncSection = field(default_factory=JobDenseSyncSection)
    kernels: JobKernelsSection = field(default_factory=JobKernelsSection)
    process: JobProcessSection = field(default_factory=JobProcessSection)
    run: JobRunSection = field(default_factory=JobRunSection)
    checkpoint: JobCheckpointSection = field(default_factory=JobCheckpointSection)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "JobConfig":
        """A config of the defaults with ``values`` (path -> value, ``{"run.steps": 5}``) set; not validated."""
        by_table: dict[str, dict[str, Any]] = {table: {} for table in SECTIONS}
        for path, value in values.items():
            table, key = path.split(".")
            by_table[table][key] = value
        return cls(**{table: SECTIONS[table](**by_table[table]) for table in SECTIONS})

    def validate(self) -> "JobConfig":
        """The one validation: every section's types (:func:`type_problem`), each section's own ``validate()``,
        then what spans sections. Raises a one-line ValueError (ConfigError where it names fields)."""
        for table in SECTIONS:
            section = getattr(self, table)
            check_types(table, section)
            if not hasattr(section, "TABLE") and hasattr(section, "CHOICES"):  # the library's own (LoaderConfig)
                check_choices(table, section)
            section.validate()
        if self.run.eval_every and self.data.eval_path is None:
            raise ConfigError("{} needs {} (the held-out Parquet file)", "run.eval_every", "data.eval_path")
        if self.data.eval_path is not None and self.run.mode in TORCHREC_MODES:
            raise ConfigError(
                f"{{}}: mode {self.run.mode} (an outside baseline) has no held-out evaluation", "data.eval_path"
            )
        if self.run.mode in TORCHREC_MODES:
            self._validate_torchrec()
        if self.balancer.partitioner != "none":  # an unknown name or an unimportable module:function, before ranks
            from fsdata.partition import get_partitioner

            get_partitioner(self.balancer.partitioner, alpha=self.balancer.alpha)
        return self

    def _validate_torchrec(self) -> None:
        """Modes torchrec and torchrec-pec: the softmax model (torchrec-pec: or a factory's model with one torchrec
        EmbeddingCollection), on CPU, with an optimizer torchrec fuses there, no checkpoints."""
        from pipelines.models.torchrec_baseline import EMBEDDING_OPTIMIZERS, missing_packages, unavailable_message

        mode = self.run.mode
        missing = missing_packages()
        if missing:
            raise ValueError(unavailable_message(missing))
        if mode == "torchrec" and ":" in self.model.name:
            raise ConfigError(
                f"mode torchrec runs the softmax model only, not {{}} {_literal(repr(self.model.name))}", "model.name"
            )
        if mode == "torchrec-pec" and self.model.name in HSTU_PRESETS:
            raise ConfigError(f"mode {mode} does not run the HSTU model: {{}} {self.model.name}", "model.name")
        if self.run.device == "cuda":
            raise ConfigError(f"mode {mode} is a CPU baseline only: use {{}} cpu", "run.device")
        if self.embeddings.optimizer not in EMBEDDING_OPTIMIZERS:
            raise ConfigError(
                f"mode {mode} supports {{}} {' or '.join(EMBEDDING_OPTIMIZERS)}, not "
                f"{self.embeddings.optimizer!r} (torchrec's fused Adam fails on CPU)",
                "embeddings.optimizer",
            )
        if self.checkpoint.every or self.checkpoint.resume:
            raise ValueError(f"mode {mode} does not checkpoint or resume (it is a baseline run, not a job)")

    def ignored_options(self, explicit: set[str], name: Callable[[str], str] = lambda path: path) -> list[str]:
        """One warning per option set explicitly (``explicit``: paths) that the chosen mode ignores, naming the
        option by ``name(path)`` (the command line: its flag)."""
        return [
            f"{name(path)} is ignored in mode {self.run.mode} (it applies to mode(s) {', '.join(modes)})"
            for path, modes in MODE_OPTIONS.items()
            if path in explicit and self.run.mode not in modes
        ]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
