"""The Triton HSTU attention, run by Triton's interpreter on CPU, against its per-sample twin: random jagged
batches with empty and one-token samples, targets, windows, rab with ordered and unordered timestamps (the
bucket-weight gradient's per-bucket sums assume nothing about order), both normalizations; and the kernel's
bucket arithmetic against the twin's over the whole int32 range of distances and gaps.
TRITON_INTERPRET is set before the kernel module is (re)imported, as in test_triton_interpreted.py."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

_MODULE = "kernels.triton.triton_hstu_attention"
if _MODULE in sys.modules:
    importlib.reload(sys.modules[_MODULE])

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.pytorch.pt_hstu_attention import position_bucket, time_bucket  # noqa: E402
from tests.kernels.hstu_cases import Case, assert_matches_twin, inputs, run  # noqa: E402

hstu = sys.modules.get(_MODULE) or importlib.import_module(_MODULE)


@st.composite
def cases(draw) -> Case:
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    targets = draw(st.none() | st.just([draw(st.integers(0, n)) for n in lengths]))
    return Case(
        lengths=lengths,
        heads=draw(st.sampled_from([1, 2])),
        dim=draw(st.sampled_from([16, 24])),
        dim_v=draw(st.sampled_from([16, 32])),
        targets=targets,
        window=draw(st.sampled_from([0, 0, 1, 7, 20])),
        rab=draw(st.booleans()),
        ordered_times=draw(st.booleans()),
        seq_norm=draw(st.sampled_from([None, 64])),
        recompute=draw(st.booleans()),
        paired=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=12, deadline=None)
@given(cases())
def test_the_kernel_matches_its_twin_on_random_jagged_batches(case):
    assert_matches_twin(case, "cpu")


def test_a_target_block_beyond_one_key_block_and_a_window_inside_it():
    """Lengths over two blocks (16 under the interpreter) with many targets and a window shorter than a block:
    every masked-tile path of the kernels at once, with the dQ pass reading the kept dS and recomputing it."""
    for recompute, paired in ((False, True), (True, False), (True, True)):
        case = Case(lengths=[45, 3], targets=[20, 1], window=5, rab=True, recompute=recompute, paired=paired)
        assert_matches_twin(case, "cpu")


def test_the_kernels_read_the_batchs_pair_buckets(monkeypatch):
    """The precomputed pair buckets are what the kernels read: the twin's numbers with them (above), and other
    numbers with every pair's buckets zeroed."""
    import dataclasses

    import tests.kernels.hstu_cases as cases_module

    case = Case(lengths=[30, 7], targets=[4, 0], rab=True)
    data = inputs(case, "cpu")
    right = run(case, data, "triton")
    real = cases_module.hstu_sequences

    def zeroed(*args, **kwargs):
        seqs = real(*args, **kwargs)
        return dataclasses.replace(seqs, pair_buckets=torch.zeros_like(seqs.pair_buckets))

    monkeypatch.setattr(cases_module, "hstu_sequences", zeroed)
    assert not torch.allclose(run(case, data, "triton")[0], right[0])


