"""The examples run as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdata.partition import GatheredLengths, RuntimeInfo, get_partitioner

ROOT = Path(__file__).resolve().parents[1]


def test_custom_partitioner_example_is_a_valid_partitioner():
    lengths = GatheredLengths.from_rank_lengths([np.array([5, 1, 9]), np.array([3, 7]), np.array([2])])
    plan = get_partitioner("examples.custom_partitioner:round_robin_longest")(lengths, RuntimeInfo())
    plan.validate(lengths.num_samples, 3)
    assert plan.counts().tolist() == [2, 2, 2]


@pytest.mark.multiprocess
def test_compose_loader_example_runs_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/compose_loader.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4: tokens per rank before" in proc.stdout and "loader state keys" in proc.stdout


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _loads_into_a_fresh_recommender(path: Path) -> None:
    """The exported file is a plain Recommender's state_dict, trained (not the initial weights)."""
    import torch

    from examples.bring_your_own_model import Recommender

    torch.manual_seed(0)  # the examples' initial weights: the export must differ from them
    fresh = Recommender(dense_dim=4, num_labels=1)
    initial = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = torch.load(path, weights_only=True)
    fresh.load_state_dict(state)  # strict: exactly the user's class's keys
    assert sorted(state) == sorted(initial)
    assert not torch.equal(state["ec.embeddings.item_table.weight"], initial["ec.embeddings.item_table.weight"])


@pytest.mark.multiprocess
def test_bring_your_own_model_example_has_parity_with_sync(tmp_path):
    pytest.importorskip("torchrec")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/bring_your_own_model.py",
            "--steps",
            "4",
            "--export",
            str(tmp_path / "model.pt"),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["parity"] is True and report["parity_balanced"] and report["parity_bit_for_bit"], report
    assert len(report["sync"]) == len(report["freescale"]) == len(report["freescale_partitioner_none"]) == 4
    assert report["freescale_partitioner_none"] == report["sync"]
    _loads_into_a_fresh_recommender(tmp_path / "model.pt")


def _train(args, cwd, tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            "--nproc",
            "2",
            "--no-progress",
            "--summary-json",
            str(summary),
            *args,
        ],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.multiprocess
def test_train_with_a_model_factory_file_from_another_directory(tmp_path):
    pytest.importorskip("torchrec")
    summary = _train(
        [
            "--steps",
            "5",
            "--model",
            f"{ROOT}/examples/bring_your_own_model.py:build_model",
            "--export",
            str(tmp_path / "model.pt"),
        ],
        tmp_path,
        tmp_path,
    )
    assert summary["steps"] == 5 and all(loss == loss for loss in summary["loss_curve"])  # no NaN
    _loads_into_a_fresh_recommender(tmp_path / "model.pt")  # --export: the model as the factory's class


@pytest.mark.multiprocess
def test_train_mode_torchrec_pec_with_a_model_of_several_tables(tmp_path):
    """torchrec's PEC on the example's collection (two tables, three features): it trains; its numbers part from
    sync's by torchrec's gradient-order fault (tests/pipelines/test_torchrec_pec_grad_order.py)."""
    pytest.importorskip("torchrec")
    model = ["--steps", "3", "--model", f"{ROOT}/examples/bring_your_own_model.py:build_model"]
    summary = _train([*model, "--mode", "torchrec-pec"], ROOT, tmp_path)
    assert summary["mode"] == "torchrec-pec" and summary["steps"] == 3
    assert all(loss == loss for loss in summary["loss_curve"]) and "emb_a2a" in summary["unmeasured"]


@pytest.mark.multiprocess
def test_custom_partitioner_commands_run_from_the_root_and_from_elsewhere(tmp_path):
    # as documented, from the repository root: module:function, found with the current directory first
    by_module = _train(
        ["--steps", "3", "--partitioner", "examples.custom_partitioner:round_robin_longest"], ROOT, tmp_path
    )
    # from any directory, by file path
    by_file = _train(
        ["--steps", "3", "--partitioner", f"{ROOT}/examples/custom_partitioner.py:round_robin_longest"],
        tmp_path,
        tmp_path,
    )
    assert by_module["loss_curve"] == by_file["loss_curve"]
    assert by_module["config"]["balancer"]["partitioner"] == "examples.custom_partitioner:round_robin_longest"


@pytest.mark.multiprocess
def test_the_api_walkthrough_runs_as_written(tmp_path):
    """docs/api.md's walkthrough, copied as a user would: under 60 lines, and it trains."""
    pytest.importorskip("torchrec")
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    assert code.count("\n") < 60
    script = tmp_path / "walkthrough.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 10: loss" in proc.stdout
