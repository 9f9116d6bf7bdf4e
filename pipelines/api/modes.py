"""The training modes (``--mode``, ``wrap_model(mode=...)``, bench e2e's ``--modes``): the one list of their names
and of what each one is. A mode names an embedding schedule (fsembed.schedules) for tables FreeScale shards, or
none, and says whether the job composes the balancer's stages.

    replicated  data parallel, embedding tables replicated and all-reduced with the dense part; balanced
    sync        tables row-wise sharded, blocking ID/embedding/gradient AllToAlls in the step (vanilla TorchRec)
    sdd         sync, with the next batch's ID AllToAll overlapped (TorchRec's TrainPipelineSparseDist)
    semisync    the next batch's embeddings prefetched before this step's update: stale rows (TrainPipelineSemiSync)
    freescale   balancer + prioritized embedding updates, switching to sdd's schedule at run time where that is
                faster (pipelines.job.run.schedule_probe's probe; exact either way)
    torchrec    the real torchrec DistributedModelParallel + TrainPipelineSparseDist, CPU only: the outside
                baseline (pipelines.models.torchrec_baseline)
    torchrec-pec  torchrec's Prioritized Embedding Communication (PEC) driven as upstream's TrainPipelinePEC,
                CPU only: the outside counterpart of freescale's prioritized updates (pipelines.models.torchrec_pec)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsembed.schedules import RUNTIME_SCHEDULES, SCHEDULES


@dataclass(frozen=True)
class Mode:
    name: str
    #: the embedding schedule of the tables FreeScale shards (fsembed.schedules); None: FreeScale shards none
    schedule: Optional[str]
    #: `freescale train` composes the balancer's stages (the Python API balances in any mode it is given them)
    balances: bool
    #: the schedules it may switch between at run time (pipelines.job.run.schedule_probe); empty: it keeps ``schedule``
    switches: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"mode {self.name}: unknown embedding schedule {self.schedule!r}")


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("replicated", None, balances=True),
        Mode("sync", "sync", balances=False),
        Mode("sdd", "sdd", balances=False),
        Mode("semisync", "semisync", balances=False),
        Mode("freescale", "prioritized", balances=True, switches=RUNTIME_SCHEDULES),
        Mode("torchrec", None, balances=False),
        Mode("torchrec-pec", None, balances=False),
    )
}
#: The modes whose tables FreeScale shards (wrap_model's modes).
SHARDED = tuple(name for name, m in MODES.items() if m.schedule is not None)
#: The modes that train through torchrec itself (CPU baselines, no checkpoints).
TORCHREC_MODES = ("torchrec", "torchrec-pec")
#: The modes in which `freescale train` balances.
BALANCING = tuple(name for name, m in MODES.items() if m.balances)


def get_mode(name: str, allowed: tuple[str, ...] = tuple(MODES), who: str = "mode") -> Mode:
    """The mode named ``name``, one of ``allowed``."""
    if name not in allowed:
        raise ValueError(f"{who} must be one of {', '.join(allowed)}, got {name!r}")
    return MODES[name]
