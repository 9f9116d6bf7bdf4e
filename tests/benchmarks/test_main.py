"""`python -m benchmarks NAME`: every name reaches a module with the command interface, bad input is one line, and
the product's `freescale` command no longer offers a bench."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import BENCHES, main
from pipelines.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_name_is_a_module_with_add_arguments_and_main(name):
    module = importlib.import_module(BENCHES[name][0])
    assert callable(module.add_arguments) and callable(module.main)


def test_no_name_prints_the_list_and_an_unknown_one_is_one_line(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks NAME [flags]") and all(f"  {n} " in out for n in BENCHES)
    assert main(["kernal"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["python -m benchmarks: error: unknown benchmark 'kernal'; choose one of " + ", ".join(BENCHES)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is the one of a machine without CUDA")
def test_a_bench_that_refuses_its_input_says_so_in_one_line_naming_it(capsys):
    assert main(["kernels", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "benchmarks kernels: error: --device cuda but CUDA is not available"
    ]


def test_it_runs_from_the_checkout_as_a_module(tmp_path):
    e2e = tmp_path / "e2e.json"
    row = {"case": "heavy", "mode": "sync", "world_size": 1, "samples_per_s": 100.0, "straggler_pct": 0.0}
    e2e.write_text(json.dumps([{**row, "bubble_ms": 1.0, "exposed_ms": {}, "repeat": 0}]))
    cmd = [sys.executable, "-m", "benchmarks", "scaling", "--e2e", str(e2e), "--json", str(tmp_path / "out.json")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "out.json").read_text())["scaling"][0]["gpus"] == 1


def test_freescale_has_no_bench_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "kernels"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err
