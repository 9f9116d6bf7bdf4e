"""Held-out evaluation (pipelines.api.evaluate): NE and AUC against an independent computation (a plain sort-based
AUC, the NE formula over the model's own logits), and `freescale train --eval-data` on a converted file with
the held-out split: every held-out sample counted once over the ranks, the figures in the summary and output."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fsdata.batch import Batch, Sample
from pipelines.api.evaluate import evaluate
from pipelines.models.reference import ModelConfig, SequenceModel


def _sample(i: int, length: int, rng) -> Sample:
    return Sample(
        sample_id=i,
        user_id=i,
        uih_item_ids=rng.integers(0, 500, length),
        candidate_labels=rng.integers(0, 2, (3, 2)).astype(np.float32),
        content_ids=[rng.integers(0, 500, 2), rng.integers(0, 500, 1), rng.integers(0, 500, 1)],
        dense=rng.random(4, dtype=np.float32),
        uih_action_types=rng.integers(0, 4, length),
        uih_timestamps=np.arange(length),
    )


def sort_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a random positive outscores a random negative (ties count half), by sorting."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2 + 1
        i = j + 1
    pos = y == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_ne_and_auc_equal_an_independent_computation():
    rng = np.random.default_rng(0)
    batches = [
        Batch.from_samples([_sample(10 * b + i, int(n), rng) for i, n in enumerate(rng.integers(0, 40, 5))])
        for b in range(4)
    ]
    torch.manual_seed(0)
    model = SequenceModel(ModelConfig(num_items=500, dim=16, num_heads=2, num_labels=2, max_uih=32)).train()
    result = evaluate(model, batches, world_size=1)
    assert model.training  # left as it was
    with torch.no_grad():
        logits = torch.cat([model.eval()(b) for b in batches]).double().numpy()
    labels = torch.cat([b.candidate_labels for b in batches]).double().numpy()
    aucs = [sort_auc(logits[:, t], labels[:, t]) for t in range(2)]
    assert result.auc_per_label == pytest.approx(aucs, abs=1e-6) and result.auc == pytest.approx(
        np.mean(aucs), abs=1e-6
    )
    p, bce = labels.mean(), np.mean(np.logaddexp(0, logits) - labels * logits)
    assert result.ne == pytest.approx(bce / -(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-6)
    assert (result.samples, result.labels) == (20, 120)


def _ratings(path, users=40, events=24, seed=0):
    rng = np.random.default_rng(seed)
    rows = [
        f"{u}::{int(rng.integers(1, 300))}::{int(rng.integers(1, 6))}::{t}\n"
        for u in range(1, users + 1)
        for t in range(events)
    ]
    path.write_text("".join(rows))


@pytest.mark.multiprocess
def test_train_reports_held_out_ne_and_auc_over_every_held_out_sample(tmp_path):
    from fsdata.convert import convert
    from fsdata.parquet import ParquetSource

    _ratings(tmp_path / "ratings.dat")
    report = convert(
        "movielens",
        [tmp_path / "ratings.dat"],
        tmp_path / "train.parquet",
        progress=False,
        candidates=4,
        samples_per_user=0,
        eval_out=str(tmp_path / "eval.parquet"),
    )
    held = ParquetSource(tmp_path / "eval.parquet").num_samples(0)
    assert report.eval_samples == held == 40
    summary = tmp_path / "s.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            "--data",
            str(tmp_path / "train.parquet"),
            "--eval-data",
            str(tmp_path / "eval.parquet"),
            "--eval-every",
            "2",
            "--steps",
            "4",
            "--nproc",
            "2",
            "--batch-size",
            "8",
            "--summary-json",
            str(summary),
            "--partitioner",
            "fbs",
            "--id-overflow",
            "modulo",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads(summary.read_text())
    assert [e["step"] for e in s["eval"]] == [2, 4]
    assert all(e["samples"] == held and e["labels"] == held * 4 for e in s["eval"])  # each held-out sample once
    assert all(math.isfinite(e["ne"]) and 0.0 <= e["auc"] <= 1.0 for e in s["eval"])
    assert s["eval_ne"] == s["eval"][-1]["ne"] and s["eval_auc"] == s["eval"][-1]["auc"]
    assert "held-out NE" in proc.stdout + proc.stderr and "held-out         step 4" in proc.stdout
