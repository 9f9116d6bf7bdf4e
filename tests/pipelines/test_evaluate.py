"""Predictions and held-out evaluation (pipelines.api.evaluate): predict's rows are the logits a forward hook sees
(one process, and two gloo ranks through a wrapped model's sharded table); NE and AUC against an independent
computation (a plain sort-based AUC, the NE formula over the model's own logits), and `freescale train
--eval-data` on a converted file with the held-out split: every held-out sample counted once over the ranks, the
figures in the summary and output."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fsdata.batch import Batch, Sample
from pipelines import predict
from pipelines.api.evaluate import evaluate
from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel


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
    model = SoftmaxModel(SoftmaxConfig(num_items=500, dim=16, num_heads=2, num_labels=2, max_uih=32)).train()
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


def _batches(count: int = 4) -> list[Batch]:
    rng = np.random.default_rng(0)
    return [
        Batch.from_samples([_sample(10 * b + i, int(n), rng) for i, n in enumerate(rng.integers(1, 40, 5))])
        for b in range(count)
    ]


def test_predict_gives_the_logits_a_forward_hook_sees():
    batches = _batches()
    torch.manual_seed(0)
    model = SoftmaxModel(SoftmaxConfig(num_items=500, dim=16, num_heads=2, num_labels=2, max_uih=32)).train()
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    rows = predict(model, batches)
    assert model.training and len(seen) == len(batches)  # the model left in the mode it was in
    assert torch.equal(rows.scores, torch.cat(seen)) and rows.scores.shape == (60, 2)
    assert torch.equal(rows.labels, torch.cat([b.candidate_labels for b in batches]))
    assert torch.equal(rows.sample_ids, torch.cat([b.sample_ids.repeat_interleave(b.num_candidates) for b in batches]))
    assert rows.samples == 20
    assert torch.equal(predict(model, batches, probabilities=True).scores, torch.sigmoid(rows.scores))
    one = predict(model, batches[2])  # one batch, not a loader
    assert torch.equal(one.scores, seen[2]) and torch.equal(one.scores, seen[-1])


def test_predict_refuses_outputs_that_are_not_a_row_per_candidate():
    class Pooled(torch.nn.Module):  # one score per sample, not per candidate
        def forward(self, batch):
            return batch.dense.sum(1)

    with pytest.raises(ValueError) as e:
        predict(Pooled(), _batches(1))
    assert str(e.value) == (
        "predict: the model returned (5,) for a batch of 15 candidates (its first sample_id 0); predict and evaluate "
        "take a model whose forward returns per-candidate logits [candidates, labels]"
    )


NUM_ITEMS, DIM = 40, 6


class _Tower(torch.nn.Module):
    """A user's model: one nn.Embedding table, looked up for the history and for the candidates."""

    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.Embedding(NUM_ITEMS, DIM)
        self.head = torch.nn.Linear(2 * DIM + 4, 1)

    def forward(self, batch) -> torch.Tensor:
        history = torch.segment_reduce(self.items(batch.uih_item_ids % NUM_ITEMS), "sum", lengths=batch.uih_lengths)
        candidates = self.items(_candidates(batch))
        user = torch.cat([history, batch.dense], 1).repeat_interleave(batch.num_candidates, 0)
        return self.head(torch.cat([candidates, user], 1))


def _candidates(batch) -> torch.Tensor:
    return batch.content_ids[batch.content_offsets[:-1]] % NUM_ITEMS


def _held_out():
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=48, seed=5, uih_max=32))


def _predict_on_ranks(rank, world_size):
    from fsdata import LoaderConfig, SyntheticConfig, SyntheticSource, build_loader, shutdown_loader
    from pipelines import TrainStep, wrap_model
    from tests.harness import doing

    torch.manual_seed(0)
    model = _Tower()
    features = lambda batch: {"items": [batch.uih_item_ids % NUM_ITEMS, _candidates(batch)]}  # noqa: E731
    table = wrap_model(model, embeddings=["items"], mode="freescale", features=features)
    source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=160, seed=1, uih_max=32))
    loader = build_loader(source, LoaderConfig(batch_size=8), rank, world_size, table.loader_stages(rank))
    step = TrainStep(model, None, torch.optim.Adam(model.parameters(), lr=1e-2), wrap=table)
    items = iter(loader)
    doing("train")
    while step.has_next(items) and step.step < 4:
        step.progress(items)
    shutdown_loader(loader)
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    passes = []

    def held_out():  # a loader per pass: a synthetic source's next epoch holds other samples
        passes.append(build_loader(_held_out(), LoaderConfig(batch_size=8), rank, world_size))  # no stages needed
        return passes[-1]

    doing("predict")
    rows = predict(model, held_out(), wrap=table)
    probabilities = predict(model, held_out(), wrap=table, probabilities=True).scores
    one = predict(model, _held_out().read(0, 0, 6), wrap=table).scores  # every rank: its lookup is collective
    doing("evaluate")
    result = evaluate(model, held_out(), wrap=table)
    for loader in passes:
        shutdown_loader(loader)
    return {"rows": rows, "probabilities": probabilities, "one": one, "seen": seen, "result": result}


@pytest.mark.multiprocess
def test_predict_on_ranks_gives_the_hooks_logits_and_evaluate_gathers_them():
    from tests.harness import run_ranks

    results = run_ranks(_predict_on_ranks, 2, timeout=180)
    batches_per_rank = 3  # 48 held-out samples in global batches of 2 x 8
    gathered = []
    for rank, res in enumerate(results):
        rows, seen = res["rows"], res["seen"]
        assert len(seen) == 2 * batches_per_rank + 1 + batches_per_rank  # predict twice, one batch, evaluate
        assert torch.equal(rows.scores, torch.cat(seen[:batches_per_rank]))
        assert torch.equal(res["probabilities"], torch.sigmoid(rows.scores))
        assert torch.equal(res["one"], seen[2 * batches_per_rank])
        reads = [_held_out().read(0, 16 * g + 8 * rank, 16 * g + 8 * rank + 8) for g in range(batches_per_rank)]
        assert torch.equal(
            rows.sample_ids, torch.cat([b.sample_ids.repeat_interleave(b.num_candidates) for b in reads])
        )
        assert rows.samples == 24
        gathered.append(rows)
    logits = torch.cat([r.scores for r in gathered]).double()
    labels = torch.cat([r.labels for r in gathered]).double()
    p = float(labels.mean())
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    result = results[0]["result"]
    assert result.as_dict() == results[1]["result"].as_dict() and result.samples == 48
    assert result.ne == pytest.approx(bce / -(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-12)
    assert result.auc == pytest.approx(sort_auc(logits[:, 0].float().numpy(), labels[:, 0].numpy()), abs=1e-6)


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
