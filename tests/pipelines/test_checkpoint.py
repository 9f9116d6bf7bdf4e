"""Distributed checkpoints (pipelines.job.checkpoint): row-wise shards of uneven tables across world
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

from pipelines.job.checkpoint import checkpointer as checkpoint
from pipelines.job.checkpoint import dcp, dcp_state
from pipelines.job.checkpoint import manifest as checkpoint_manifest
from pipelines.job.checkpoint import reading as checkpoint_io
from tests.harness import doing, run_ranks


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


def _reseal(directory: Path, world_size: int = 1) -> None:
    """COMPLETE rewritten for the files as they are now, as anyone who can write the folder can: the sums find damage
    and mixed saves, they are no signature (what loads safely is the readers' work)."""
    files = {p.name: checkpoint_io.sum_file(p) for p in directory.iterdir() if p.name != "COMPLETE"}
    (directory / "COMPLETE").write_bytes(checkpoint_manifest.encode(world_size, "dcp", files))


def test_a_checkpoint_restores_model_optimizer_and_position_exactly(tmp_path):
    directory = _save_one(tmp_path)
    assert (directory / ".metadata").is_file() and not list(directory.glob("*.tmp"))
    manifest = checkpoint_manifest.read(directory)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "rank0.pt"] and manifest.world_size == 1
    for name, recorded in manifest.files.items():  # every file's size and sha256, each DCP item's bytes and crc32
        assert checkpoint_io.sum_file(directory / name).sha256 == recorded.sha256
        assert recorded.size == (directory / name).stat().st_size
    items = manifest.files["__0_0.distcp"].items
    assert [i.fqn for i in items][:2] == ["model.0.weight", "model.0.bias"]
    assert sum(i.length for i in items) == manifest.files["__0_0.distcp"].size  # DCP's items tile the data file
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
    with pytest.raises(ValueError, match=r"\.metadata: .* bytes, COMPLETE records"):  # not even unpickled
        checkpoint.check_complete(directory)
    _reseal(directory)  # COMPLETE made to match: the unpickler still refuses it
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
    _reseal(directory)
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
    with pytest.raises(ValueError, match=rf"rank0\.pt: {len(data) // 2} bytes, COMPLETE records {len(data)} \(cut"):
        checkpoint.read_file(directory / "rank0.pt")
    _reseal(directory)  # torch's own reading of it, named whole
    with pytest.raises(ValueError) as failed:
        checkpoint.read_file(directory / "rank0.pt")
    assert str(failed.value).endswith(
        f"failed reading zip archive: failed finding central directory ({len(data) // 2} bytes)"
    )


# ---------------------------------------------------------------------------------------------- paths, sums, marker
class _PathTo:
    """Pickles as a ``pathlib.PosixPath`` whose text is ``__0_0.distcp`` and whose parts lead to ``target``: what a
    crafted .metadata may hold (its classes include PosixPath, for DCP's own checkpoint_id)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        import copyreg
        import pathlib

        state = {"_drv": "", "_root": "/", "_parts": ["/", *self.target.parts[1:]], "_str": "__0_0.distcp"}
        return (copyreg._reconstructor, (pathlib.PosixPath, object, None), (None, state))


def _fifo_guard(fifo: Path, after_s: float = 20):
    """Opens the FIFO's writing end after ``after_s``, so that a reader that wrongly opened it fails, not hangs."""
    import threading

    def rescue():
        if not done.wait(after_s):
            with open(fifo, "wb") as f:
                f.write(b"not a checkpoint")

    done = threading.Event()
    threading.Thread(target=rescue, daemon=True).start()
    return done


def _point_data_at(directory: Path, how: str, outside: Path, world_size: int = 1) -> None:
    if how == "fifo-inside":
        (directory / "__0_0.distcp").unlink()
        os.mkfifo(directory / "__0_0.distcp")
    elif how == "link-out":
        (directory / "__0_0.distcp").unlink()
        (directory / "__0_0.distcp").symlink_to(outside)
    else:  # a path object in the metadata's storage entries, and COMPLETE made to match
        md = dcp.read_metadata(directory)
        for info in md.storage_data.values():
            info.relative_path = _PathTo(outside)
        (directory / ".metadata").write_bytes(pickle.dumps(md))
        _reseal(directory, world_size)


