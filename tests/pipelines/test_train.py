"""`freescale train` end to end (launcher and torchrun), the job config, and its errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import build_parser
from pipelines.job.config.flags import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[loader]\nbatch_size = 7\nprefetch_depth = 3\nstage_lookahead = false\n[run]\nsteps = 5\n"
        '[balancer]\npartitioner = "fbs"\n[process]\ngil_switch_ms = 2.5\n'
    )
    cfg = _parse("--config", str(toml), "--batch-size", "9")
    assert cfg.loader.batch_size == 9 and cfg.loader.prefetch_depth == 3 and cfg.run.steps == 5
    assert cfg.balancer.partitioner == "fbs" and cfg.run.lr == 1e-3
    assert cfg.process.gil_switch_ms == 2.5 and cfg.loader.stage_lookahead is False
    cfg = _parse("--config", str(toml), "--process.gil-switch-ms", "3", "--loader.stage-lookahead")
    assert cfg.process.gil_switch_ms == 3.0 and cfg.loader.stage_lookahead is True


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--steps", "-1"], "steps"),
        (["--collision-rate", "1.5"], "collision_rate"),
        (["--data", "/no/such/file.parquet"], "does not exist"),
        (["--autotune", "--partitioner", "fbs"], "autotune"),
        (["--transport", "carrier-pigeon"], "transport"),
        (["--process.gil-switch-ms", "0"], "gil_switch_ms"),
        (["--loader.worker-start", "forward"], r"worker_start must be one of take, backward.*--loader.worker-start"),
        (["--embeddings.early-start", "later"], "early_start"),
        (["--embeddings.exclusive-start", "later"], "exclusive_start"),
        (["--process.numa-binding", "everywhere"], "numa_binding"),
        (["--warmup-steps", "-2"], "warmup_steps"),
    ],
)
def test_bad_config_is_a_clear_error(argv, match):
    with pytest.raises(ValueError, match=match):
        _parse(*argv)


def test_numa_binding_applies_to_gpu_ranks_only(capsys, monkeypatch):
    """torch's NUMA binding binds local rank r near GPU r: a CPU run, or ranks sharing GPUs, get none, and say so."""
    import torch

    from pipelines.job.launch.launcher import numa_options

    assert numa_options(_parse("--device", "cpu")) is None  # not asked for: silent
    assert numa_options(_parse("--device", "cpu", "--process.numa-binding", "exclusive")) is None
    assert "ignored" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert numa_options(_parse("--device", "cuda", "--nproc", "2", "--process.numa-binding", "node")) is None
    assert "2 ranks share 1 GPU" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    options = numa_options(_parse("--device", "cuda", "--nproc", "2", "--process.numa-binding", "exclusive"))
    assert options is not None and options.affinity_mode.value == "exclusive"


def test_help_fits_a_screen_and_every_tuning_knob_is_documented(capsys, monkeypatch):
    """`freescale train --help` lists the flags a user needs, a group per table (at most 76 lines at 80 columns: the
    [loader] table's group among them); the knobs' --TABLE.NAME flags are listed by --help-tuning and each is
    explained in docs/tuning.md under that spelling."""
    from pipelines.job.config.flags import flag, knobs

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 76, text
    assert "--help-tuning" in text and "docs/tuning.md" in text
    assert set(knobs()) == {  # each in the table of the component it tunes
        "loader.pin_memory",
        "loader.background_stages",
        "loader.worker_start",
        "loader.stage_lookahead",
        "embeddings.early_start",
        "embeddings.exclusive_start",
        "embeddings.schedule",
        "dense_sync.allreduce_start",
        "dense_sync.bucket_mb",
        "kernels.attention_impl",
        "model.residual",
        "process.threads",
        "process.gil_switch_ms",
        "process.numa_binding",
    }
    assert not any(flag(path) in text for path in knobs())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help-tuning"])
    listed = capsys.readouterr().out
    page = (ROOT / "docs" / "tuning.md").read_text()
    for path in knobs():
        table, key = path.split(".")
        knob = flag(path)
        assert knob.replace(".", ".no-", 1) in listed or knob in listed, path
        assert f"`{knob}" in page and f"`[{table}] {key}`" in page, f"docs/tuning.md does not document {knob}"


