"""The examples run as documented."""

from __future__ import annotations

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
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/compose_loader.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4: tokens per rank before" in proc.stdout and "loader state keys" in proc.stdout