@pytest.mark.parametrize(
    "how, target, match",
    [
        ("path-object", "fifo", r"refused: file name '__0_0.distcp' is a pathlib.PosixPath, not a str"),
        ("path-object", "missing", r"refused: file name '__0_0.distcp' is a pathlib.PosixPath, not a str"),
        ("link-out", "fifo", r"__0_0\.distcp: refused: it leads to .*/outside, outside the checkpoint"),
        ("fifo-inside", "fifo", r"__0_0\.distcp: refused: a FIFO, not a regular file \(reading it could block\)"),
    ],
)
def test_a_data_file_outside_the_step_or_not_a_regular_file_is_refused_before_it_is_opened(
    tmp_path, how, target, match
):
    """The metadata's storage path a PosixPath that reads ``__0_0.distcp`` but leads to a FIFO (or a missing file)
    outside the step; a link out of the step; a FIFO in the step. Each is one line at once (a reader that opened
    the FIFO would wait for a writer: the guard ends that wait after 20 s, and the test fails on the time)."""
    directory = _save_one(tmp_path)
    outside = tmp_path / "outside"
    if target == "fifo":
        os.mkfifo(outside)
    _point_data_at(directory, how, outside)
    done = _fifo_guard(directory / "__0_0.distcp" if how == "fifo-inside" else outside) if target == "fifo" else None
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match=match):
            checkpoint.check_complete(directory)  # the launcher's check
        with pytest.raises(checkpoint.CheckpointError, match=match) as failed:
            checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
        with pytest.raises(BaseException, match="refused"):  # DCP's reading, asked directly, opens nothing either
            dcp.load(directory, {"model.0.weight": torch.empty(3, 4)}, {})
    finally:
        if done is not None:
            done.set()
    assert time.monotonic() - started < 10 and "\n" not in str(failed.value)
    assert str(tmp_path / "outside") not in str(failed.value) or how == "link-out"  # never a path it did not check


