"""The VARLEN path of kernels.attention on CPU, with torch's varlen FlashAttention (CUDA only) replaced by a twin
of its contract: the dispatch hands it int32 offsets, the longest lengths, the causal window and bf16 inputs,
casts back, and zeroes queries without keys; PackedOffsets are read as given, with no host work; the softmax
model picks a kernel and asks for a plan only where the kernel takes block masks. The real kernel against the
per-sample twin: test_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.attention as attention
from kernels.attention import NEEDS_BLOCK_MASK, PackedOffsets, jagged_attention, resolve_impl
from kernels.impl import Impl
from tests.kernels.test_attention_gpu import _offsets, _qkv


def _fake_varlen(calls: list):
    """torch's varlen_attn contract in plain torch: per-sample SDPA over the cumulative offsets; ``(-1, 0)`` causal
    (bottom-right aligned, as FlashAttention aligns it), ``(-1, -1)`` full; an empty key range gives NaN, so the
    dispatch's own zeroing is what the test sees."""

    def varlen_attn(*, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size):
        calls.append(
            dict(
                dtypes=(query.dtype, key.dtype, value.dtype),
                cu=(cu_seq_q.dtype, cu_seq_k.dtype),
                max=(max_q, max_k),
                window=window_size,
            )
        )
        assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32
        out = torch.full_like(query, float("nan"))
        qo, ko = cu_seq_q.tolist(), cu_seq_k.tolist()
        for s in range(len(qo) - 1):
            if qo[s + 1] == qo[s] or ko[s + 1] == ko[s]:
                continue
            q, k, v = (
                t.float().transpose(0, 1)
                for t in (query[qo[s] : qo[s + 1]], key[ko[s] : ko[s + 1]], value[ko[s] : ko[s + 1]])
            )
            one = F.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0))
            out[qo[s] : qo[s + 1]] = one.transpose(0, 1).to(query.dtype)
        return out

    return varlen_attn


@pytest.fixture
def fake_varlen(monkeypatch):
    import torch.nn.attention.varlen as varlen

    calls: list = []
    monkeypatch.setattr(varlen, "varlen_attn", _fake_varlen(calls))
    monkeypatch.setattr(attention, "VARLEN_DEVICE_TYPES", ("cuda", "cpu"))
    return calls


@pytest.mark.parametrize("lengths", [[1], [5, 0, 17, 3], [64, 64]], ids=str)
def test_causal_dispatch_hands_the_kernel_int32_offsets_bf16_and_the_causal_window(fake_varlen, lengths):
    qo = _offsets(lengths)
    q, k, v = _qkv(int(qo[-1]), int(qo[-1]))
    out = jagged_attention(q, k, v, qo, causal=True, impl="varlen")
    want = jagged_attention(q, k, v, qo, causal=True, impl="torch")
    assert out.dtype == torch.float32  # cast back to the inputs' dtype outside autocast
    (call,) = fake_varlen
    assert call["dtypes"] == (torch.bfloat16,) * 3 and call["window"] == (-1, 0) and call["max"] == (max(lengths),) * 2
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_cross_dispatch_zeroes_queries_without_keys_and_keeps_gradients_finite(fake_varlen):
    qo, ko = _offsets([2, 1, 3]), _offsets([0, 4, 2])
    q, k, v = _qkv(6, 6)
    out = jagged_attention(q, k, v, qo, ko, causal=False, impl="varlen")
    assert fake_varlen[0]["window"] == (-1, -1) and fake_varlen[0]["max"] == (3, 4)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)) and torch.equal(
        q.grad[:2], torch.zeros_like(q.grad[:2])
    )
    torch.testing.assert_close(out, jagged_attention(q, k, v, qo, ko, causal=False, impl="torch"), rtol=2e-2, atol=2e-2)


def test_packed_offsets_are_taken_as_given_without_host_reads(fake_varlen, monkeypatch):
    qo = _offsets([3, 4])
    q, k, v = _qkv(7, 7)
    packed = PackedOffsets.from_host(qo, "cpu")
    assert packed.device.dtype == torch.int32 and packed.max_len == 4
    # Validating host values is the conversion path's work; offsets that come packed skip it.
    monkeypatch.setattr(attention, "_host_offsets", lambda *a: pytest.fail("host offsets read for packed offsets"))
    jagged_attention(q, k, v, packed, causal=True, impl=Impl.VARLEN)
    stale = PackedOffsets(qo, packed.device[:2], 4)
    with pytest.raises(ValueError, match="must match the host ones"):
        jagged_attention(q, k, v, stale, causal=True, impl="varlen")


def test_varlen_is_refused_where_flash_attention_does_not_run():
    q, k, v = _qkv(4, 4)
    with pytest.raises(ValueError, match="VARLEN path runs on CUDA"):
        jagged_attention(q, k, v, _offsets([4]), causal=True, impl="varlen")


def test_defaults_and_which_kernels_need_a_plan():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_impl(None, cuda) is Impl.VARLEN and resolve_impl(None, cpu) is Impl.TORCH
    assert resolve_impl(None, cuda, deterministic=True) is Impl.FLEX
    assert NEEDS_BLOCK_MASK == {Impl.FLEX}


def test_the_softmax_model_asks_for_a_plan_only_for_flex():
    from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

    cuda = torch.device("cuda")
    default = SoftmaxModel(SoftmaxConfig(num_items=10, dim=32, num_heads=2, max_uih=16))
    flex = SoftmaxModel(SoftmaxConfig(num_items=10, dim=32, num_heads=2, max_uih=16, attention_impl="flex"))
    narrow = SoftmaxModel(SoftmaxConfig(num_items=10, dim=12, num_heads=2, max_uih=16))  # head dim 6: no flash kernel
    assert default.attention_impl(cuda) is Impl.VARLEN and not default.needs_plan(cuda)
    assert flex.attention_impl(cuda) is Impl.FLEX and flex.needs_plan(cuda)
    assert narrow.attention_impl(cuda) is Impl.TORCH and not narrow.needs_plan(cuda)
    assert default.attention_impl(torch.device("cpu")) is Impl.TORCH
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        SoftmaxConfig(attention_impl="sdpa")
