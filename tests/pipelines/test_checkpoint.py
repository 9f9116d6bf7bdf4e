"""Distributed checkpoints (pipelines.job.checkpoint, pipelines.job.dcp): row-wise shards of uneven tables across world
sizes, async saves, a resume from another world size equal to a run started there, refused crafted files, and the
faults of a save or a resume (a full disk, a broken newest step) in one line each."""

from __future__ import annotations

import errno
import os
import pickle
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelines.job import checkpoint, dcp, dcp_state
from tests.harness import run_ranks, stage


class _RunsCode:
    """Unpickling this runs a shell command that leaves a file behind: the sign that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dense(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save_one(tmp_path: Path, step: int = 2) -> Path:
    model, optimizer = _dense()
    saver = checkpoint.Checkpointer(tmp_path / "ck", 0, 1)
    return saver.save(step, model, optimizer, {"position": step}, {"epoch": 0, "cursor": 8 * step})


def test_a_checkpoint_restores_model_optimizer_and_position_exactly(tmp_path):
    directory = _save_one(tmp_path)
    assert (directory / ".metadata").is_file() and (directory / "COMPLETE").read_text() == "1 dcp\n"
    assert not list(directory.glob("*.tmp"))
    saved_model, saved_optimizer = _dense()
    model, optimizer = _dense(seed=1)
    restored = checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore("latest", model, optimizer)
    assert (restored.step, restored.cursor, restored.loader_state) == (2, 16, {"position": 2})
    for a, b in zip(saved_model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    want, got = saved_optimizer.state_dict(), optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, s in want["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in s.items())


def test_crafted_metadata_is_refused_and_nothing_runs(tmp_path, capsys):
    directory = _save_one(tmp_path)
    marker = tmp_path / "ran"
    (directory / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(
        ValueError, match=r"\.metadata: refused: it names posix\.system, which loading would run as code"
    ):
        checkpoint.check_complete(directory)  # the launcher's check, before any rank starts
    with pytest.raises(ValueError, match="refused"):
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
    from pipelines.cli import main

    assert main(["train", "--nproc", "1", "--device", "cpu", "--no-progress", "--resume", str(directory)]) == 2
    err = capsys.readouterr().err
    assert "refused: it names posix.system" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


def test_a_crafted_state_item_is_refused_and_nothing_runs(tmp_path):
    """A DCP item that is a pickled object (the stock planner would torch.load it with weights_only=False)."""
    import torch.distributed.checkpoint as stock

    directory = _save_one(tmp_path)
    marker = tmp_path / "ran"
    with warnings.catch_warnings():  # DCP warns that it assumes a single process: it is one
        warnings.simplefilter("ignore")
        stock.save(
            {"model.0.weight": _RunsCode(marker)},
            storage_writer=stock.FileSystemWriter(str(tmp_path / "crafted")),
            no_dist=True,
        )
    for name in (".metadata", "__0_0.distcp"):  # the crafted item in place of the checkpoint's index and data
        (directory / name).write_bytes((tmp_path / "crafted" / name).read_bytes())
    with pytest.raises(ValueError, match="refused: item 'model.0.weight' is a pickled object"):
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
    with pytest.raises(BaseException, match="refused: checkpoint item 'model.0.weight' is a pickled object"):
        dcp.load(directory, {"model.0.weight": torch.empty(3, 4)}, {})  # the planner refuses it too, unchecked
    assert not marker.exists()


def _no_space_left(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_one_line_with_path_payload_and_free_bytes_and_nothing_half_written(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    model, optimizer = _dense()
    saver = checkpoint.Checkpointer(tmp_path / "ck", 0, 1)
    saver.save(2, model, optimizer, {}, {"epoch": 0, "cursor": 16})
    create_stream = FileSystem.create_stream

    def full_for_data(self, path, mode):
        if str(path).endswith(".distcp"):
            _no_space_left()
        return create_stream(self, path, mode)

    for where, patch in (
        ("rank file", (os, "write", _no_space_left)),
        ("DCP data", (FileSystem, "create_stream", full_for_data)),
    ):
        with monkeypatch.context() as m:
            m.setattr(*patch)
            with pytest.raises(checkpoint.CheckpointError) as failed:
                saver.save(4, model, optimizer, {}, {"epoch": 0, "cursor": 32})
        line = str(failed.value)
        assert "\n" not in line and f"{tmp_path / 'ck' / 'step_000004'}" in line, (where, line)
        assert "no space left on device: this rank writes " in line and "bytes are free there (statvfs)" in line, line
        step4 = tmp_path / "ck" / "step_000004"
        assert not (step4 / "COMPLETE").exists() and not list(step4.glob("*.tmp")), where
        assert checkpoint.complete_steps(tmp_path / "ck") == [tmp_path / "ck" / "step_000002"]


def test_a_truncated_file_is_named_in_a_whole_sentence(tmp_path):
    directory = _save_one(tmp_path)
    data = (directory / "rank0.pt").read_bytes()
    (directory / "rank0.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as failed:
        checkpoint.read_file(directory / "rank0.pt")
    assert str(failed.value).endswith(
        f"failed reading zip archive: failed finding central directory ({len(data) // 2} bytes)"
    )


# ---------------------------------------------------------------------------------------------- multi-process
def _tables(world_size: int, boundaries: dict) -> "nn.Module":
    """A model with three sharded tables (two of one width, so one group stacks them) under uneven boundaries;
    every row (and its Adagrad sum) holds a value of its global row number, whatever the world size."""
    from fsembed.optim import RowWiseAdagrad
    from fsembed.plan import ShardingPlan, TableConfig
    from fsembed.sharded import ShardedEmbeddingCollection

    tables = [TableConfig("a", 11, 4, ("fa",)), TableConfig("b", 7, 4, ("fb",)), TableConfig("c", 5, 2, ("fc",))]
    plan = ShardingPlan(tables, world_size, row_boundaries={k: torch.tensor(v) for k, v in boundaries.items()})
    rank = torch.distributed.get_rank()
    model = nn.Module()
    model.dense = nn.Linear(2, 2)
    # no lookups here: a placeholder transport spares the stage's process groups
    model.tables = ShardedEmbeddingCollection(plan, rank, transport=object(), optimizer=RowWiseAdagrad(lr=0.1))
    return model


def _expected(name: str, rows: torch.Tensor, dim: int, suffix: str) -> torch.Tensor:
    base = rows.double() + {"a": 0.0, "b": 100.0, "c": 200.0}[name]
    return base.float() * 0.5 if suffix == "sum" else (base[:, None] + torch.arange(dim) / 10).float()


def _fill(model) -> None:
    coll = model.tables
    for layout in coll.plan.groups:
        shard = coll.shards[layout.name]
        local = torch.arange(shard.weight.shape[0])
        for name, (mask, rows) in coll.plan.unstack(layout.name, local, coll.rank).items():
            shard.weight[mask] = _expected(name, rows, layout.dim, "weight")
            shard.state["sum"][mask] = _expected(name, rows, layout.dim, "sum")


def _check(model) -> list[str]:
    coll, wrong = model.tables, []
    for layout in coll.plan.groups:
        shard = coll.shards[layout.name]
        local = torch.arange(shard.weight.shape[0])
        for name, (mask, rows) in coll.plan.unstack(layout.name, local, coll.rank).items():
            if not torch.equal(shard.weight[mask], _expected(name, rows, layout.dim, "weight")):
                wrong.append(f"{name}.weight")
            if not torch.equal(shard.state["sum"][mask], _expected(name, rows, layout.dim, "sum")):
                wrong.append(f"{name}.sum")
    return wrong


def _save_uneven(rank, world_size, root):
    torch.manual_seed(0)
    model = _tables(world_size, {"a": [0, 9, 11], "b": [0, 1, 7], "c": [0, 5, 5]})  # rank 1: no row of c
    _fill(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    saver = checkpoint.Checkpointer(root, rank, world_size, async_save=True)
    stage("async save")
    saver.save(3, model, optimizer, {"rank": rank}, {"epoch": 1, "cursor": 24})
    with torch.no_grad():  # training goes on while the save writes: the checkpoint keeps the values of step 3
        model.dense.weight.add_(1.0)
        for shard in model.tables.shards.values():
            shard.weight.add_(1.0)
    saver.wait()
    return None


def _load_uneven(rank, world_size, root):
    torch.manual_seed(1)
    model = _tables(world_size, {"a": [0, 2, 3, 11], "b": [0, 7, 7, 7], "c": [0, 1, 4, 5]})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    restored = checkpoint.Checkpointer(root, rank, world_size).restore("latest", model, optimizer)
    torch.manual_seed(0)
    return (
        _check(model),
        torch.equal(model.dense.weight, nn.Linear(2, 2).weight),
        restored.loader_state,
        restored.cursor,
    )


@pytest.mark.multiprocess
def test_uneven_row_shards_saved_async_at_2_ranks_load_at_3_with_other_boundaries(tmp_path):
    run_ranks(_save_uneven, 2, args=(tmp_path / "ck",), timeout=60)
    md = dcp.read_metadata(tmp_path / "ck" / "step_000003")
    chunks = {
        k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
        for k, v in md.state_dict_metadata.items()
        if k.startswith("tables.")
    }
    assert chunks["tables.tables.a.weight"] == [((0, 0), (9, 4)), ((9, 0), (2, 4))]
    assert chunks["tables.tables.c.sum"] == [((0,), (5,))]  # a rank without rows writes no chunk
    for wrong, dense_equal, loader_state, cursor in run_ranks(_load_uneven, 3, args=(tmp_path / "ck",), timeout=60):
        assert wrong == [] and dense_equal and loader_state is None and cursor == 24


def _resume_latest(rank, world_size, root):
    model, optimizer = _dense()
    saver = checkpoint.Checkpointer(root, rank, world_size)
    for step in (2, 4, 6):
        saver.save(step, model, optimizer, {"step": step}, {"epoch": 0, "cursor": step})
    torch.distributed.barrier()
    if rank == 1:  # the newest step: rank 1's own file cut in half; the one before: a DCP data file cut short
        data = (root / "step_000006" / "rank1.pt").read_bytes()
        (root / "step_000006" / "rank1.pt").write_bytes(data[: len(data) // 2])
        data = (root / "step_000004" / "__0_0.distcp").read_bytes()
        (root / "step_000004" / "__0_0.distcp").write_bytes(data[:100])
    torch.distributed.barrier()
    apply = dcp_state.apply

    def slow_apply(*args, **kwargs):
        time.sleep(1.0)
        apply(*args, **kwargs)
        (root / "rank1.loaded").write_text(str(time.time()))

    if rank == 1:
        dcp_state.apply = slow_apply
    restored = saver.restore("latest", *_dense(seed=1))
    returned = time.time()
    torch.distributed.barrier()
    loaded = float((root / "rank1.loaded").read_text())
    return restored.directory.name, restored.loader_state, restored.skipped, returned >= loaded


@pytest.mark.multiprocess
def test_resume_latest_takes_the_newest_step_every_rank_can_load_and_says_what_it_skipped(tmp_path):
    results = run_ranks(_resume_latest, 2, args=(tmp_path / "ck",), timeout=60)
    for rank, (name, loader_state, skipped, after_all_loaded) in enumerate(results):
        assert name == "step_000002" and loader_state == {"step": 2}
        assert (
            skipped[0].startswith("step_000006 (rank 1: ") and "rank1.pt: not a readable checkpoint file" in skipped[0]
        )
        assert "rank 0:" not in skipped[0], skipped[0]
        assert skipped[1].startswith("step_000004 (rank 0: ") and "__0_0.distcp: cut short" in skipped[1]
        assert after_all_loaded, f"rank {rank} returned before rank 1 had loaded"


def _trainer(rank, world_size, steps, root, **train):
    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config("freescale", steps)
    cfg.train.checkpoint_dir = str(root)
    for name, value in train.items():
        setattr(cfg.train, name, value)
    return Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu"))


def _save_at_start(rank, world_size, root):
    with _trainer(rank, world_size, 3, root) as trainer:
        trainer.save_checkpoint(None)


def _losses(rank, world_size, root, resume, steps, **train):
    with _trainer(rank, world_size, steps, root, resume=resume, **train) as trainer:
        trainer.train()
        return [r["loss"] for r in trainer.history]


def _fresh_and_resumed(rank, world_size, root):
    fresh = _losses(rank, world_size, root, None, 3)
    # Another seed: the resumed run's own initial model differs, so only what it loads can make it train alike.
    return fresh, _losses(rank, world_size, root, str(root / "step_000000"), 3, seed=1)


@pytest.mark.multiprocess
def test_a_2_rank_checkpoint_resumed_at_3_ranks_trains_as_a_3_rank_run_from_that_state(tmp_path):
    """The state at step 0 is known at every world size (the tables' init does not depend on it): saved by 2 ranks
    and resumed by 3 (whose own init is another seed's), it trains to the same losses, bit for bit, as 3 ranks that
    start there."""
    run_ranks(_save_at_start, 2, args=(tmp_path / "ck",), timeout=90)
    fresh, resumed = run_ranks(_fresh_and_resumed, 3, args=(tmp_path / "ck",), timeout=120)[0]
    assert len(fresh) == 3 and resumed == fresh


def _async_straight_and_resumed(rank, world_size, root):
    straight = _losses(rank, world_size, root, None, 4, checkpoint_every=2, async_checkpoint=True)
    return straight, _losses(rank, world_size, root, str(root / "step_000002"), 4)


@pytest.mark.multiprocess
def test_async_checkpoints_resume_exactly(tmp_path):
    straight, resumed = run_ranks(_async_straight_and_resumed, 2, args=(tmp_path / "ck",), timeout=120)[0]
    assert (tmp_path / "ck" / "step_000004" / "COMPLETE").exists()  # the last save was waited for at the end
    assert len(straight) == 4 and resumed == straight[2:]