def test_choices_are_checked_once_for_flags_toml_and_classes(tmp_path):
    from pipelines.job.config.sections import JobConfig

    config = JobConfig()
    config.run.mode = "fast"
    with pytest.raises(ValueError, match=r"mode must be one of .*freescale.*got 'fast' \(run.mode\)"):
        config.validate()
    with pytest.raises(ValueError, match=r"mode must be one of .*freescale.*got 'fast' \(--mode\)"):
        _parse("--mode", "fast")
    toml = tmp_path / "job.toml"
    toml.write_text('[dense_sync]\nallreduce_start = "later"\n')
    with pytest.raises(
        ValueError, match=r"allreduce_start must be one of backward, compute.*--dense-sync.allreduce-start"
    ):
        _parse("--config", str(toml))
    toml.write_text("[run]\ngil_switch_ms = 2.0\n")
    with pytest.raises(ValueError, match=r"\[run\] has unknown key 'gil_switch_ms' \(it belongs in \[process\]\)"):
        _parse("--config", str(toml))
    toml.write_text("[tuning]\nbucket_mb = 4.0\n")  # the knobs' table of before: each key is in its owner's now
    with pytest.raises(
        ValueError, match=r"^\S+job.toml: \[tuning\] has unknown key 'bucket_mb' \(it belongs in \[dense_sync\]\)$"
    ):
        _parse("--config", str(toml))


