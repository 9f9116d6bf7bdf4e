"""`python -m benchmarks hstu` on CPU: the twins at the tiny shape, the reference rows joined by shape and dim
(generative-recommenders' JSON layout), the gate lines, and one-line errors for a bad variant or reference."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import hstu


def _args(tmp_path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hstu.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--reps", "1", "--warmup", "0", "--json", str(tmp_path / "out.json")])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_twins_run_and_the_reference_is_joined_by_shape_and_dim(tmp_path, capsys):
    reference = tmp_path / "genrec.json"
    rows = [
        {"config": "tiny/H4/D64", "dim": 64, "fwd_ms": 2.0, "fwd_bwd_ms": 8.0},
        {"config": "a/H4/D64", "error": "x"},
    ]
    reference.write_text(json.dumps({"rows": rows}))
    assert hstu.main(_args(tmp_path, variants="torch,padded", reference=[str(reference)])) == 0
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    assert [r["variant"] for r in records] == ["torch", "padded"]
    lengths = hstu.lengths_of("tiny", 0)
    for r in records:
        assert r["tokens"] == int(lengths.sum()) and r["reference_fwd_bwd_ms"] == 8.0
        assert r["speedup_fwd_bwd"] == pytest.approx(8.0 / r["fwd_bwd_ms"])
        assert r["fwd_bwd_tflops"] == pytest.approx(3.5 * hstu.fwd_flops(lengths, 4, 64) / r["fwd_bwd_ms"] / 1e9)
    assert "shape dim variant" in capsys.readouterr().out


def test_the_gates_read_the_triton_rows():
    def record(variant, fwd, fwd_bwd, ref_fwd=None, ref_fwd_bwd=None):
        r = hstu.Record("a", 64, variant, 64, 100, 10, fwd, fwd_bwd, 1.0, 1.0, ref_fwd, ref_fwd_bwd)
        if ref_fwd:
            r.speedup_fwd, r.speedup_fwd_bwd = ref_fwd / fwd, ref_fwd_bwd / fwd_bwd
        return r

    lines = hstu.gates([record("triton", 1.0, 2.0, 1.2, 4.0), record("triton-rab", 1.1, 2.4)])
    assert lines[0].startswith("gate a/64: fwd+bwd 2.00x") and lines[0].endswith("met")
    assert lines[1] == "gate rab a/64: fwd+bwd 1.20x rab off (<= 2.0): met"


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="--variants: unknown"):
        hstu.main(_args(tmp_path, variants="nope"))
    with pytest.raises(ValueError, match="Triton kernel runs on CUDA"):
        hstu.main(_args(tmp_path, variants="triton"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="bad.json: not bench_hstu.py's JSON"):
        hstu.load_reference([str(bad)])
