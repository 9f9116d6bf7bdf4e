"""`python -m benchmarks hstu-static` without a GPU: the loop count of a SASS listing, the one-bucket tile count
against every pair's buckets, and one kernel compiled for sm_90 by the installed Triton."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks import hstu_static
from kernels.pytorch.pt_hstu_attention import position_bucket, time_bucket

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_2:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @!P2 BRA P3, `(.L_x_1) ;
        /*0030*/                   SEL R3, R3, RZ, P0 ;
        /*0040*/                   SEL R4, R4, RZ, P0 ;
.L_x_1:
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/               @P3 BRA `(.L_x_2) ;
        /*0070*/                   EXIT ;
"""


NESTED = """
.L_x_2:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @!P2 BRA P3, `(.L_x_1) ;
        /*0030*/                   SEL R3, R3, RZ, P0 ;
.L_x_9:
        /*0040*/                   SEL R4, R4, RZ, P0 ;
        /*0044*/               @P1 BRA `(.L_x_9) ;
.L_x_1:
        /*0048*/                   NOP ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/               @P3 BRA `(.L_x_2) ;
"""


def test_the_loop_is_counted_on_its_shortest_path():
    # The loop spans 0x10-0x60 (5 instructions); the forward branch at 0x20 jumps over the two SELs.
    assert hstu_static.loop_instructions(SASS) == (4, [])
    # An inner loop (0x40-0x44) behind the skip: left out of the path, counted on its own.
    assert hstu_static.loop_instructions(NESTED) == (5, [2])
    with pytest.raises(ValueError, match="no loop"):
        hstu_static.loop_instructions("        /*0000*/                   EXIT ;\n")


def _brute_force(times: np.ndarray, block_m: int, block_n: int) -> tuple[int, ...]:
    tiles = one_pos = one_time = one_pair = pos_span = time_span = 0
    length = len(times)
    for q0 in range(0, length, block_m):
        for k0 in range(0, length, block_n):
            pairs = [(i, j) for i in range(q0, min(q0 + block_m, length)) for j in range(k0, min(k0 + block_n, i + 1))]
            if not pairs:
                continue
            i, j = (torch.tensor(x) for x in zip(*pairs))
            pb = position_bucket(i - j, 64)
            tb = time_bucket(torch.from_numpy(times)[i] - torch.from_numpy(times)[j], 64)
            pos, gap = pb.unique().numel() == 1, tb.unique().numel() == 1
            tiles, one_pos, one_time, one_pair = tiles + 1, one_pos + pos, one_time + gap, one_pair + (pos and gap)
            pos_span += int(pb.max() - pb.min()) + 1
            time_span += int(tb.max() - tb.min()) + 1
    return tiles, one_pos, one_time, one_pair, pos_span, time_span


@pytest.mark.parametrize("length,block_m,block_n", [(150, 16, 8), (97, 8, 16), (5, 16, 16)])
def test_tile_buckets_match_every_pairs_buckets(length, block_m, block_n):
    rng = np.random.default_rng(length)
    times = np.cumsum(rng.integers(0, 3 * 3600, size=length))  # non-decreasing, with equal neighbours
    got = hstu_static.tile_buckets(times, block_m, block_n)
    assert got == _brute_force(times, block_m, block_n)
    assert got[3] > 0 or length < 16  # the check sees one-pair tiles, not only their absence


def test_main_prints_the_shares_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    hstu_static.add_arguments(parser)
    args = parser.parse_args(["--kernels", "", "--shapes", "tiny", "--json", str(tmp_path / "s.json")])
    assert hstu_static.main(args) == 0
    tiles = json.loads((tmp_path / "s.json").read_text())["tiles"]
    assert [(t["shape"], t["block_m"], t["block_n"]) for t in tiles] == [("tiny", m, n) for m, n in hstu_static.TILES]
    assert all(0.0 <= t["one_pair"] <= min(t["one_position"], t["one_time"]) <= 1.0 for t in tiles)
    assert all(t["position_span"] >= 1.0 and t["time_span"] >= 1.0 for t in tiles)
    assert "one pair" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"unknown \['fwd2'\]"):
        hstu_static.main(parser.parse_args(["--kernels", "fwd2"]))


def test_the_forward_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    # A process of its own: the suite interprets Triton (TRITON_INTERPRET=1), and compiling needs the real JIT.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "k.json"
    command = [sys.executable, "-m", "benchmarks", "hstu-static", "--dim", "16", "--kernels", "fwd", "--shapes", ""]
    done = subprocess.run([*command, "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0 and "not found (the Triton wheel" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["resources"]
    assert [r["variant"] for r in rows] == list(hstu_static.VARIANTS)
    off, rab = rows[0], rows[-1]
    assert 0 < off["registers"] <= 255 and off["loop_instructions"] > 0 and off["x_off"] == 1.0
    assert rab["per_score"] > off["per_score"] and off["inner_per_score"] == 0.0
    assert "fwd    rab" in done.stdout


def test_the_compile_aligns_pointers_and_row_strides_as_a_launch_does(monkeypatch):
    """A launch specializes 16-byte-aligned pointers and strides (torch's allocations, the rows' strides), and
    Triton vectorizes and pipelines the loads only with that hint: without it the counts are those of scalar loads."""
    triton = pytest.importorskip("triton")
    from kernels.triton import triton_hstu_attention as hstu

    seen = {}

    def capture(source, **_):
        seen["source"] = source
        raise RuntimeError("captured")

    monkeypatch.setattr(triton, "compile", capture)
    with pytest.raises(RuntimeError, match="captured"):
        hstu_static.compile_cubin(
            hstu._dq_kept_kernel,
            dict(H=2, D=16, BLOCK_D=16, BLOCK_M=16, BLOCK_N=16, HAS_TARGETS=False, HAS_WINDOW=False, PRECISION="tf32"),
            4,
            1,
            90,
        )
    source = seen["source"]
    aligned = {
        hstu._dq_kept_kernel.arg_names[i] for (i,), attrs in source.attrs.items() if ["tt.divisibility", 16] in attrs
    }
    pointers = {name for name, kind in source.signature.items() if kind.startswith("*")}
    assert pointers == {"K", "DQ", "OFFSETS", "ORDER", "TARGETS", "DS", "PAIR_BASE"}
    assert aligned == pointers | {"stride_k"}
