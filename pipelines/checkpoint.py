"""Checkpoints: model, optimizer, loader state and the step, one file per rank, written atomically.

    <dir>/step_000040/rank0.pt ... rank{W-1}.pt, then <dir>/step_000040/COMPLETE (written last, by rank 0,
    after every rank has written its file), so a crash mid-save never leaves a checkpoint that looks whole.

Each rank stores its own loader state (torchtitan's habit): the loader's state is per rank by nature (the
prefetcher's snapshot, balancer state in flight). On load it is checked against the world size: the same world
size restores every rank's loader exactly; another world size restores only what is world-size independent —
the dense model and optimizer (replicated) and the global data cursor (epoch, samples consumed), so no sample is
lost or repeated — and starts the loader's balancer state afresh. Row-wise sharded tables are resharded from
every old rank's shard (fsembed.reshard), with their optimizer state.

A complete checkpoint needs every rank's file: each holds only its rank's shard of the sharded tables (their
state's keys say so: ``rank`` and ``world_size`` beside ``tables``). ``state_dict()`` of a model with sharded
tables issues no collective; the exchanges still in flight land first through the pipeline's ``flush()``, which
every rank calls before saving (the trainer does).

Loading is safe: every file is read with ``torch.load(weights_only=True)`` (tensors, numbers, strings and plain
containers only), so a checkpoint directory from elsewhere cannot run code; a file carrying anything else (a
pickled function, a class instance) is refused with one line naming it, before any of it is used.
"""

from __future__ import annotations

import os
import pickle
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
        raise ValueError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER} marker: the save was "
                         "interrupted, or this is not a step directory)")
    try:
        return int(marker.read_text().split()[0])
    except (ValueError, IndexError):
        raise ValueError(f"{marker}: unreadable marker (expected the world size)") from None


def check_complete(directory: str | Path) -> int:
    """The world size of the checkpoint in ``directory``; ValueError (one line) if it is missing or incomplete."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint {directory} does not exist (give a step directory, or --resume latest)")
    world = saved_world_size(directory)
    missing = [f"rank{r}.pt" for r in range(world) if not (directory / f"rank{r}.pt").is_file()]
    if missing:
        raise ValueError(f"checkpoint {directory} is incomplete: it lacks {', '.join(missing)} (written by {world} ranks)")
    return world


def read_file(path: str | Path) -> dict[str, Any]:
    """One rank's payload, loaded with ``weights_only=True``; anything but weights and plain data is refused."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain data, which loading would "
                         f"run as code ({first or 'not a weights-only file'})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path}: not a readable checkpoint file (truncated or corrupt?): {' '.join(str(e).split())[:200]}") from None
    if not isinstance(payload, dict) or WORLD_SIZE_KEY not in payload:
        raise ValueError(f"{path}: not a FreeScale checkpoint (no {WORLD_SIZE_KEY!r} entry)")
    return payload


def load_all(directory: str | Path) -> list[dict[str, Any]]:
    """Every old rank's payload, in rank order (resharding row-wise tables needs all their shards)."""
    return [read_file(Path(directory) / f"rank{r}.pt") for r in range(check_complete(directory))]


def load(directory: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], bool]:
    """This rank's checkpoint payload and whether it was written by the same world size.

    On another world size, rank ``r`` reads the file of rank ``r % old_world_size`` (dense state is replicated;
    the caller must take only world-size independent parts from it).
    """
    directory = Path(directory)
    saved_world = check_complete(directory)
    path = directory / f"rank{rank % saved_world}.pt"
    payload = read_file(path)
    if int(payload[WORLD_SIZE_KEY]) != saved_world:
        raise ValueError(f"{path}: written by world size {payload[WORLD_SIZE_KEY]}, marker says {saved_world}")
    return payload, saved_world == world_size
