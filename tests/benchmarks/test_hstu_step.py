"""`python -m benchmarks hstu-step` on CPU at the tiny preset: the FLOP count against a hand count, the Zipf lengths
and the synthetic batch, and a run that prints the table and writes the JSON the lead merges."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch

from benchmarks import hstu_step as bench
from pipelines.models.hstu import HSTU_PRESETS, HSTUConfig, HSTUModel


def test_step_flops_is_the_hand_count():
    # lengths 3 and 5 (N = 8), d = 4, 2 heads of 3 (H Dh = 6), 2 layers.
    # linears, forward, per layer: uvqk 2*8*4*24 = 1536, output 2*8*6*4 = 384; x3 fwd+bwd, x2 layers: 11520.
    # attention, forward, per layer: 2*6*(9 + 25) = 408; x3.5, x2 layers: 2856.
    flops = bench.step_flops(np.array([3, 5]), dim=4, num_layers=2, num_heads=2, head_dim=3)
    assert flops == dict(linear=11520.0, attention=2856.0, total=14376.0)


def test_zipf_lengths_are_heavy_tailed_and_clipped():
    lengths = bench.uih_lengths("zipf", 20_000, 4096, 1.2, np.random.default_rng(0))
    assert lengths.min() >= 1 and lengths.max() == 4096
    # Zipf(1.2): P(k >= 4096) = 0.17 and a median under 20: most samples short, the tokens in the few long ones
    assert 0.15 < np.mean(lengths == 4096) < 0.19 and np.median(lengths) < 20
    assert (bench.uih_lengths("full", 3, 64, 1.2, np.random.default_rng(0)) == 64).all()
    with pytest.raises(ValueError, match="--zipf-alpha must be > 1"):
        bench.uih_lengths("zipf", 3, 64, 1.0, np.random.default_rng(0))


def test_candidates_flag():
    assert bench.parse_candidates("1-8") == (1, 8) and bench.parse_candidates("4") == (4, 4)
    for bad in ("8-1", "0", "a-b", "1-2-3"):
        with pytest.raises(ValueError, match="--candidates: expected LO-HI or N"):
            bench.parse_candidates(bad)


def test_synthetic_batch_has_the_lengths_and_ordered_timestamps():
    config = HSTUConfig(**{**HSTU_PRESETS["hstu"], "max_uih": 6})
    rng = np.random.default_rng(1)
    batch = bench.synthetic_batch(np.array([9, 1, 4]), np.array([2, 1, 3]), config, rng)
    assert batch.uih_lengths.tolist() == [9, 1, 4] and batch.num_candidates.tolist() == [2, 1, 3]
    assert batch.candidate_labels.shape == (6, config.num_labels)
    assert ((batch.candidate_lengths >= 1) & (batch.candidate_lengths <= 3)).all()
    assert (batch.uih_timestamps.diff() > 0).all()
    assert bench.sequence_lengths(batch, config.max_uih).tolist() == [6 + 2, 1 + 1, 4 + 3]


def test_bench_runs_on_cpu_prints_the_table_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "hstu_step.json"
    flags = "--preset hstu --device cpu --batch-size 3 --num-items 500 --reps 1 --warmup 0"
    args = parser.parse_args([*flags.split(), "--json", str(path)])
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "step ms" in out and "TFLOP/s" in out and "MFU %" in out and "b2b ms" in out
    assert "gate: CUDA rows only (this run is on cpu)" in out
    result = json.loads(path.read_text())
    assert result["setup"]["precision"] == "fp32" and result["setup"]["peak_tflops"] == bench.PEAK_TFLOPS
    records = result["records"]
    assert [(r["lengths"], r["rab"]) for r in records] == [("zipf", True), ("zipf", False)]
    keys = {"batch", "tokens", "max_len", "step_ms", "attention_ms", "attention_share", "tflop", "tflops", "mfu"}
    config = HSTUConfig(**HSTU_PRESETS["hstu"])
    for r in records:
        assert keys <= set(r) and r["skipped"] is None and r["batch"] == 3
        assert r["step_ms"] > 0 and r["attention_ms"] > 0 and len(r["step_ms_reps"]) == 1 and r["back_to_back_ms"] > 0
        assert r["allocator"] is None  # the CUDA caching allocator's counts: CUDA rows only
        assert r["tokens"] == sum(r["seq_lengths"]) and r["max_len"] == max(r["seq_lengths"])
        flops = bench.step_flops(
            np.array(r["seq_lengths"]), config.dim, config.num_layers, config.num_heads, config.head_dim
        )
        assert r["tflop"] == pytest.approx(flops["total"] / 1e12)
        assert r["tflops"] == pytest.approx(r["tflop"] * 1e12 / r["step_ms"] / 1e9)
        assert r["mfu"] == pytest.approx(r["tflops"] / bench.PEAK_TFLOPS)
    assert records[0]["seq_lengths"] == records[1]["seq_lengths"]  # rab on and off time the same batch


def test_position_embeddings_flag_reaches_the_model_of_every_row(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "hstu_step.json"
    flags = "--preset hstu --device cpu --batch-size 2 --num-items 500 --reps 1 --warmup 0 --rab off"
    assert bench.main(parser.parse_args([*flags.split(), "--position-embeddings", "--json", str(path)])) == 0
    (record,) = json.loads(path.read_text())["records"]
    assert (record["rab"], record["position_embeddings"]) == (False, True) and record["step_ms"] > 0
    assert "zipf    off on  off  fp32" in capsys.readouterr().out


def test_kernels_fall_in_their_parts_and_the_breakdown_table_adds_up():
    names = {
        "_fwd_kernel": "attention",
        "_dkdv_kernel_0d1d": "attention",
        "_dq_kept_kernel": "attention",
        "_position_grads_kernel": "attention",
        "_time_grads_kernel": "attention",
        "_pair_buckets_kernel": "attention",
        "_pair_bias_kernel": "attention",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "_rowwise_update_kernel": "optimizer",
        "triton_per_fused__to_copy_native_layer_norm_0": "other",
        "void at::native::vectorized_elementwise_kernel<4, silu>": "other",
    }
    assert {name: bench.kernel_part(name) for name in names} == names
    record = bench.Record(
        *("hstu", "zipf", True, False, True, "autocast", 2, 10, 6, 3, 10.0, 4.0, 0.4, 0.1, 0.2, 0.3, 30.0, 0.03),
        step_ms_reps=[10.0],
        seq_lengths=[6, 4],
        breakdown_ms=dict(attention=4.0, matmul=3.0, optimizer=0.5, other=2.0),
    )
    row = bench.breakdown_table([record]).splitlines()[1]
    assert "4.00 (40.0%)" in row and "2.00 (20.0%)" in row and "0.50 ( 5.0%)" in row  # idle: the 0.5 ms left
    assert row.count("( 5.0%)") == 2


def test_the_table_updates_kernels_count_as_the_optimizers_whatever_their_names(monkeypatch):
    kernels = {"nvjet_gemm": 3.0, "index_copy_kernel": 0.5, "sort_kernel": 0.2, "_fwd_kernel": 4.0}
    inside = {"index_copy_kernel": 0.4, "sort_kernel": 0.2}  # the other 0.1 ms of index_copy: the layers' own
    monkeypatch.setattr(
        bench,
        "kernel_and_range_times_ms",
        lambda step, steps, within: (kernels, inside if within == bench.TABLE_UPDATE_RANGE else {}),
    )
    totals, other = bench.kernel_breakdown(lambda: None)
    assert totals == pytest.approx(dict(attention=4.0, matmul=3.0, optimizer=0.6, other=0.1))
    assert other == pytest.approx({"index_copy_kernel": 0.1})


def test_a_ranges_span_on_the_devices_timeline_is_no_kernel(monkeypatch):
    """torch.profiler puts a record_function range on the device's timeline too (a user annotation spanning its
    kernels): counted as a kernel, the table update's range once added its whole span to the glue."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks import timing

    def event(name, us, device=DeviceType.CUDA, annotation=False, kernels=()):
        span = SimpleNamespace(elapsed_us=lambda: us)
        return SimpleNamespace(
            name=name, device_type=device, is_user_annotation=annotation, time_range=span, kernels=list(kernels),
            cpu_children=[],
        )  # fmt: skip

    sort = SimpleNamespace(name="sort_kernel", duration=200.0)
    events = [
        event("sort_kernel", 200.0),
        event("_fwd_kernel", 4000.0),
        event(bench.TABLE_UPDATE_RANGE, 3500.0, annotation=True),
        event(bench.TABLE_UPDATE_RANGE, 3600.0, device=DeviceType.CPU, kernels=[sort]),
    ]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Profile:
        def __init__(self, activities):
            self.events = lambda: events

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    totals, inside = timing.kernel_and_range_times_ms(lambda: None, calls=1, within=bench.TABLE_UPDATE_RANGE)
    assert totals == {"_fwd_kernel": 4.0, "sort_kernel": 0.2} and inside == {"sort_kernel": 0.2}
    del events[2].is_user_annotation  # a torch without the flag: the range's name tells
    assert timing.kernel_and_range_times_ms(lambda: None, calls=1, within=bench.TABLE_UPDATE_RANGE)[0] == totals


