"""The FlexAttention path against the per-sample twin on CUDA (bf16 and fp32, outputs and gradients), and the
comparison helper the CPU tests share (no hypothesis here: this file runs where only torch is installed)."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import jagged_attention

TOL = dict(rtol=1e-5, atol=1e-5)


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


def _qkv(rows_q: int, rows_kv: int, heads=2, dim=16, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(n, heads, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return make(rows_q), make(rows_kv), make(rows_kv)


def _compare(q_lengths, kv_lengths, causal, impl, against="padded", device="cpu", dtype=torch.float32, tol=TOL):
    """Output and q/k/v gradients of ``impl`` against ``against`` on random inputs."""
    qo = _offsets(q_lengths)
    ko = qo if causal else _offsets(kv_lengths)
    q, k, v = _qkv(int(qo[-1]), int(ko[-1]), dtype=dtype, device=device)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    results = []
    for which in (impl, against):
        for t in (q, k, v):
            t.grad = None
        out = jagged_attention(q, k, v, qo, None if causal else ko, causal=causal, impl=which)
        out.backward(grad)
        results.append([out.detach().float(), *(t.grad.float() for t in (q, k, v))])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, dict(rtol=2e-3, atol=2e-3)), (torch.bfloat16, dict(rtol=3e-2, atol=3e-2))], ids=str
)
def test_flex_equals_the_twin_on_cuda(dtype, tol):
    for lengths in ([1], [300], [5, 700, 1, 0, 129, 128, 256]):
        _compare(lengths, None, True, "flex", against="torch", device="cuda", dtype=dtype, tol=tol)
    _compare([3, 0, 200, 1], [500, 7, 129, 0], False, "flex", against="torch", device="cuda", dtype=dtype, tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, dict(rtol=3e-2, atol=3e-2)), (torch.bfloat16, dict(rtol=3e-2, atol=3e-2))], ids=str
)
def test_varlen_equals_the_twin_on_cuda(dtype, tol):
    """fp32 inputs run the kernel in bf16 (kernels.varlen): both precisions hold bf16's tolerance against the
    per-sample twin in the inputs' dtype."""
    for lengths in ([1], [300], [5, 700, 1, 0, 129, 128, 256]):
        _compare(lengths, None, True, "varlen", against="torch", device="cuda", dtype=dtype, tol=tol)
    _compare([3, 0, 200, 1], [500, 7, 129, 0], False, "varlen", against="torch", device="cuda", dtype=dtype, tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_gives_queries_without_keys_zeros_and_finite_gradients():
    qo, ko = _offsets([2, 1, 3]), _offsets([0, 4, 0])
    q, k, v = _qkv(6, 4, dtype=torch.bfloat16, device="cuda")
    out = jagged_attention(q, k, v, qo, ko, causal=False, impl="varlen")
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[3:], torch.zeros_like(out[3:]))
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["flex", "varlen"])
def test_deterministic_mode_gives_the_same_gradients_bit_for_bit(impl):
    """FlexAttention's backward is reproducible as it is; varlen's under torch's deterministic algorithms, which
    kernels.attention.is_deterministic reports."""
    from kernels.attention import is_deterministic
    from kernels.impl import Impl

    qo = _offsets([700, 3, 1500, 64])
    q, k, v = _qkv(int(qo[-1]), int(qo[-1]), heads=4, dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device="cuda", dtype=q.dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(impl == "varlen")
    try:
        assert is_deterministic(Impl(impl), q.device)
        grads = []
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            jagged_attention(q, k, v, qo, causal=True, impl=impl).backward(grad)
            grads.append([t.grad.clone() for t in (q, k, v)])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_gives_the_same_bits_from_a_cold_and_from_a_warm_compile_cache(tmp_path):
    """FlexAttention is the deterministic mode's kernel: its numbers may not depend on what the compile caches hold.
    Three processes: a cold cache; another cold cache that first compiles what the benches and the deterministic
    runs compile (whole and ragged blocks, both dtypes, deterministic algorithms on and off); that warm cache again."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.kernels.flex_cache_probe import CHECK_CASES

    root = Path(__file__).resolve().parents[2]

    def probe(cache: str, *args: str) -> None:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": str(root)}
        subprocess.run([sys.executable, "-m", "tests.kernels.flex_cache_probe", *args], env=env, check=True, cwd=root)

    probe("cold", "check", str(tmp_path / "cold.pt"))
    probe("warm", "warm")
    probe("warm", "check", str(tmp_path / "warmed.pt"))
    probe("warm", "check", str(tmp_path / "warm.pt"))
    cold = torch.load(tmp_path / "cold.pt")
    for name in ("warmed", "warm"):
        for case, want, got in zip(CHECK_CASES, cold, torch.load(tmp_path / f"{name}.pt")):
            for part, a, b in zip(("out", "dq", "dk", "dv"), want, got):
                assert torch.equal(a, b), f"{name} cache, case {case[:2]} {case[2]} {case[3]}: {part} differs"