def _flip(path: Path, at: int, data: bytes = b"\xff") -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_damaged_bytes_of_the_same_size_are_named_by_file_and_item(tmp_path):
    directory = _save_one(tmp_path)
    items = {i.fqn: i for i in checkpoint_manifest.read(directory).files["__0_0.distcp"].items}
    weight = items["model.2.weight"]
    _flip(directory / "__0_0.distcp", weight.start + weight.length // 2)  # a tampered item
    line = checkpoint.problem(directory, 0, 1)
    assert line == (
        f"{directory}/__0_0.distcp: item 'model.2.weight', bytes {weight.start}..{weight.start + weight.length} "
        "differs from its checksum in COMPLETE: its bytes changed after the save (damaged, or written over by another "
        "job)"
    )
    with pytest.raises(checkpoint.CheckpointError) as failed:  # an explicit --resume of it: that one line
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
    assert str(failed.value) == line

    directory = _save_one(tmp_path, step=4)  # the tail zero-filled, the size kept
    size = (directory / "__0_0.distcp").stat().st_size
    _flip(directory / "__0_0.distcp", size - 600, bytes(600))
    items = checkpoint_manifest.read(directory).files["__0_0.distcp"].items
    first = next(i for i in items if i.start + i.length > size - 600)
    assert f"__0_0.distcp: item {first.fqn!r}" in checkpoint.problem(directory, 0, 1)
    _flip(directory / "rank0.pt", 100)  # a rank file's byte: the rank file is read (and checked) first
    assert "rank0.pt: sha256 differs from the one COMPLETE records" in checkpoint.problem(directory, 0, 1)


def test_an_item_that_verifies_but_does_not_load_is_named_and_latest_falls_back_past_it(tmp_path, monkeypatch):
    """An item's bytes replaced and COMPLETE resealed to match: the sums pass, the item is decoded as the load would
    and named; a step whose load itself fails (for any reason) is skipped too, with the model left as the older
    step has it; the steps without COMPLETE newer than the one taken are listed."""
    _save_one(tmp_path, step=2)
    directory = _save_one(tmp_path, step=4)
    item = next(i for i in checkpoint_manifest.read(directory).files["__0_0.distcp"].items if i.fqn == "model.0.bias")
    _flip(directory / "__0_0.distcp", item.start, bytes(item.length))
    _reseal(directory)
    line = checkpoint.problem(directory, 0, 1)
    assert (
        line.startswith(
            f"{directory}/__0_0.distcp: item 'model.0.bias', bytes {item.start}..{item.start + item.length}: does not "
            "load: "
        )
        and "\n" not in line
    ), line
    with pytest.raises(checkpoint.CheckpointError) as failed:  # an explicit --resume of it: that one line
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
    assert str(failed.value) == line
    (tmp_path / "ck" / "step_000006").mkdir()  # a save cut off before its marker
    (tmp_path / "ck" / "step_000006" / "rank0.pt").write_bytes(b"partial")
    model, optimizer = _dense(seed=1)
    restored = checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore("latest", model, optimizer)
    assert restored.step == 2 and restored.skipped == [f"step_000004 (rank 0: {line})"]
    assert checkpoint.incomplete_steps(tmp_path / "ck", restored.directory) == ["step_000006"]

    model, optimizer = _dense(seed=2)  # step 4 whole again, of another model; now its load fails after the checks
    checkpoint.Checkpointer(tmp_path / "ck", 0, 1).save(4, model, optimizer, {}, {"epoch": 0, "cursor": 32})
    apply = dcp_state.apply

    def fails_at_step_4(directory, *args, **kwargs):
        apply(directory, *args, **kwargs)  # the model is loaded with step 4's state when it fails
        if directory.name == "step_000004":
            raise ValueError(f"checkpoint {directory}: does not fit (a fault of the load itself)")

    monkeypatch.setattr(dcp_state, "apply", fails_at_step_4)
    model, optimizer = _dense(seed=1)
    restored = checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore("latest", model, optimizer)
    assert restored.step == 2 and len(restored.skipped) == 1 and "a fault of the load itself" in restored.skipped[0]
    expect_model, expect_optimizer = _dense()  # what step 2 saved: none of step 4's state remains
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expect_model.state_dict().values()))
    assert str(optimizer.state_dict()) == str(expect_optimizer.state_dict())


