"""The HSTU model (pipelines.models.hstu): candidates as targets that do not see each other, batching and
truncation invariance, gradients to every parameter, the presets of the job, and training on 2 gloo ranks through
`freescale train --model hstu` and through the trainer, where mode freescale has sync's losses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdata.batch import Batch, Sample
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.hstu import HSTU_PRESETS, HSTUConfig, HSTUModel
from pipelines.models.softmax import truncate

ROOT = Path(__file__).resolve().parents[2]


def _sample(i: int, length: int, rng, candidates: int = 3) -> Sample:
    return Sample(
        sample_id=i,
        user_id=i,
        uih_item_ids=rng.integers(0, 500, length),
        candidate_labels=rng.integers(0, 2, (candidates, 2)).astype(np.float32),
        content_ids=[rng.integers(0, 500, rng.integers(1, 4)) for _ in range(candidates)],
        dense=rng.random(4, dtype=np.float32),
        uih_action_types=rng.integers(0, 4, length),
        uih_timestamps=np.cumsum(rng.integers(1, 5_000, length)),
    )


def _model(max_uih: int = 64, **overrides) -> HSTUModel:
    torch.manual_seed(0)
    model = HSTUModel(HSTUConfig(num_items=500, num_labels=2, max_uih=max_uih, **overrides))
    with torch.no_grad():  # rab and embeddings away from their zero start, so they take part in what is compared
        for name, p in model.named_parameters():
            if name.endswith(
                ("position_weights", "time_weights", "position_embedding.weight", "time_embedding.weight")
            ):
                p.normal_(std=0.5)
    return model.eval()


def _samples(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [_sample(0, 7, rng), _sample(1, 20, rng), _sample(2, 0, rng, 2), _sample(3, 4, rng, 1)]


def test_candidates_are_targets_that_do_not_see_each_other():
    samples, model = _samples(), _model()
    with torch.no_grad():
        base = model(Batch.from_samples(samples))
        assert base.shape == (9, 2) and base.isfinite().all()
        # Sample 1's first candidate (row 3) gets other content: only its own logits move.
        other = list(samples[1].content_ids)
        other[0] = np.array([499, 498])
        changed = model(Batch.from_samples([samples[0], replace(samples[1], content_ids=other), *samples[2:]]))
        assert not torch.allclose(changed[3], base[3])
        keep = [r for r in range(9) if r != 3]
        torch.testing.assert_close(changed[keep], base[keep])
        # One history item of sample 1 (rows 3..5) changes all its candidates' logits and no other sample's.
        history = samples[1].uih_item_ids.copy()
        history[-2] = (history[-2] + 1) % 500
        moved = model(Batch.from_samples([samples[0], replace(samples[1], uih_item_ids=history), *samples[2:]]))
        assert all(not torch.allclose(moved[r], base[r]) for r in (3, 4, 5))
        torch.testing.assert_close(moved[[0, 1, 2, 6, 7, 8]], base[[0, 1, 2, 6, 7, 8]])


@pytest.mark.parametrize("positions", [{}, {"rab": False, "position_embeddings": True}], ids=["rab", "embeddings"])
def test_a_sample_scores_the_same_alone_batched_or_with_older_events_cut(positions):
    """The packing of [history..., candidates...] per sample (an empty history included) is per sample; a sample
    longer than max_uih scores as its most recent max_uih events (timestamps too); positions and times count
    relative to the sample (rab's distances and gaps, or the input embeddings' recency and age), so shifting every
    timestamp changes nothing."""
    samples, model = _samples(), _model(max_uih=8, **positions)
    with torch.no_grad():
        together = model(Batch.from_samples(samples))
        alone = torch.cat([model(Batch.from_samples([s])) for s in samples])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
        shifted = [replace(s, uih_timestamps=s.uih_timestamps + 86_400) for s in samples]
        torch.testing.assert_close(model(Batch.from_samples(shifted)), together)
        long_ = samples[1]
        recent = replace(
            long_,
            uih_item_ids=long_.uih_item_ids[-8:],
            uih_action_types=long_.uih_action_types[-8:],
            uih_timestamps=long_.uih_timestamps[-8:],
        )
        torch.testing.assert_close(model(Batch.from_samples([long_])), model(Batch.from_samples([recent])))


def test_gradients_reach_every_parameter_and_an_empty_batch_the_table():
    model = _model(seq_norm="sample", window=5).train()
    batch = Batch.from_samples(_samples())
    binary_cross_entropy_sum(model(batch), batch.candidate_labels).backward()
    names = [name for name, _ in model.named_parameters()]
    assert "layers.0.position_weights" in names and "layers.1.time_weights" in names
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)
    empty = Batch.from_samples([], num_labels=2, dense_dim=4)
    logits = model(empty)
    assert logits.shape == (0, 2)
    binary_cross_entropy_sum(
        logits, empty.candidate_labels
    ).backward()  # a sharded table's backward must run on every rank
    assert model.item_embedding.weight.grad is not None


def test_the_residual_stream_is_bf16_under_autocast_only_when_asked():
    """fp32_residual=False: every layer reads and writes autocast's dtype, and the logits stay within bf16's
    rounding of the fp32 stream's; without autocast the switch changes nothing."""
    batch = Batch.from_samples(_samples())
    logits, dtypes = {}, {}
    for fp32 in (True, False):
        model = _model(fp32_residual=fp32)
        seen = dtypes[fp32] = []
        for layer in model.layers:
            layer.register_forward_hook(lambda _, args, out, seen=seen: seen.append((args[0].dtype, out.dtype)))
        with torch.no_grad():
            assert torch.equal(model(batch), _model()(batch))  # no autocast: the same numbers either way
            seen.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits[fp32] = model(batch).float()
    assert dtypes[True] == [(torch.float32, torch.float32)] * 2
    assert dtypes[False] == [(torch.bfloat16, torch.bfloat16)] * 2
    torch.testing.assert_close(logits[False], logits[True], atol=0.05, rtol=0.05)


