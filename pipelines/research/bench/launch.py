"""How a multi-rank bench runs: on torchrun's ranks when launched under torchrun, else on ``--nproc`` local ranks
spawned here (gloo over a file store); rank 0's result comes back to the launching process."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Any, Callable, Optional

import torch.distributed as dist

RankMain = Callable[[Any, int, int], Optional[dict]]  # (args, rank, world_size) -> rank 0's result, else None


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(rank_main: RankMain, args: Any, name: str, env: Optional[dict[str, str]] = None) -> Optional[dict]:
    """Runs ``rank_main`` on every rank; returns rank 0's result (None on torchrun's other ranks). ``args`` needs
    ``timeout`` (seconds of the gloo group) and ``nproc`` (local ranks when not under torchrun); ``env``: variables
    the spawned ranks start with, where not set already."""
    timeout = datetime.timedelta(seconds=args.timeout)
    if under_torchrun():
        dist.init_process_group("gloo", timeout=timeout)
        try:
            return rank_main(args, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix=f"fs-bench-{name}-")
    out_path = os.path.join(tmp, "result.json")
    mp.spawn(_spawned, args=(args.nproc, rank_main, args, os.path.join(tmp, "store"), out_path, env or {}),
             nprocs=args.nproc)
    with open(out_path) as f:
        return json.load(f)


def _spawned(rank: int, world: int, rank_main: RankMain, args: Any, store_path: str, out_path: str,
             env: dict[str, str]) -> None:
    for key, value in env.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result = rank_main(args, rank, world)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def write_json(result: Any, path: Optional[str]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