def test_unknown_toml_key(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[run]\nstepz = 5\n")
    with pytest.raises(ValueError, match="stepz"):
        _parse("--config", str(toml))


def _run(cmd, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.multiprocess
def test_freescale_train_two_ranks_with_balancing(tmp_path):
    summary = tmp_path / "s.json"
    metrics = tmp_path / "m.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "train",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--partitioner",
        "fbs",
        "--summary-json",
        str(summary),
        "--metrics-jsonl",
        str(metrics),
        "--no-progress",
        "--mode",
        "replicated",
        "--trace",
        str(tmp_path / "trace"),
        "--warmup-steps",
        "2",
    ]
    proc = _run(cmd, tmp_path)
    trace = json.loads((tmp_path / "trace.rank1.json").read_text())
    assert {"freescale/data", "freescale/forward", "freescale/backward"} <= {
        e.get("name") for e in trace["traceEvents"]
    }
    from pipelines.cli.trace_report import report

    r = report(tmp_path / "trace.rank1.json")  # `freescale trace`: the step split by phase and thread
    assert {"forward", "backward", "dense_allreduce"} <= set(r["phases"]) and r["gpu_busy_ms"] is None
    forward = r["phases"]["forward"]
    own = forward["threads"][r["training_thread"]]
    assert own["ops"] > 10 and 0 < own["ops_ms"] <= forward["wall_ms"] + 1e-6
    assert forward["between_ops_ms"] == pytest.approx(forward["wall_ms"] - own["ops_ms"])
    assert "run summary" in proc.stdout
    s = json.loads(summary.read_text())
    assert s["steps"] == 6 and s["world_size"] == 2 and s["samples"] == 6 * 2 * 16
    assert len(s["peak_memory_bytes_per_rank"]) == 2 and min(s["peak_memory_bytes_per_rank"]) > 0
    assert math.isfinite(s["loss"]) and math.isfinite(s["ne"]) and len(s["per_rank_compute_s"]) == 2
    from pipelines.job.run.aggregates import per_step, read_metrics

    lines = read_metrics(metrics)  # every step's record, and only there: the summary holds aggregates
    assert [r["step"] for r in lines] == list(range(6))
    assert all("balance" in r and 0 <= r["straggler_pct"] <= 100 and r["gc_s"] >= 0 for r in lines)
    assert s["curve_steps"] == list(range(6)) and s["loss_curve"] == [r["loss"] for r in lines]
    assert "step_times_s" not in s and "exposed_per_step_s" not in s
    series = per_step(lines)
    times = series["step_times_s"]  # the first two (warm-up) and the last (drain) are left out of the timings
    assert len(times) == 6 and s["warmup_steps"] == 2 and s["warmup_s"] == pytest.approx(sum(times[:2]))
    assert s["drain_steps"] == 1 and s["drain_s"] == pytest.approx(times[5])
    assert s["step_time_s"] == pytest.approx(sum(times[2:5]) / 3)
    assert s["step_time_median_s"] == pytest.approx(sorted(times[2:5])[1]) and s["step_time_p99_s"] == max(times[2:5])
    parts, waits = series["exposed_per_step_s"], series["straggler_per_step_s"]  # what a stalled step waited for
    assert len(waits) == 6 and all(len(v) == 6 for v in parts.values()) and "dense_allreduce" in parts
    assert series["bubbles_s"] == pytest.approx([sum(v[i] for v in parts.values()) + waits[i] for i in range(6)])
    clues = series["stall_clues_per_step"]  # replicated mode on CPU: gc pauses only, no relay pool, no pinned memory
    assert len(clues["gc_s"]) == 6 and clues["new_relay_blocks"] is None and clues["new_pinned_blocks"] is None


def test_a_step_record_is_built_from_what_the_step_returned_and_settled_a_step_later():
    """The trainer's typed record: from a StepResult alone (either kind of step), completed by settle() with every
    rank's compute time, written as one line; what a step has not (a torchrec step's compute, its block's compute
    times) is None or left out, never 0."""
    import numpy as np

    from pipelines.job.run.record import StepRecord
    from pipelines.models.step_result import StepResult

    slots = {"tokens": np.array([10.0, 30.0]), "samples": np.array([2.0, 4.0]), "sparsity": np.array([0.5, 0.25])}
    last = np.array([0.1, 0.3])
    result = StepResult(
        0.5, 6.0, 2.0, loss_sum=3.0, compute_s=0.2, allreduce_s=0.1, per_rank={**slots, "last_compute_s": last}
    )
    record = StepRecord.of(7, result)
    assert record.last_compute_all_s is last and record.imbalance_max_over_mean == 1.5
    record.exposed_s = {"ids_a2a": 0.01, "dense_allreduce": None}  # as the accounting leaves it
    line = record.settle(np.array([0.2, 0.5]), rank=0).as_dict()
    assert line["compute_s"] == [0.2, 0.5] and line["straggler_wait_s"] == pytest.approx(0.15)
    assert line["allreduce_exposed_s"] == 0.0 and line["straggler_pct"] == pytest.approx(50.0)  # waited 0.3 of 0.1
    assert line["bubble_s"] == pytest.approx(0.01 + 0.15) and line["exposed_s"]["dense_allreduce"] == 0.0
    assert line["tokens_per_rank"] == [10, 30] and line["samples_per_rank"] == [2, 4] and line["loss_sum"] == 3.0
    assert not {"last_compute_all_s", "extras", "balance", "schedule", "unmeasured"} & set(line)

    torchrec = StepResult(
        0.5, 6.0, 2.0, loss_sum=3.0, per_rank=slots, unmeasured=("ids_a2a",), extras={"progress_s": [1, 2]}
    )
    record = StepRecord.of(0, torchrec)
    record.exposed_s = {"ids_a2a": None, "dense_allreduce": None}
    line = record.settle(record.last_compute_all_s, rank=1).as_dict()
    assert line["compute_s"] is None and line["straggler_pct"] is None and line["bubble_s"] is None
    assert line["unmeasured"] == ["ids_a2a"] and line["progress_s"] == [1, 2] and "compute_local_s" not in line


def test_garbage_collection_pauses_are_timed():
    import gc

    from pipelines.job.run.accounting import GcPauses

    pauses = GcPauses()
    try:
        cycles = []
        for _ in range(20_000):
            a = []
            a.append(a)  # a cycle: only the collector frees it
            cycles.append(a)
        del cycles
        gc.collect()
        assert pauses.take() > 0 and pauses.take() == 0.0
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks


@pytest.mark.multiprocess
def test_torchrun_entry(tmp_path):
    summary = tmp_path / "s.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pipelines.job.train",
        "--steps",
        "3",
        "--summary-json",
        str(summary),
        "--no-progress",
    ]
    _run(cmd, tmp_path)
    s = json.loads(summary.read_text())
    assert s["steps"] == 3 and s["world_size"] == 2


