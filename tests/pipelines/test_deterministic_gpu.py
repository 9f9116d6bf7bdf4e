"""The deterministic mode on CUDA, end to end through `freescale train` (2 ranks sharing GPU 0), on the softmax
model and on the HSTU model (its Triton attention): the loss curve of freescale's prioritized updates equals sync's
bit for bit without the balancer, and a second run of the same job gives the same bits. Plain torch + the project
only (the GPU machine lacks hypothesis' extras)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

JOB = [
    "--device",
    "cuda",
    "--nproc",
    "2",
    "--steps",
    "8",
    "--uih-cap",
    "1024",
    "--max-uih",
    "1024",
    "--batch-size",
    "8",
    "--num-samples",
    "2000",
    "--no-progress",
    "--deterministic",
]


def _losses(tmp_path, name: str, model: str, *flags: str) -> list[float]:
    summary = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            *JOB,
            "--model",
            model,
            *flags,
            "--summary-json",
            str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(summary.read_text())["loss_curve"]


@pytest.mark.parametrize("model", ["small", "hstu"])
def test_prioritized_updates_equal_sync_bit_for_bit_in_the_deterministic_mode(tmp_path, model):
    sync = _losses(tmp_path, "sync", model, "--mode", "sync")
    freescale = _losses(tmp_path, "freescale", model, "--mode", "freescale", "--partitioner", "none")
    again = _losses(tmp_path, "again", model, "--mode", "freescale", "--partitioner", "none")
    assert len(sync) == 8 and sync == freescale, (sync, freescale)
    assert freescale == again, (freescale, again)