def test_a_complete_marker_cut_in_half_is_a_step_that_does_not_verify(tmp_path):
    directory = _save_one(tmp_path)
    text = (directory / "COMPLETE").read_text()
    (directory / "COMPLETE").write_text(text[: len(text) // 2])
    line = checkpoint.problem(directory, 0, 1)
    assert line.startswith(f"{directory}/COMPLETE: unreadable marker (cut short or damaged?): ") and "\n" not in line
    with pytest.raises(checkpoint.CheckpointError, match="unreadable marker"):
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())
    (directory / "COMPLETE").write_text("1 ")  # a marker of the earlier kind ("1 dcp") cut short
    with pytest.raises(checkpoint.CheckpointError, match=r"COMPLETE: says one file per rank .* damaged \(cut short"):
        checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore(str(directory), *_dense())


def test_a_step_whose_marker_predates_checksums_loads_and_says_it_was_not_verified(tmp_path):
    directory = _save_one(tmp_path)
    (directory / "COMPLETE").write_text("1 dcp\n")
    model, optimizer = _dense(seed=1)
    restored = checkpoint.Checkpointer(tmp_path / "ck", 0, 1).restore("latest", model, optimizer)
    assert restored.step == 2 and torch.equal(model[0].weight, _dense()[0][0].weight)
    assert restored.unverified == (
        f"{directory}: its COMPLETE marker predates checksums (an older FreeScale's): its files' sizes and metadata "
        "were checked, their bytes were not"
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
    # no lookups here: a placeholder transport spares the embedding exchanges' process groups
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
    doing("async save")
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


def _damage_steps(root: Path) -> None:
    """Step 10: rank 1's file cut in half. 8: a byte of rank 1's file changed (its size kept). 6: a DCP item's
    bytes changed. 4: COMPLETE cut in half. 2: whole."""
    data = (root / "step_000010" / "rank1.pt").read_bytes()
    (root / "step_000010" / "rank1.pt").write_bytes(data[: len(data) // 2])
    _flip(root / "step_000008" / "rank1.pt", 200)
    item = checkpoint_manifest.read(root / "step_000006").files["__0_0.distcp"].items[0]
    _flip(root / "step_000006" / "__0_0.distcp", item.start + item.length // 2)
    text = (root / "step_000004" / "COMPLETE").read_text()
    (root / "step_000004" / "COMPLETE").write_text(text[: len(text) // 2])


def _resume_latest(rank, world_size, root):
    model, optimizer = _dense()
    saver = checkpoint.Checkpointer(root, rank, world_size)
    for step in (2, 4, 6, 8, 10):
        saver.save(step, model, optimizer, {"step": step}, {"epoch": 0, "cursor": step})
    torch.distributed.barrier()
    if rank == 1:
        _damage_steps(root)
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
    """Also: each step that does not verify is skipped naming the file (and the item), by the rank that read it."""
    results = run_ranks(_resume_latest, 2, args=(tmp_path / "ck",), timeout=90)
    for rank, (name, loader_state, skipped, after_all_loaded) in enumerate(results):
        assert name == "step_000002" and loader_state == {"step": 2}
        cut, changed, item, marker = skipped
        assert cut.startswith("step_000010 (rank 0: ") and "rank1.pt: " in cut and "COMPLETE records" in cut, cut
        assert changed.startswith("step_000008 (rank 1: ") and "rank 0:" not in changed, changed
        assert "rank1.pt: sha256 differs from the one COMPLETE records" in changed
        assert item.count("rank ") == 1 and "__0_0.distcp: item 'model.0.weight', bytes 0.." in item, item
        assert item.endswith(
            "differs from its checksum in COMPLETE: its bytes changed after the save (damaged, or "
            "written over by another job))"
        )
        assert marker.startswith("step_000004 (rank 0: ") and "COMPLETE: unreadable marker (cut short" in marker
        assert after_all_loaded, f"rank {rank} returned before rank 1 had loaded"


def _trainer(rank, world_size, steps, root, resume=None, **sections):
    """``sections``: table -> {key: value} set on the tiny job's config (``run={"seed": 1}``)."""
    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config("freescale", steps)
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(root), resume
    for table, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, table), key, value)
    return Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu"))


def _save_at_start(rank, world_size, root):
    with _trainer(rank, world_size, 3, root) as trainer:
        trainer.save_checkpoint(None)


def _losses(rank, world_size, root, resume, steps, **sections):
    with _trainer(rank, world_size, steps, root, resume=resume, **sections) as trainer:
        trainer.train()
        return [r["loss"] for r in trainer.history]


def _fresh_and_resumed(rank, world_size, root):
    fresh = _losses(rank, world_size, root, None, 3)
    # Another seed: the resumed run's own initial model differs, so only what it loads can make it train alike.
    return fresh, _losses(rank, world_size, root, str(root / "step_000000"), 3, run={"seed": 1})


@pytest.mark.multiprocess
def test_a_2_rank_checkpoint_resumed_at_3_ranks_trains_as_a_3_rank_run_from_that_state(tmp_path):
    """The state at step 0 is known at every world size (the tables' init does not depend on it): saved by 2 ranks
    and resumed by 3 (whose own init is another seed's), it trains to the same losses, bit for bit, as 3 ranks that
    start there."""
    run_ranks(_save_at_start, 2, args=(tmp_path / "ck",), timeout=90)
    fresh, resumed = run_ranks(_fresh_and_resumed, 3, args=(tmp_path / "ck",), timeout=120)[0]
    assert len(fresh) == 3 and resumed == fresh


def _async_straight_and_resumed(rank, world_size, root):
    straight = _losses(rank, world_size, root, None, 4, checkpoint={"every": 2, "async_save": True})
    return straight, _losses(rank, world_size, root, str(root / "step_000002"), 4)


@pytest.mark.multiprocess
def test_async_checkpoints_resume_exactly(tmp_path):
    straight, resumed = run_ranks(_async_straight_and_resumed, 2, args=(tmp_path / "ck",), timeout=120)[0]
    assert (tmp_path / "ck" / "step_000004" / "COMPLETE").exists()  # the last save was waited for at the end
    assert len(straight) == 4 and resumed == straight[2:]


# ---------------------------------------------------------------------------------------------- freescale train
_ROOT = Path(__file__).resolve().parents[2]
_FAST = ["--nproc", "2", "--device", "cpu", "--no-progress", "--batch-size", "4", "--num-samples", "64"]


def _train(cwd: Path, *argv: str, env: dict | None = None):
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "pipelines.cli", "train", *_FAST, *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.multiprocess
def test_freescale_train_resumes_past_steps_that_do_not_verify_and_a_stalled_read_is_one_line(tmp_path, capsys):
    """`freescale train`, 2 ranks: step 10 has no COMPLETE, step 8's metadata leads to a FIFO outside the step
    (COMPLETE made to match), step 6's data file has a zero-filled tail (COMPLETE made to match: it verifies but
    does not load), step 4's COMPLETE is cut in half. --resume latest says it passed over step 10, skips the three
    with their reasons and resumes from step 2, well within --comm-timeout-s; an explicit --resume of each is one line;
    a rank whose read stalls (as on a hung mount) ends the job in one line naming the file and the bound."""
    assert _train(tmp_path, "--steps", "8", "--checkpoint-every", "2", "--checkpoint-dir", "ck").returncode == 0
    ck = tmp_path / "ck"
    os.mkfifo(tmp_path / "outside")
    _point_data_at(ck / "step_000008", "path-object", tmp_path / "outside", world_size=2)
    size = (ck / "step_000006" / "__0_0.distcp").stat().st_size
    _flip(ck / "step_000006" / "__0_0.distcp", size - 64, bytes(64))
    _reseal(ck / "step_000006", world_size=2)  # it verifies, but an item does not load
    (ck / "step_000010").mkdir()  # a save cut off before its marker
    text = (ck / "step_000004" / "COMPLETE").read_text()
    (ck / "step_000004" / "COMPLETE").write_text(text[: len(text) // 2])

    done, started = _fifo_guard(tmp_path / "outside", after_s=60), time.monotonic()
    resumed = _train(
        tmp_path, "--steps", "10", "--checkpoint-dir", "ck", "--resume", "latest", "--comm-timeout-s", "20"
    )
    done.set()
    assert resumed.returncode == 0 and time.monotonic() - started < 60, resumed.stderr[-3000:]
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("[freescale] skipped")]
    assert skipped[0] == "[freescale] skipped step_000010 (no COMPLETE: a save cut off)", skipped
    skipped = skipped[1:]
    assert [line.split()[2] for line in skipped] == ["step_000008", "step_000006", "step_000004"], skipped
    assert "refused: file name '__0_0.distcp' is a pathlib.PosixPath, not a str" in skipped[0]
    assert "__0_0.distcp: item '" in skipped[1] and "does not load: " in skipped[1]
    assert "COMPLETE: unreadable marker (cut short or damaged?)" in skipped[2]
    assert "[freescale] resumed from ck/step_000002 at step 2" in resumed.stdout

    from pipelines.cli import main

    for step, fragment in (("8", "is a pathlib.PosixPath, not a str"), ("4", "unreadable marker")):
        assert main(["train", *_FAST, "--resume", str(ck / f"step_00000{step}")]) == 2  # before any rank starts
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1, err
    line = _one_error_line(_train(tmp_path, "--steps", "8", "--resume", "ck/step_000006"))
    assert "__0_0.distcp: item '" in line and "does not load: " in line, line

    started = time.monotonic()
    stalled = _train(
        tmp_path,
        "--steps",
        "4",
        "--resume",
        "ck/step_000002",
        "--comm-timeout-s",
        "6",
        "--log-dir",
        "logs",
        env={checkpoint_io.FAULT_ENV: "stall:1"},
    )
    line = _one_error_line(stalled)
    assert stalled.returncode == 1 and time.monotonic() - started < 6 + 40, line
    assert line.startswith(
        "freescale train: error: rank 1: CheckpointStalled: ck/step_000002/COMPLETE: a read has "
        "not returned after 3 s (the bound: half of --comm-timeout-s 6)"
    ), line
    print(skipped, line, sep="\n")  # shown with -s: the lines a user sees