def test_the_gates_read_each_rows_rab_and_its_glue():
    def record(rab, tflops, other_ms):
        return bench.Record(
            "hstu-large", "zipf", rab, False, True, "autocast", 32, 100, 10, 32, 50.0, None, None, 1.0, 1.0, 2.0,
            tflops, None, [50.0], [10],
            breakdown_ms={"attention": 20.0, "matmul": 10.0, "optimizer": 2.0, "other": other_ms},
        )  # fmt: skip

    lines = bench.gates([record(False, 350.0, 5.0), record(True, 150.0, 12.0)], torch.device("cuda"))
    assert lines[0].endswith(">= 340 (aim 400): met") and lines[1] == "  glue 10% of the step (<= 15%): met"
    assert lines[2].endswith(">= 200 (aim 300): NOT met") and lines[3] == "  glue 24% of the step (<= 15%): NOT met"
    # Back to back, the same gate on the steps' mean when launched without waiting (2 TFLOP in 8 ms: 250 TFLOP/s).
    lines = bench.gates([dataclasses.replace(record(False, 300.0, 5.0), back_to_back_ms=8.0)], torch.device("cuda"))
    assert lines[1] == "  back to back 250.0 TFLOP/s: NOT met"
    lines = bench.gates([dataclasses.replace(record(True, 150.0, 5.0), back_to_back_ms=8.0)], torch.device("cuda"))
    assert lines[0].endswith(": NOT met") and lines[1] == "  back to back 250.0 TFLOP/s: met"