def test_recency_and_age_count_back_from_the_samples_last_event():
    rng = np.random.default_rng(0)
    samples = [_sample(0, 3, rng, 2), _sample(1, 0, rng, 1), _sample(2, 12, rng, 1)]
    model = _model(max_uih=4, rab=False, position_embeddings=True)
    batch = Batch.from_samples(samples)
    seq = model._pack(batch, truncate(batch, 4))
    assert seq.recency.tolist() == [3, 2, 1, 0, 0] + [0] + [4, 3, 2, 1, 0]
    times = [samples[0].uih_timestamps, samples[2].uih_timestamps[-4:]]
    ages = [int(times[0][-1] - t) for t in times[0]] + [0, 0, 0] + [int(times[1][-1] - t) for t in times[1]] + [0]
    assert seq.age.tolist() == ages and seq.age[[2, 9]].tolist() == [0, 0]  # each latest event is 0 s old


def test_position_embeddings_move_the_logits_and_train():
    """The input embeddings take part (their invariances: the alone-or-batched test above); both tables get
    gradients."""
    samples, model = _samples(), _model(max_uih=8, rab=False, position_embeddings=True)
    assert all(layer.position_weights is None for layer in model.layers)
    with torch.no_grad():
        together = model(Batch.from_samples(samples))
        plain = _model(max_uih=8, rab=False)  # the same weights but no embeddings: the embeddings move the logits
        plain.load_state_dict(model.state_dict(), strict=False)
        assert not torch.allclose(plain(Batch.from_samples(samples)), together)
    batch = Batch.from_samples(samples)
    binary_cross_entropy_sum(model.train()(batch), batch.candidate_labels).backward()
    for table in (model.position_embedding, model.time_embedding):
        assert table.weight.grad is not None and table.weight.grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_on_the_triton_kernel_has_the_twins_numbers():
    """fp32 on CUDA, Triton against the per-sample twin: logits and every gradient within 1e-4 of the largest
    (measured on an H200: 2.9e-7 for the logits, 1.7e-6 for the worst gradient, the position weights')."""
    batch = Batch.from_samples(_samples() + _samples(1)).to("cuda")
    results = {}
    for impl in ("torch", "triton"):
        model = _model(attention_impl=impl).train().cuda()
        logits = model(batch)
        binary_cross_entropy_sum(logits, batch.candidate_labels).backward()
        results[impl] = {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}
    for name, expected in results["torch"].items():
        scale = expected.abs().max().clamp(min=1e-12)
        assert float((results["triton"][name] - expected).abs().max() / scale) < 1e-4, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_layers_have_the_eager_layers_numbers_and_compile_once():
    """On CUDA the layers run under torch.compile by default: logits and every gradient equal the eager layers'
    (compile=False, the same Triton attention) within bf16's rounding under autocast, and batches of other token
    counts and longest samples reuse the one graph per layer (no recompiling per batch)."""
    import torch._dynamo

    from pipelines.api.numerics import autocast

    torch._dynamo.reset()
    models = {compiled: _model(compile=compiled).train().cuda() for compiled in (False, True)}
    graphs = []
    for samples in (_samples(0), _samples(1)[:2], _samples(0) + _samples(2)):  # three token counts
        batch = Batch.from_samples(samples).to("cuda")
        results = {}
        for compiled, model in models.items():
            assert model.compiles(batch.dense.device) is compiled
            model.zero_grad(set_to_none=True)
            with autocast(torch.bfloat16, batch.dense.device):
                logits = model(batch)
            binary_cross_entropy_sum(logits.float(), batch.candidate_labels).backward()
            results[compiled] = {"logits": logits.detach().float(), **{n: p.grad for n, p in model.named_parameters()}}
        for name, expected in results[False].items():
            if expected is None:
                continue
            scale = expected.abs().max().clamp(min=1e-6)
            err = float((results[True][name].float() - expected.float()).abs().max() / scale)
            assert err < 3e-2, f"{name}: {err:.3g}"
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1:] == graphs[:1] * 2, f"graphs after each batch: {graphs}"