def test_both_copies_of_the_pair_buckets_hold_every_pair_and_the_twins_buckets():
    """The key-major copy (the dK/dV pass's) and the query-major one (the forward's and the dQ pass's) give every
    causal pair of every sample the twin's position and time buckets, at the offsets of their layouts' formulas;
    the query-major rows fit in the key-major columns' room (one sample start for both)."""
    lengths, num_pb, num_tb = [1, 0, 8, 9, 23, 40], 40, 24
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    times = torch.randint(0, 10**6, (sum(lengths),), generator=torch.Generator().manual_seed(3)).cumsum(0)
    targets = torch.tensor([min(3, n) for n in lengths], dtype=torch.int32)
    layout = hstu.pair_layout(offsets[1:] - offsets[:-1])
    pairs = hstu.pair_buckets(
        offsets, hstu.sample_order(offsets), max(lengths), layout, targets, times, (num_pb, num_tb)
    )
    room = [*(layout[0][1:] - layout[0][:-1]).tolist(), layout[1] - int(layout[0][-1])]
    for s, n in enumerate(lengths):
        base, start, history, groups = int(layout[0][s]), int(offsets[s]), n - int(targets[s]), (n + 7) // 8
        assert 8 * (n // 8 + 1) * (n - 4 * (n // 8)) <= room[s]  # where row n would start: the rows' end
        for r in range(n):
            g = r // 8
            for c in range(r + 1):
                cg = c // 8
                key_major = 8 * (8 * cg * groups - 4 * cg * (cg - 1) + (c - 8 * cg) * (groups - cg) - cg) + r
                query_major = 8 * (g + 1) * (r - 4 * g) + c
                want = int(position_bucket(torch.tensor(min(r, history) - min(c, history)), num_pb))
                want |= int(time_bucket(times[start + r] - times[start + c], num_tb)) << 8
                assert int(pairs[0, base + key_major]) == want, (s, r, c)
                assert int(pairs[1, base + query_major]) == want, (s, r, c)


@pytest.mark.parametrize("ordered, window", [(True, 20), (False, 20), (True, 0)])
def test_the_kept_score_gradients_give_the_recomputed_ones(ordered, window):
    """dQ from the dS the dK/dV pass kept against dQ from recomputed scores, the position weights' gradient from
    the kept dS's diagonals and the time weights' from a pass over the kept dS and the pair buckets against the
    dK/dV pass's per-bucket sums: one formula each, summed in other orders, so equal to float rounding; every other
    output equal, with times in order or not, with a window or without."""
    case = Case(lengths=[37, 0, 1, 50, 70], targets=[3, 0, 1, 50, 0], window=window, rab=True, ordered_times=ordered)
    data = inputs(case, "cpu")
    kept = run(case, data, "triton")
    recomputed = run(Case(**{**case.__dict__, "recompute": True}), data, "triton")
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_position_weights", "d_time_weights"), kept, recomputed):
        if name in ("dq", "d_position_weights", "d_time_weights"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name


def test_the_per_pair_bias_adds_the_bits_of_the_gathered_one(monkeypatch):
    """With dS kept and the pair buckets read, the forward and the dK/dV pass read the layer's per-pair bias (the
    joint table gathered by one pass over the pairs, in q's dtype, query-major and key-major) instead of gathering
    it per score: in fp32 the same value is added, so the output and every gradient have the gathering passes'
    bits."""
    case = Case(lengths=[37, 0, 1, 50, 9], targets=[3, 0, 1, 5, 0], window=20, rab=True, ordered_times=False)
    data = inputs(case, "cpu")
    monkeypatch.setattr(hstu, "KEY_BIAS_DIM", 0)  # the dK/dV pass's bias too, at the interpreter's head dims
    reads, used = hstu._Launch.pair_bias, []

    def spied(self, copy):
        kernel_args = reads(self, copy)
        used.append((copy, kernel_args["PAIR_BIAS"]))
        return kernel_args

    monkeypatch.setattr(hstu._Launch, "pair_bias", spied)
    read = run(case, data, "triton")
    assert used == [(1, True), (0, True)]  # the forward's, query-major, and the dK/dV pass's, key-major
    monkeypatch.setattr(
        hstu._Launch, "pair_bias", lambda self, copy: dict(BIAS=self.unused, total_pairs=0, PAIR_BIAS=False)
    )
    gathered = run(case, data, "triton")
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_position_weights", "d_time_weights"), read, gathered):
        assert torch.equal(a, b), name


@triton.jit
def _bucket_kernel(
    X,
    POS,
    n,
    num_buckets,
    BLOCK: tl.constexpr,
    P_LINEAR: tl.constexpr,
    P_LOG2: tl.constexpr,
    P_SUB: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0)
    tl.store(POS + i, hstu._position_bucket(x, num_buckets, P_LINEAR, P_LOG2, P_SUB), mask=i < n)


@triton.jit
def _time_bucket_kernel(
    ROWS, COLS, OUT, num_buckets, BLOCK: tl.constexpr, T_LINEAR: tl.constexpr, T_LOG2: tl.constexpr, T_SUB: tl.constexpr
):
    i = tl.arange(0, BLOCK)
    tb = hstu._time_buckets(tl.load(ROWS + i), tl.load(COLS + i), num_buckets, T_LINEAR, T_LOG2, T_SUB)
    tl.store(OUT + i[:, None] * BLOCK + i[None, :], tb)


@pytest.mark.parametrize("num_buckets", [1, 16, 64, 200])
def test_the_kernels_buckets_are_the_twins(num_buckets):
    powers = torch.tensor([1 << e for e in range(31)])
    edges = torch.cat([torch.arange(0, 70), powers - 1, powers, powers + 1, torch.tensor([2**31 - 1])])
    x = torch.cat([edges, torch.randint(0, 2**31 - 1, (256,), generator=torch.Generator().manual_seed(0))])
    x = x.to(torch.int32)
    pos = torch.empty_like(x)
    block = triton.next_power_of_2(x.numel())
    _bucket_kernel[(1,)](x, pos, x.numel(), num_buckets, BLOCK=block, **constants_of("P"))
    assert torch.equal(pos, position_bucket(x, num_buckets))


@pytest.mark.parametrize("num_buckets", [16, 64, 200])
@pytest.mark.parametrize("span", [2**20, 2**31 - 1, 2**31, 2**40, 2**61])
def test_the_kernels_time_buckets_are_the_twins_for_any_int64_gap(num_buckets, span):
    """A tile's time buckets against the twin's, at spans of time on both sides of int32's range (the kernel's
    int32 and int64 paths): seconds, milliseconds and beyond, negative and unordered times included."""
    gen = torch.Generator().manual_seed(span % 1000 + num_buckets)
    block = 64
    base = torch.randint(-(2**40), 2**40, (1,), generator=gen)
    times = base + torch.randint(0, span, (2 * block,), generator=gen)
    times[:3] = base + torch.tensor([0, span - 1, span // 2])  # both ends of the span, and a gap of half of it
    rows, cols = times[:block].contiguous(), times[block:].contiguous()
    out = torch.empty(block, block, dtype=torch.int32)
    _time_bucket_kernel[(1,)](rows, cols, out, num_buckets, BLOCK=block, **constants_of("T"))
    assert torch.equal(out, time_bucket(rows[:, None] - cols[None, :], num_buckets))


def constants_of(part: str) -> dict:
    return {k: v for k, v in hstu._BUCKET_CONSTANTS.items() if k.startswith(part + "_")}


def _op_args(
    lengths: list[int], heads: int = 2, dim: int = 16, rab: bool = True, keep: bool = True, seed: int = 0
) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(n, heads, dim, generator=gen).requires_grad_() for _ in "qkv")
    weights = [torch.randn(heads, b, generator=gen).requires_grad_() if rab else None for b in (40, 24)]
    times = 1_700_000_000_000 + torch.randint(0, 10**9, (n,), generator=gen).cumsum(0)  # milliseconds: int64
    targets = torch.tensor([min(2, n) for n in lengths], dtype=torch.int32)
    order = hstu.sample_order(offsets)
    layout = hstu.pair_layout(offsets[1:] - offsets[:-1]) if keep else (None, 0)
    buckets = None
    if keep and rab:  # the pairs' buckets, read in place of computing them
        buckets = hstu.pair_buckets(offsets, order, max(lengths), layout, targets, times, (40, 24))
    tensors = (q, k, v, offsets, order, targets, times if rab else None, *weights, layout[0], buckets)
    return (*tensors, max(lengths), 0.3, 64, 0, False, layout[1], keep)


def test_the_attention_is_a_torch_operator_with_its_fake_and_autograd():
    """torch.library's own check: the schema, the fake (meta) function's shapes and strides against the real
    ones, the autograd formula, and tracing by AOTAutograd with static and dynamic shapes; with and without the
    kept score gradients and the precomputed pair buckets."""
    for rab, keep in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(torch.ops.freescale.hstu_attention.default, _op_args([5, 0, 18], rab=rab, keep=keep))


def test_q_k_v_as_views_of_one_projection_are_read_in_place():
    """The layer's q, k, v are column slices of one [N, 4 H D] output: the kernel reads them with their row stride
    and gives the numbers (and gradients) of contiguous copies."""
    case = Case(lengths=[19, 2, 33], targets=[3, 0, 5], rab=True)
    data = inputs(case, "cpu")
    want = run(case, data, "triton")
    packed = torch.cat([data["q"], data["k"], data["v"]], dim=-1)  # [N, H, 3 D]: each a strided view
    views = {name: packed[..., i * case.dim : (i + 1) * case.dim] for i, name in enumerate("qkv")}
    assert views["k"].stride(0) == 3 * case.heads * case.dim or case.heads == 1
    got = run(case, {**data, **views}, "triton")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_function_around_the_operator_compiles_once_for_every_token_count():
    """torch.compile with dynamic shapes (AOTAutograd's trace, no code generation) through the operator and its
    backward: the compiled function's output and gradients equal eager's, and a second batch of other lengths
    (another token count, longest sample and kept score gradients' size) reuses the first graph."""
    import torch._dynamo

    def layer(x, w, offsets, order, targets, max_len, base, pairs):
        q, k, v = (x @ w).chunk(3, dim=-1)
        heads = lambda t: t.reshape(t.shape[0], 2, 8)  # noqa: E731
        args = (offsets, order, targets, None, None, None, base, None, max_len, 0.3, 0, 0, False, pairs, True)
        return torch.ops.freescale.hstu_attention(heads(q), heads(k), heads(v), *args).flatten(1).relu().sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, backend="aot_eager")
    for lengths in ([7, 0, 12], [3, 30]):
        gen = torch.Generator().manual_seed(len(lengths))
        offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        x = torch.randn(sum(lengths), 8, generator=gen)
        order, targets = hstu.sample_order(offsets), torch.tensor([1] * len(lengths), dtype=torch.int32)
        grads = []
        for fn in (layer, compiled):
            w = torch.randn(8, 48, generator=torch.Generator().manual_seed(1)).requires_grad_()
            out = fn(x, w, offsets, order, targets, max(lengths), *hstu.pair_layout(offsets[1:] - offsets[:-1]))
            out.backward()
            grads.append((out.detach(), w.grad))
        assert torch.allclose(grads[0][0], grads[1][0]) and torch.allclose(grads[0][1], grads[1][1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_the_models_layer_compiles_into_one_graph_through_the_operator():
    """An HSTU layer with the Triton attention under torch.compile (dynamic shapes, AOTAutograd's trace) is one
    graph with no break, for every token count: a break (kernels.hstu's checks once broke it on an f-string of a
    symbolic size) splits the layer in two, and autograd then sums the input's two gradients in a separate pass
    over the [N, d] activations per layer. Counted: no graph break, one graph, and no gradient sum outside it."""
    import numpy as np
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.hstu_step import synthetic_batch, uih_lengths
    from kernels.impl import Impl
    from pipelines.models.hstu import HSTU_PRESETS, HSTUConfig, HSTUModel, truncate

    config = HSTUConfig(**{**HSTU_PRESETS["hstu"], "num_items": 100, "head_dim": 16, "compile": False})
    model = HSTUModel(config).train()
    model.attention_impl = lambda device: Impl.TRITON
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = torch.compile(model.layers[0], dynamic=True, backend="aot_eager")
    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        batch = synthetic_batch(uih_lengths("zipf", 3, 40, 1.2, rng), rng.integers(1, 3, 3), config, rng)
        seq = model._pack(batch, truncate(batch, config.max_uih))
        x = torch.randn(seq.attention.num_tokens, config.dim, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            layer(x, seq).sum().backward()
        sums = [
            e
            for e in prof.key_averages(group_by_input_shape=True)
            if e.key == "aten::add_" and e.input_shapes[:1] == [list(x.shape)]
        ]
        assert not sums, f"the input's gradient summed outside the graph: {sums}"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_bad_inputs_at_the_kernels_edge_end_in_one_line_naming_them():
    from kernels.hstu import hstu_attention, hstu_sequences

    offsets = torch.tensor([0, 4, 4, 10])
    q = torch.zeros(10, 2, 16)
    for targets, sample, value, length in (([1, 0, 7], 2, 7, 6), ([1, -1, 0], 1, -1, 0)):
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError) as err:
                hstu_attention(q, q, q, offsets, alpha=1.0, num_targets=torch.tensor(targets), impl=impl)
            message = str(err.value)
            assert message == (
                f"kernels.hstu.hstu_attention: num_targets of sample {sample} is {value}, outside [0, its length "
                f"{length}]"
            )
    with pytest.raises(ValueError, match=r"timestamps must be \[N=10\] int64 \(seconds\), got \(10,\) torch.float32"):
        hstu_sequences(offsets, timestamps=torch.zeros(10), device="cpu")
    seqs = hstu_sequences(offsets, num_targets=torch.tensor([0, 0, 6]), device="cpu")
    with pytest.raises(ValueError, match="num_targets and timestamps come inside the HSTUSequences"):
        hstu_attention(q, q, q, seqs, alpha=1.0, num_targets=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="q has 9 rows, the offsets 10"):
        hstu_attention(q[:9], q[:9], q[:9], seqs, alpha=1.0)