def _train_cmd(tmp_path, *extra):
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "train",
        "--no-progress",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        *extra,
    ]


def _losses(metrics_jsonl):
    """Every step's loss, from a run's --metrics-jsonl."""
    return [json.loads(line)["loss"] for line in metrics_jsonl.read_text().splitlines()]


@pytest.mark.multiprocess
def test_checkpoint_resume_is_exact(tmp_path):
    """freescale mode (balancer + prioritized embeddings in flight): 6 steps straight == 3 + resume 3. The resumed
    run times its helpers otherwise than the default: the stage worker starts when a batch is taken (not at
    the backward) and finishes each exchange at once (no stage lookahead), the bulk chain starts with the forward,
    and the deferred exclusive gradients leave at the backward (not with the next forward). When they run must not
    change a number."""
    _run(
        _train_cmd(tmp_path, "--steps", "6", "--checkpoint-every", "3", "--metrics-jsonl", str(tmp_path / "a.jsonl")),
        tmp_path,
    )
    full = _losses(tmp_path / "a.jsonl")
    step3 = tmp_path / "ck" / "step_000003"
    assert (step3 / "COMPLETE").exists() and (step3 / "rank1.pt").exists()
    _run(
        _train_cmd(
            tmp_path,
            "--steps",
            "6",
            "--resume",
            str(step3),
            "--loader.worker-start",
            "take",
            "--loader.no-stage-lookahead",
            "--embeddings.early-start",
            "forward",
            "--embeddings.exclusive-start",
            "backward",
            "--metrics-jsonl",
            str(tmp_path / "b.jsonl"),
        ),
        tmp_path,
    )
    resumed = _losses(tmp_path / "b.jsonl")
    assert resumed == full[3:]


@pytest.mark.multiprocess
def test_resume_across_embedding_schedules_is_exact(tmp_path):
    """A checkpoint written under sdd's schedule (nothing in flight) resumed under prioritized updates (which start
    with a synchronous first step), with the last bucket launched after the host saw the backward end (the first
    run: as soon as it was queued, the default): the same losses as straight."""
    _run(
        _train_cmd(
            tmp_path,
            "--steps",
            "6",
            "--checkpoint-every",
            "3",
            "--embeddings.schedule",
            "sdd",
            "--metrics-jsonl",
            str(tmp_path / "a.jsonl"),
        ),
        tmp_path,
    )
    full = _losses(tmp_path / "a.jsonl")
    _run(
        _train_cmd(
            tmp_path,
            "--steps",
            "6",
            "--resume",
            str(tmp_path / "ck" / "step_000003"),
            "--embeddings.schedule",
            "prioritized",
            "--dense-sync.allreduce-start",
            "compute",
            "--metrics-jsonl",
            str(tmp_path / "b.jsonl"),
        ),
        tmp_path,
    )
    resumed = _losses(tmp_path / "b.jsonl")
    assert len(full) == 6 and resumed == full[3:]


