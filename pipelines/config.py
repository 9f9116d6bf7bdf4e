"""Job configuration: small nested dataclasses, one per builder, with a help string per field.

Precedence: command-line flags > TOML file (``--config job.toml``, one table per section) > defaults. Every
field is a flag named after it (``--batch-size``, ``--steps``...); names are unique across sections so the flags
stay short. All validation happens in :meth:`JobConfig.validate`, once, with ValueErrors that name the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fsdata.balancer import BalancerConfig
from fsdata.loader import LoaderConfig
from fsdata.schema import ID_OVERFLOW_CHOICES
from pipelines.schedule import SCHEDULE_CHOICES


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class DataConfig:
    data: str = _f("synthetic", "'synthetic' or a Parquet file / directory of Parquet files")
    preset: str = _f("tiny", "synthetic preset (tiny, kuairand-1k, kuairand-27k, movielens-20m)")
    num_samples: int = _f(100_000, "synthetic samples per epoch")
    collision_rate: Optional[float] = _f(None, "synthetic: fraction of rows shared by consecutive batches")
    uih_cap: int = _f(21_000, "longest UIH kept (most recent items); longer ones are truncated and counted")
    data_seed: int = _f(0, "seed of the synthetic generator")
    id_overflow: Optional[str] = _f(None, "ids beyond the model's item table: error, modulo (id % rows) or hash; unset: what the dataset declares (Parquet metadata freescale.id_overflow, the synthetic preset), else error")
    drop_bad_samples: bool = _f(False, "Parquet: leave out samples with non-finite dense values or labels, or labels outside [0, 1], counted in the summary's source_stats (default: such a sample is an error naming it)")


@dataclass
class ModelSection:
    model: str = _f("tiny", "reference model preset (tiny, small, production), or a factory of your own model: "
                            "module:function (on sys.path, the current directory first) or path/to/file.py:function "
                            "(docs/api.md: it gets this job's config and returns a pipelines.ModelSpec)")
    num_items: Optional[int] = _f(None, "override the preset's item table rows (ids beyond it: see --id-overflow)")
    dim: Optional[int] = _f(None, "override the preset's width d")
    num_layers: Optional[int] = _f(None, "override the preset's number of transformer blocks")
    max_uih: Optional[int] = _f(None, "override the preset's longest UIH seen by the encoder")
    attention: str = _f("jagged", "attention of the reference model: jagged (packed tokens, no padding: FlexAttention on CUDA, per-sample SDPA on CPU) or padded (SDPA over batches padded to their longest sample, for comparison)")


@dataclass
class TrainConfig:
    mode: str = _f("freescale", "replicated, sync, sdd, semisync, freescale, or torchrec (the real torchrec, CPU reference; see pipelines.trainer)")
    embedding_optimizer: str = _f("sgd", "row-wise optimizer of sharded tables: sgd, rowwise_adagrad, adam")
    embedding_lr: float = _f(0.05, "learning rate of the sharded tables")
    nproc: int = _f(2, "local ranks launched by `freescale train` (ignored under torchrun)")
    steps: int = _f(20, "training steps (global batches)")
    warmup_steps: int = _f(1, "first steps left out of the summary's timings (samples/s, step time, straggler, bubbles): one-time costs such as kernel compilation and the first pinned-memory allocations; their wall time is reported apart (warmup_s)")
    lr: float = _f(1e-3, "Adam learning rate of the dense part (and SGD rate of embeddings)")
    seed: int = _f(0, "model initialisation seed (same on every rank)")
    device: str = _f("auto", "cpu, cuda or auto (cuda when available)")
    summary_json: Optional[str] = _f(None, "write the final run summary here")
    metrics_jsonl: Optional[str] = _f(None, "write one JSON line of metrics per step here (rank 0)")
    threads: Optional[int] = _f(None, "torch intra-op threads per rank (default: cores / local ranks on CPU; at most 2 on GPU, where they only run small host ops beside the loader and exchange threads)")
    progress: bool = _f(True, "progress bar on rank 0")
    checkpoint_dir: Optional[str] = _f(None, "directory of checkpoints (model, optimizer, loader state, step)")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (0: never)")
    resume: Optional[str] = _f(None, "'latest' (newest complete checkpoint in --checkpoint-dir) or a step directory")
    trace: Optional[str] = _f(None, "write a torch.profiler trace (Chrome/Perfetto JSON) of a few steps here; rank r writes PATH.rank{r}.json")
    gil_switch_ms: float = _f(1.0, "Python's thread switch interval (sys.setswitchinterval) per rank, in ms: how long a thread that wants the GIL (the training thread after each torch op) may wait while the stage worker or the embedding chains run Python; Python's default is 5")
    allreduce_start: str = _f("backward", "when the dense all-reduce's last bucket (with the bookkeeping block) is launched: backward (as soon as the backward is queued, as DDP does; the device runs it right after the backward) or compute (once the device has finished the backward: the host waits for it first)")
    bucket_mb: float = _f(1.0, "dense gradients are all-reduced in buckets of this many MiB, each as soon as the backward has produced it (DDP's bucket_cap_mb); 0: one all-reduce after the backward")
    early_start: str = _f("backward", "freescale: when the embedding stage's bulk chain starts looking up and sending the next batch's fresh rows (Algorithm 2's lines 6-7 and 12): backward (as the model's forward returns, so its Python runs beside the backward) or forward (as the forward issues them); the exchanges are the same")
    exclusive_start: str = _f("forward", "freescale: when a backward's exclusive gradients (deferred to the next step, Algorithm 2's line 18) leave on the bulk chain: backward (as soon as the backward has produced them) or forward (the default: held until the next forward has waited for its collision rows: they are not needed before, and do not then share the copy engines and the host transport with the collision gradients and the dense all-reduce at the step's end); the exchanges are the same")
    numa_binding: Optional[str] = _f(None, "GPU runs launched by `freescale train`: bind each rank's threads to CPUs near its GPU (torch's NUMA binding: node, socket, exclusive, core-complex; exclusive gives each local rank cores of its own); under torchrun pass --numa-binding to torchrun instead")
    embedding_schedule: str = _f("auto", "freescale: prioritized (Algorithm 2), sdd (the sdd mode's exchanges: for host-bound steps), or auto: probe both for a few steps after the warm-up and keep the faster (pipelines.schedule); exact either way")
    comm_timeout_s: float = _f(300.0, "seconds any collective or hand-over between ranks (and the stage worker's and embedding chains' waits) may take before the job stops with an error naming it and the rank(s) that did not arrive (torch's own default is 30 minutes)")
    verbose: bool = _f(False, "print the full traceback of an error raised on a rank (it is always written to the log file the error line names)")
    log_dir: Optional[str] = _f(None, "where `freescale train` writes each failed rank's full traceback (default: a new temporary directory, named in the error line)")
    transport: str = _f("host", "transport of the embedding exchanges: host (SM-free: shared memory between ranks of one host, TCP across hosts), host-shm or host-tcp (force one host path), nccl, rdma (the paper's SM-free ring over verbs; untested on real NICs). The loader's CPU-side exchanges always use host")


# nccl-ce (fscomm/nccl_ce.py) is not offered until it has run on two GPUs or more
TRANSPORT_CHOICES = ("host", "host-shm", "host-tcp", "nccl", "rdma")

MODES = ("replicated", "sync", "sdd", "semisync", "freescale", "torchrec")

# Options that only some modes read: the others ignore them (JobConfig.ignored_options warns).
_BALANCING = ("replicated", "freescale")
_SHARDED = ("sync", "sdd", "semisync", "freescale")
MODE_OPTIONS = {
    "partitioner": _BALANCING, "alpha": _BALANCING, "autotune": _BALANCING, "min_gain": _BALANCING,
    "transport": _SHARDED, "embedding_lr": (*_SHARDED, "torchrec"), "embedding_optimizer": (*_SHARDED, "torchrec"),
    "early_start": ("freescale",), "exclusive_start": ("freescale",), "embedding_schedule": ("freescale",),
}

SECTIONS = {
    "data": DataConfig,
    "model": ModelSection,
    "loader": LoaderConfig,
    "balancer": BalancerConfig,
    "train": TrainConfig,
}


@dataclass
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "JobConfig":
        if self.train.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.train.nproc}")
        if self.model.num_items is not None and self.model.num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {self.model.num_items}")
        if self.train.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.train.steps}")
        if self.train.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.train.warmup_steps}")
        if self.train.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.train.device!r}")
        if self.data.collision_rate is not None and not 0.0 <= self.data.collision_rate <= 1.0:
            raise ValueError(f"collision_rate must lie in [0, 1], got {self.data.collision_rate}")
        if self.model.attention not in ("jagged", "padded"):
            raise ValueError(f"attention must be jagged or padded, got {self.model.attention!r}")
        if self.data.uih_cap < 1:
            raise ValueError(f"uih_cap must be >= 1, got {self.data.uih_cap}")
        if self.data.data != "synthetic" and not Path(self.data.data).exists():
            raise ValueError(f"data path {self.data.data!r} does not exist (use 'synthetic' or a Parquet path)")
        if self.data.id_overflow not in (None, *ID_OVERFLOW_CHOICES):
            raise ValueError(f"id_overflow must be one of {', '.join(ID_OVERFLOW_CHOICES)}, got {self.data.id_overflow!r}")
        if self.train.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.train.mode!r}")
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
        if self.train.allreduce_start not in ("compute", "backward"):
            raise ValueError(f"allreduce_start must be compute or backward, got {self.train.allreduce_start!r}")
        if not self.train.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0, got {self.train.bucket_mb}")
        if self.train.early_start not in ("forward", "backward"):
            raise ValueError(f"early_start must be forward or backward, got {self.train.early_start!r}")
        if self.train.exclusive_start not in ("backward", "forward"):
            raise ValueError(f"exclusive_start must be backward or forward, got {self.train.exclusive_start!r}")
        if self.train.numa_binding not in (None, "node", "socket", "exclusive", "core-complex"):
            raise ValueError(f"numa_binding must be node, socket, exclusive or core-complex, got {self.train.numa_binding!r}")
        if self.train.embedding_schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"embedding_schedule must be one of {', '.join(SCHEDULE_CHOICES)}, got {self.train.embedding_schedule!r}")
        if self.train.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.train.transport!r}")
        if not self.train.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0, got {self.train.comm_timeout_s}")
        if self.balancer.partitioner != "none":  # an unknown name or an unimportable module:function, before ranks start
            from fsdata.partition import get_partitioner

            get_partitioner(self.balancer.partitioner, alpha=self.balancer.alpha)
        if self.balancer.autotune and self.balancer.partitioner != "vbs":
            raise ValueError(f"--autotune applies to the vbs partitioner, not {self.balancer.partitioner!r}")
        if not 0.0 <= self.balancer.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.balancer.min_gain}")
        self.loader.validate()
        return self

    def _validate_torchrec(self) -> None:
        from pipelines.torchrec_ref import EMBEDDING_OPTIMIZERS, missing_packages, unavailable_message

        missing = missing_packages()
        if missing:
            raise ValueError(unavailable_message(missing))
        if self.train.device == "cuda":
            raise ValueError("mode torchrec is a CPU reference only: use --device cpu")
        if self.train.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"mode torchrec supports embedding_optimizer {' or '.join(EMBEDDING_OPTIMIZERS)}, not "
                             f"{self.train.embedding_optimizer!r} (torchrec's fused Adam fails on CPU)")
        if self.train.checkpoint_every or self.train.resume:
            raise ValueError("mode torchrec does not checkpoint or resume (it is a reference run, not a job)")

    def ignored_options(self, explicit: set[str]) -> list[str]:
        """One warning per option set explicitly (``explicit``: field names) that the chosen mode ignores."""
        mode = self.train.mode
        out = []
        for name, modes in MODE_OPTIONS.items():
            if name in explicit and mode not in modes:
                out.append(f"--{name.replace('_', '-')} is ignored in mode {mode} (it applies to mode(s) {', '.join(modes)})")
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of every section (default None: an unset flag never overrides the TOML file)."""
    parser.add_argument("--config", help="TOML file with [data], [model], [loader], [balancer], [train] tables")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            help_text = f"{f.metadata['help']} (default: {f.default})"
            if kind == "bool":
                group.add_argument(_flag(f.name), dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
            else:
                conv = int if "int" in kind else float if "float" in kind else str
                group.add_argument(_flag(f.name), dest=f.name, default=None, type=conv, help=help_text)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    file_values: dict[str, dict] = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        with path.open("rb") as fh:
            file_values = tomllib.load(fh)
        unknown = set(file_values) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}; expected {sorted(SECTIONS)}")
    sections = {}
    explicit: set[str] = set()
    for section, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        values = dict(file_values.get(section, {}))
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"{args.config}: [{section}] has unknown key(s) {sorted(unknown)}")
        explicit.update(values)
        given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        explicit.update(given)
        values.update(given)
        sections[section] = cls(**values)
    config = JobConfig(**sections).validate()
    config.explicit = frozenset(explicit)  # what the user set (flags or TOML): for JobConfig.ignored_options
    return config