def test_host_syncs_counts_each_synchronizing_call_by_its_stack(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)

    def set_mode(mode):  # torch warned of a sync while switching the mode on, before any step ran
        modes.append(mode)
        warnings.warn("called a synchronizing CUDA operation")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def syncing():  # what torch's sync debug mode raises at a synchronizing call
        warnings.warn("called a synchronizing CUDA operation")

    def step():
        for _ in range(2):  # one place: one stack, counted twice
            syncing()
        warnings.warn("some other warning")

    syncs = bench.host_syncs(step, depth=2)
    assert list(syncs.values()) == [2]
    inner, caller = next(iter(syncs)).split(" < ")
    assert inner.startswith("test_hstu_step.py:") and caller.startswith("test_hstu_step.py:")
    assert modes == ["warn", 0]  # the mode is restored after the step


def test_the_tables_row_update_is_dense_adams_first_step_on_the_looked_up_rows_alone():
    config = HSTUConfig(**{**HSTU_PRESETS["hstu"], "num_items": 500})
    rng = np.random.default_rng(3)
    batch = bench.synthetic_batch(np.array([7, 2, 5]), np.array([2, 1, 1]), config, rng)
    table, weights = "item_embedding.weight", {}
    for update in bench.TABLE_UPDATES:
        torch.manual_seed(0)
        model = HSTUModel(config).train()
        before = model.item_embedding.weight.detach().clone()
        bench.build_step(model, batch, "fp32", torch.device("cpu"), update)()
        weights[update] = {name: p.detach().clone() for name, p in model.named_parameters()}
        moved = (weights[update][table] != before).any(1).nonzero().squeeze(1)
        assert torch.equal(moved, torch.unique(model.item_ids(batch)))  # the rows the step read, and no other
        assert model.item_embedding.weight.grad is None
    # a first step: lazy Adam's moments are dense Adam's on those rows (to rounding), the dense parameters' alike
    torch.testing.assert_close(weights["rows"][table], weights["dense"][table])
    for name, value in weights["rows"].items():
        if name != table:
            torch.testing.assert_close(value, weights["dense"][name], rtol=0, atol=0)