def test_the_configs_errors_are_one_line_and_the_presets_are_valid():
    for name, fields in HSTU_PRESETS.items():
        HSTUConfig(**fields)  # hstu-large is only configured here: its tables are GPU-sized
    for bad, match in (
        (dict(num_heads=0), "HSTUConfig: num_heads must be >= 1, got 0"),
        (dict(seq_norm="mean"), "HSTUConfig: seq_norm must be one of max, sample, got 'mean'"),
        (dict(attention_impl="varlen"), "HSTUConfig: attention_impl must be one of triton, torch or None"),
        (dict(dropout=1.0), r"HSTUConfig: dropout must lie in \[0, 1\), got 1.0"),
    ):
        with pytest.raises(ValueError, match=match):
            HSTUConfig(**bad)
    # Compiling around the torch twin is refused before inductor meets it, in one line.
    with pytest.raises(ValueError, match="HSTUConfig: compile=True needs the Triton attention, and on cpu"):
        HSTUModel(HSTUConfig(num_items=50, compile=True))(Batch.from_samples(_samples(0)))


def test_the_job_builds_the_hstu_preset_with_its_overrides_positions_and_no_plan():
    from pipelines.job.builders import build_model_spec, build_source
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config("freescale", 1)
    cfg.model.name, cfg.model.dim, cfg.data.num_samples = "hstu", 48, 64
    cfg.validate()
    spec = build_model_spec(cfg, build_source(cfg.data, 16))
    model = spec.model
    assert isinstance(model, HSTUModel) and spec.plan is None and spec.embeddings == ["item_embedding"]
    assert (model.config.dim, model.config.max_uih, model.config.num_layers) == (48, 64, 2)
    assert not model.needs_plan(torch.device("cuda")) and model.attention_impl(torch.device("cpu")).value == "torch"
    assert (model.config.rab, model.config.position_embeddings) == (True, False)  # --positions unset: rab
    for positions, expected in (("embeddings", (False, True)), ("both", (True, True)), ("none", (False, False))):
        cfg.model.positions = positions
        config = build_model_spec(cfg, build_source(cfg.data, 16)).model.config
        assert (config.rab, config.position_embeddings) == expected, positions
    assert config.fp32_residual
    cfg.model.residual = "bf16"
    assert not build_model_spec(cfg, build_source(cfg.data, 16)).model.config.fp32_residual
    cfg.model.residual = None
    cfg.model.attention = "padded"
    with pytest.raises(ValueError, match="--attention padded is the softmax model's"):
        build_model_spec(cfg, build_source(cfg.data, 16))
    cfg.model.name, cfg.model.attention = "tiny", "jagged"
    with pytest.raises(ValueError, match=r"positions is the HSTU presets' \(hstu, hstu-large\), not tiny's"):
        cfg.validate()
    cfg.model.positions, cfg.model.residual = None, "bf16"
    with pytest.raises(ValueError, match=r"residual is the HSTU presets'"):
        cfg.validate()
    cfg.model.residual = None
    cfg.model.name, cfg.model.positions = "hstu", "relative"
    with pytest.raises(ValueError, match="model.positions"):
        cfg.validate()
    cfg.model.name = "hstu-tiny"
    with pytest.raises(ValueError, match=r"unknown model preset 'hstu-tiny'; choose from \['hstu', 'hstu-large'"):
        build_model_spec(cfg, build_source(cfg.data, 16))


@pytest.mark.multiprocess
def test_freescale_train_trains_hstu_on_two_ranks(tmp_path):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "pipelines.cli", "train", "--nproc", "2", "--model", "hstu", "--device", "cpu"]
    cmd += ["--steps", "8", "--batch-size", "8", "--max-uih", "64", "--uih-cap", "64", "--no-progress"]
    cmd += ["--summary-json", str(summary), "--metrics-jsonl", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == 8 and s["world_size"] == 2 and math.isfinite(s["loss"])
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[4:]) < sum(losses[:4])  # it learns: the last half's mean BCE below the first half's


def _losses_by_mode(rank, world_size):
    from pipelines.job.trainer import Trainer
    from tests.harness import doing
    from tests.pipelines.tiny import tiny_config

    out = {}
    for mode, partitioner in (("sync", "none"), ("freescale", "none"), ("freescale", "fbs")):
        doing(f"train hstu {mode} {partitioner}")
        cfg = tiny_config(mode, 5)
        cfg.model.name, cfg.balancer.partitioner = "hstu", partitioner
        with Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as trainer:
            trainer.train()
            out[f"{mode}/{partitioner}"] = [r["loss"] for r in trainer.history]
    return out


@pytest.mark.multiprocess
def test_freescale_mode_trains_hstu_with_sync_modes_losses():
    """Unbalanced, prioritized embedding updates give sync's losses bit for bit; balanced, the same global batch
    on other ranks gives them up to float32 summation order (rtol 1e-5, the example's parity tolerance)."""
    from tests.harness import run_ranks

    for out in run_ranks(_losses_by_mode, 2, timeout=120):
        sync = out["sync/none"]
        assert len(sync) == 5 and all(math.isfinite(x) for x in sync)
        assert out["freescale/none"] == sync
        assert out["freescale/fbs"] == pytest.approx(sync, rel=1e-5)