@pytest.mark.multiprocess
def test_resume_onto_another_world_size(tmp_path):
    """A freescale checkpoint of 2 ranks resumes on 3 at the same global sample, its sharded tables resharded."""
    _run(_train_cmd(tmp_path, "--steps", "3", "--checkpoint-every", "3"), tmp_path)
    step3 = str(tmp_path / "ck" / "step_000003")
    proc = _run(
        _train_cmd(
            tmp_path, "--nproc", "3", "--resume", step3, "--steps", "5", "--summary-json", str(tmp_path / "s.json")
        ),
        tmp_path,
    )
    assert "resumed from" in proc.stdout and "sample 48" in proc.stdout and "world size 3" in proc.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 3 and math.isfinite(summary["loss"])


def test_cli_reports_bad_input_without_traceback(capsys):
    from pipelines.cli import main

    assert main(["train", "--steps", "-3"]) == 2
    err = capsys.readouterr().err
    assert "freescale train: error: steps must be >= 0" in err and "Traceback" not in err


def _torchrun(tmp_path, restarts, *flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "-m",
        "tests.pipelines.faulty_train",
        "--fault-rank",
        "1",
        "--fault-step",
        "5",
        "--steps",
        "8",
        "--no-progress",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--checkpoint-every",
        "2",
        "--resume",
        "latest",
        *flags,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.multiprocess
def test_killed_rank_is_named_and_a_restart_resumes_from_the_last_checkpoint(tmp_path):
    failed = _torchrun(tmp_path, 0)
    assert failed.returncode != 0
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", failed.stderr), failed.stderr[-2000:]
    assert re.search(r"exitcode\s*: 17", failed.stderr), failed.stderr[-2000:]
    # Same job with one restart allowed: the restarted ranks resume from step 4's checkpoint and finish.
    (tmp_path / "again").mkdir()
    restarted = _torchrun(tmp_path / "again", 1, "--summary-json", str(tmp_path / "s.json"))
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from" in restarted.stdout and "step_000004 at step 4" in restarted.stdout
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 4  # steps 4..7 after the restart


def _tiny_trainer(rank, world_size, mode, steps, **dense_sync):
    """A trainer of the tiny job (tests.pipelines.tiny) on CPU; ``dense_sync``: [dense_sync] knobs set on its
    config."""
    import torch

    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config(mode, steps)
    for name, value in dense_sync.items():
        setattr(cfg.dense_sync, name, value)
    return Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu"))


def _batches_let_go(rank, world_size):
    import weakref

    trainer = _tiny_trainer(rank, world_size, "freescale", 5)
    trained, at_forward, at_backward, at_optimizer = [], [], [], []
    train_step, optimizer_step = trainer.train_step, trainer.optimizer.step

    def recording_train_step(fetched, upcoming):
        trained.append(weakref.ref(fetched.item.batch))
        return train_step(fetched, upcoming)

    def checking_optimizer_step(*args, **kwargs):
        at_optimizer.append([ref() is not None for ref in trained])
        return optimizer_step(*args, **kwargs)

    trainer.train_step, trainer.optimizer.step = recording_train_step, checking_optimizer_step
    trainer.model.register_forward_pre_hook(lambda *_: at_forward.append([ref() is not None for ref in trained]))
    trainer.model.register_full_backward_pre_hook(lambda *_: at_backward.append([ref() is not None for ref in trained]))
    trainer.train()
    return at_forward, at_backward, at_optimizer


@pytest.mark.multiprocess
def test_the_last_steps_batch_is_let_go_within_the_step():
    """The trainer lets the last step's batch go once this step's backward is queued, so that its frees sit beside
    the device's work: not between two steps nor beside the backward's embedding hooks (it is still alive as the
    forward and the backward start), and not beside the next step (only the current batch is alive at the optimizer
    step)."""
    from tests.harness import run_ranks

    for at_forward, at_backward, at_optimizer in run_ranks(_batches_let_go, 2, timeout=120):
        assert at_forward == at_backward == [[True]] + [[False] * (step - 1) + [True, True] for step in range(1, 5)]
        assert at_optimizer == [[False] * step + [True] for step in range(5)]


def _losses_and_accounting(rank, world_size, allreduce_start):
    trainer = _tiny_trainer(rank, world_size, "sync", 5, allreduce_start=allreduce_start)
    trainer.train()
    return [
        (
            r["step"],
            r["loss"],
            r["compute_s"],
            r["compute_local_s"],
            r["straggler_wait_s"],
            r["bubble_s"],
            r["exposed_s"]["dense_allreduce"],
        )
        for r in trainer.history
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("allreduce_start", ["compute", "backward"])
def test_every_step_is_settled_with_every_ranks_compute_time(allreduce_start):
    """A step's straggler wait needs every rank's compute time of that step, which the next step's block carries
    (the last step's: one all-reduce after the loop): every record is settled, in order, with the same numbers
    on every rank, whenever the last bucket is launched; the losses do not depend on it."""
    from tests.harness import run_ranks

    results = run_ranks(_losses_and_accounting, 2, args=(allreduce_start,), timeout=120)
    baseline = (
        run_ranks(_losses_and_accounting, 2, args=("compute",), timeout=120)
        if allreduce_start != "compute"
        else results
    )
    for rank, rows in enumerate(results):
        assert [r[0] for r in rows] == list(range(5))
        assert [r[1] for r in rows] == [r[1] for r in baseline[rank]]  # the same losses
        for step, _, compute_all, mine, wait, bubbles, dense in rows:
            assert len(compute_all) == 2 and compute_all[rank] == pytest.approx(mine)  # this step's, this rank's
            assert wait >= 0 and bubbles >= 0 and dense >= 0
    assert [r[2] for r in results[0]] == [r[2] for r in results[1]]  # every rank settles with the same times


def _slow_timer_bookkeeping(rank, world_size):
    import time

    trainer = _tiny_trainer(rank, world_size, "sync", 3)
    totals = trainer.accounting.exposed_totals

    def slow():  # as resolving many CUDA events would be
        time.sleep(0.2)
        return totals()

    trainer.accounting.exposed_totals = slow
    trainer.train()
    return [(r["data_wait_s"], r["step_time_s"]) for r in trainer.history]


@pytest.mark.multiprocess
def test_the_timers_bookkeeping_is_not_counted_as_data_wait():
    from tests.harness import run_ranks

    for rows in run_ranks(_slow_timer_bookkeeping, 2, timeout=120):
        for data_wait, step_time in rows:
            assert step_time >= 0.4 and data_wait < 0.2  # in the step (twice), not in the loader's time


def _state_handed_over_whole(rank, world_size, directory):
    import torch

    from pipelines.job.checkpoint.job import LOADER, MODEL, OPTIMIZER, POSITION, STEP
    from pipelines.job.trainer import Trainer
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config("freescale", 4)
    cfg.checkpoint.dir, cfg.checkpoint.every = directory, 4
    with Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as trainer:
        trainer.train()
        saved = trainer.state_dict()
        assert saved[MODEL] is trainer.model and saved[OPTIMIZER] is trainer.optimizer
        weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}  # the dense ones
    cfg = tiny_config("freescale", 6)
    cfg.checkpoint.dir, cfg.checkpoint.resume = directory, "latest"
    with Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as resumed:
        state = resumed.state_dict()
        same_weights = bool(weights) and all(torch.equal(weights[k], v) for k, v in resumed.model.named_parameters())
        return saved[STEP], state[STEP], saved[POSITION], state[POSITION], state[LOADER] is not None, same_weights


@pytest.mark.multiprocess
def test_a_checkpoint_takes_the_trainer_whole_and_gives_its_parts_back(tmp_path):
    """The trainer is Stateful: its state_dict gathers the model, the optimizer, the steps done, the data position and
    the loader's state; a checkpoint saves it whole, and a resumed trainer's state_dict gives the same parts back."""
    from tests.harness import run_ranks

    for saved_step, step, saved_position, position, has_loader, same_weights in run_ranks(
        _state_handed_over_whole, 2, args=(str(tmp_path / "ck"),), timeout=180
    ):
        assert (saved_step, step) == (4, 4) and saved_position == position and position["cursor"] > 0
        assert has_loader and same_weights
