"""Checkpoints: model, optimizer, loader state and the step, one file per rank, written atomically.

    <dir>/step_000040/rank0.pt ... rank{W-1}.pt, then <dir>/step_000040/COMPLETE (written last, by rank 0,
    after every rank has written its file), so a crash mid-save never leaves a checkpoint that looks whole.

Each rank stores its own loader state (torchtitan's habit): the loader's state is per rank by nature (the
prefetcher's snapshot, balancer state in flight). On load it is checked against the world size: the same world
size restores every rank's loader exactly; another world size restores only what is world-size independent —
the dense model and optimizer (replicated) and the global data cursor (epoch, samples consumed), so no sample is
lost or repeated — and starts the loader's balancer state afresh. Row-wise sharded tables are resharded from
every old rank's shard (fsembed.reshard), with their optimizer state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
LOADER_KEY = "loader"
STEP_KEY = "step"
WORLD_SIZE_KEY = "world_size"
CURSOR_KEY = "cursor"  # {epoch, cursor} of the global reader: the world-size independent position
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save(root: str | Path, step: int, rank: int, world_size: int, payload: dict[str, Any]) -> Path:
    """Every rank calls this at the same step (it ends in a barrier)."""
    directory = step_dir(Path(root), step)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"rank{rank}.pt"
    tmp = target.with_suffix(".tmp")
    torch.save({**payload, STEP_KEY: step, WORLD_SIZE_KEY: world_size}, tmp)
    os.replace(tmp, target)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (directory / COMPLETE_MARKER).write_text(f"{world_size}\n")
    if dist.is_initialized():
        dist.barrier()
    return directory


def latest(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / COMPLETE_MARKER).exists()
    )
    return steps[-1][1] if steps else None


def saved_world_size(directory: str | Path) -> int:
    marker = Path(directory) / COMPLETE_MARKER
    if not marker.exists():
        raise ValueError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return int(marker.read_text().split()[0])


def load_all(directory: str | Path) -> list[dict[str, Any]]:
    """Every old rank's payload, in rank order (resharding row-wise tables needs all their shards)."""
    return [torch.load(Path(directory) / f"rank{r}.pt", map_location="cpu", weights_only=False)
            for r in range(saved_world_size(directory))]


def load(directory: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], bool]:
    """This rank's checkpoint payload and whether it was written by the same world size.

    On another world size, rank ``r`` reads the file of rank ``r % old_world_size`` (dense state is replicated;
    the caller must take only world-size independent parts from it).
    """
    directory = Path(directory)
    saved_world = saved_world_size(directory)
    path = directory / f"rank{rank % saved_world}.pt"
    if not path.exists():
        raise ValueError(f"checkpoint {directory} lacks {path.name} (written by {saved_world} ranks)")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if int(payload[WORLD_SIZE_KEY]) != saved_world:
        raise ValueError(f"{path}: written by world size {payload[WORLD_SIZE_KEY]}, marker says {saved_world}")
    return payload, saved_world == world_size
