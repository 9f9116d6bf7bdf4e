"""Duplicate rows of a step are summed deterministically: every row once (CPU) or repeated with the same sum
(the device form, whose row count never reaches the host), each sum in arrival order. The fused Triton update
(run by Triton's interpreter here) gives the torch path's rows and state over several steps, for every optimizer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsembed.optim import SGD, Adam, RowWiseAdagrad, get_optimizer, sum_duplicate_rows
from kernels.impl import Impl
from kernels.triton import triton_rowwise


def _expected(ids: torch.Tensor, grads: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for i, row in zip(ids.tolist(), grads):
        out[i] = out[i] + row if i in out else row.clone()  # arrival order, one add at a time
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=40), st.integers(1, 5), st.integers(0, 2**16))
def test_every_row_once_with_its_summed_gradient(ids, dim, seed):
    ids_t = torch.tensor(ids, dtype=torch.int64)
    grads = torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed))
    rows, sums = sum_duplicate_rows(ids_t, grads)
    expected = _expected(ids_t, grads)
    assert rows.tolist() == sorted(expected), "each touched row once, ascending"
    for r, s in zip(rows.tolist(), sums):
        torch.testing.assert_close(s, expected[r], rtol=1e-6, atol=1e-6)


def test_no_rows():
    rows, sums = sum_duplicate_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    assert rows.numel() == 0 and sums.shape == (0, 3)


OPTIMIZERS = [SGD(lr=0.1), RowWiseAdagrad(lr=0.1, eps=1e-6), Adam(lr=0.01, eps=1e-6)]


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(OPTIMIZERS),
    st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=14), min_size=1, max_size=3),
    st.sampled_from([1, 5, 20]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**16),
)
def test_the_fused_update_gives_the_torch_paths_rows_and_state(optimizer, steps, dim, dtype, seed):
    """Steps of ids with repeats (empty steps too), rows several column blocks wide and segments several entry
    blocks long (8 columns and 2 entries a block here), fp32 and bf16 tables: every row and state entry as the
    torch path's, untouched rows bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(12, dim, generator=gen).to(dtype)
    tables = {impl: (weight.clone(), optimizer.init_state(weight)) for impl in (Impl.TORCH, Impl.TRITON)}
    launches = []
    fused = triton_rowwise.rowwise_update
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_rowwise, "ROW_BLOCK_D", 8)
        patch.setattr(triton_rowwise, "ROW_BLOCK_E", 2)
        patch.setattr(triton_rowwise, "rowwise_update", lambda *a, **k: launches.append(fused(*a, **k)))
        for ids in steps:
            ids_t = torch.tensor(ids, dtype=torch.int64)
            grads = torch.randn(len(ids), dim, generator=gen)
            for impl, (w, state) in tables.items():
                optimizer.apply(w, state, ids_t, grads.clone(), impl=impl)
    assert len(launches) == sum(1 for ids in steps if ids)  # the Triton path ran, once a step with ids
    (w_torch, s_torch), (w_fused, s_fused) = tables.values()
    # bf16: one unit in the last place, where the two fp32 results round apart
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(w_fused, w_torch, **tol)
    for key in s_torch:
        torch.testing.assert_close(s_fused[key], s_torch[key], rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(12)) - {i for ids in steps for i in ids})
    assert torch.equal(w_fused[untouched], weight[untouched])


def test_a_subclasss_own_update_runs_the_torch_way():
    class Halving(SGD):
        def update_rows(self, weight, state, rows, grad):
            weight.index_copy_(0, rows, weight.index_select(0, rows) / 2)

    weight = torch.ones(4, 3)
    Halving().apply(weight, {}, torch.tensor([1, 1, 3]), torch.ones(3, 3), impl=Impl.TRITON)
    assert weight[:, 0].tolist() == [1.0, 0.5, 1.0, 0.5]
    assert get_optimizer("adam").hyperparameters() == dict(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8)


_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from benchmarks.hstu_static import resource_usage
    from kernels.triton.triton_rowwise import KINDS, ROW_BLOCK_D, ROW_BLOCK_E, _rowwise_update_kernel as kernel

    for kind in KINDS.values():
        for table in ("fp32", "bf16"):
            constants = dict(KIND=kind, BLOCK_E=ROW_BLOCK_E, BLOCK_D=ROW_BLOCK_D)
            pointers = dict(grads=table, weight=table, m_state="fp32", v_state="fp32", row_state="fp32")
            signature = {
                name: "constexpr" if name in constants else "*" + pointers.get(name, "i64")
                if name in pointers or name in ("sorted_ids", "order", "offsets")
                else "fp32" if name in ("lr", "beta1", "beta2", "eps") else "i32"
                for name in kernel.arg_names
            }
            source = ASTSource(kernel, signature, constexprs=constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            print(kind, table, *resource_usage(compiled.asm["cubin"]))
    """
)


def test_the_fused_kernel_compiles_for_sm90_without_spilling():
    """The CUDA compiler, not the interpreter (which runs fp64 math and scalar branches as numpy does): every kind,
    fp32 and bf16 tables, compiled for the H100's sm_90 by the Triton wheel's own ptxas, no GPU needed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real JIT, in a process of its own
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0 and "not found (the Triton wheel" in done.stderr:
        pytest.skip(done.stderr.strip()[-300:])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 6 and all(0 < int(regs) <= 255 and stack == "0" for *_, regs, stack in rows), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_the_fused_update_on_cuda_gives_the_torch_paths_rows_three_steps_running(name):
    """At the HSTU step's size: 30,000 Zipf-repeated ids into 100,000 rows of 1,024, three steps."""
    optimizer = get_optimizer(name, lr=0.01)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(100_000, 1024, device="cuda", generator=gen)
    tables = {impl: (weight.clone(), optimizer.init_state(weight)) for impl in (Impl.TORCH, Impl.TRITON)}
    for _ in range(3):
        ids = (torch.rand(30_000, device="cuda", generator=gen) ** 4 * 100_000).long()
        grads = torch.randn(30_000, 1024, device="cuda", generator=gen)
        for impl, (w, state) in tables.items():
            optimizer.apply(w, state, ids, grads, impl=impl)
    (w_torch, s_torch), (w_fused, s_fused) = tables.values()
    torch.testing.assert_close(w_fused, w_torch, rtol=1e-5, atol=1e-5)
    for key in s_torch:
        torch.testing.assert_close(s_fused[key], s_torch[key], rtol=1e-5, atol=1e-5)
