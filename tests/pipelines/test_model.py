"""The softmax model: padding invariance, truncation to the most recent events, empty batches, the jagged
attention against the padded one (fp32, rtol 1e-4 / atol 1e-5 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdata.batch import Batch, Sample
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel


def _sample(i: int, length: int, rng) -> Sample:
    return Sample(
        sample_id=i,
        user_id=i,
        uih_item_ids=rng.integers(0, 500, length),
        candidate_labels=rng.integers(0, 2, (2, 1)).astype(np.float32),
        content_ids=[rng.integers(0, 500, 2), rng.integers(0, 500, 1)],
        dense=rng.random(4, dtype=np.float32),
        uih_action_types=rng.integers(0, 4, length),
        uih_timestamps=np.arange(length),
    )


def _model(max_uih=64) -> SoftmaxModel:
    torch.manual_seed(0)
    return SoftmaxModel(
        SoftmaxConfig(num_items=500, dim=32, num_layers=2, num_heads=2, max_uih=max_uih)
    ).eval()  # head dim 16: FlexAttention's least


def test_a_sample_scores_the_same_whatever_it_is_batched_with():
    rng = np.random.default_rng(0)
    short, long_ = _sample(1, 5, rng), _sample(2, 40, rng)
    model = _model()
    with torch.no_grad():
        alone = model(Batch.from_samples([short]))
        together = model(Batch.from_samples([long_, short]))
    torch.testing.assert_close(together[2:], alone, rtol=1e-5, atol=1e-6)  # padding to 40 changes nothing


def test_long_histories_keep_their_most_recent_events():
    rng = np.random.default_rng(1)
    s = _sample(3, 30, rng)
    recent = Sample(
        **{
            **s.__dict__,
            "uih_item_ids": s.uih_item_ids[-8:],
            "uih_action_types": s.uih_action_types[-8:],
            "uih_timestamps": s.uih_timestamps[-8:],
        }
    )
    model = _model(max_uih=8)
    with torch.no_grad():
        torch.testing.assert_close(model(Batch.from_samples([s])), model(Batch.from_samples([recent])))


def test_empty_batch_still_reaches_the_embedding_table():
    model = _model().train()
    empty = Batch.from_samples([], num_labels=1, dense_dim=4)
    logits = model(empty)
    assert logits.shape == (0, 1)
    binary_cross_entropy_sum(
        logits, empty.candidate_labels
    ).backward()  # a sharded table's backward must run on every rank
    assert model.item_embedding.weight.grad is not None


def test_host_offsets_travel_with_a_batch_moved_off_the_host():
    """A batch moved off the host answers host_offsets from what it was moved from: no copy back (from the meta
    device, which holds no data, a copy back would fail)."""
    rng = np.random.default_rng(2)
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((3, 9, 0, 5))])
    away = batch.to("meta")
    for name in ("uih_offsets", "candidate_offsets", "content_offsets"):
        assert getattr(away, name).is_meta
        assert torch.equal(away.host_offsets(name), getattr(batch, name))
        assert torch.equal(away.to("meta").host_offsets(name), getattr(batch, name))  # device to device keeps them
    assert torch.equal(batch.host_offsets("uih_offsets"), batch.uih_offsets)
    with pytest.raises(ValueError, match="not an offsets field"):
        batch.host_offsets("uih_item_ids")


def test_the_forward_reads_no_size_from_the_device():
    """The CPU stand-in of the GPU test below: on the meta device (shapes, no data) any size read back from a
    device tensor (``int()``, ``.item()``, ``repeat_interleave`` without ``output_size``) raises."""
    rng = np.random.default_rng(3)
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((3, 90, 0, 50))])
    logits = _model(max_uih=64).to("meta")(batch.to("meta"))
    assert logits.is_meta and logits.shape == (batch.candidate_labels.shape[0], 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_forward_makes_no_device_sync_for_a_batch_from_the_host():
    """The sizes come from the batch's host offsets: a sync would stall the host, then idle the GPU. (The backward
    of torch's own nn.Embedding, used for positions and actions, still reads a count back.)"""
    rng = np.random.default_rng(3)
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((3, 90, 0, 50))]).to("cuda")
    model = _model(max_uih=64).train().cuda()
    expected = model(batch.to("cpu").to("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = model(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("attention", ["jagged", "padded"])
def test_a_forward_truncates_its_batch_once_and_keeps_nothing_of_it(monkeypatch, attention):
    """The lookup's ids, the tokens and both attentions need the batch's truncation: the forward computes it once
    and hands it to its parts, and keeps nothing between calls (the step's ids come with its context, not from a
    cache in the model). ``embedding_ids`` is the embedding wrap's features: the ids the forward looks up."""
    import io

    rng = np.random.default_rng(3)
    torch.manual_seed(0)
    model = SoftmaxModel(SoftmaxConfig(num_items=500, dim=32, num_heads=2, max_uih=8, attention=attention)).eval()
    calls = []
    real = model._truncate
    monkeypatch.setattr(model, "_truncate", lambda b: calls.append(b) or real(b))
    looked_up = []
    hook = model.item_embedding.register_forward_hook(lambda module, args, out: looked_up.append(args[0]))
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((30, 4))])
    with torch.no_grad():
        model(batch)
        model(batch)
    assert len(calls) == 2  # once per forward, again for the same batch: nothing kept
    assert torch.equal(model.embedding_ids(batch)["item_embedding"], looked_up[0])
    monkeypatch.undo()
    hook.remove()
    torch.save(model, io.BytesIO())  # nothing unpicklable left on the model


def _pair(max_uih=64, **kw) -> tuple[SoftmaxModel, SoftmaxModel]:
    """The jagged and the padded model with the same weights."""
    torch.manual_seed(0)
    config = SoftmaxConfig(num_items=500, dim=32, num_layers=2, num_heads=2, max_uih=max_uih, **kw)
    jagged = SoftmaxModel(config)
    padded = SoftmaxModel(SoftmaxConfig(**{**config.__dict__, "attention": "padded"}))
    padded.load_state_dict(jagged.state_dict())
    return jagged, padded


def _logits_and_grads(model: SoftmaxModel, batch: Batch, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(batch, **kw)
    binary_cross_entropy_sum(logits, batch.candidate_labels).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# fp32 on CPU: the two paths sum the same terms in different orders (per sample against padded), nothing else.
JAGGED_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lengths", [(1,), (64,), (1, 64, 90, 7, 1), (0, 5, 33)], ids=str)
def test_the_jagged_model_has_the_padded_models_numbers(lengths):
    """Outputs and every parameter's gradient; samples of length 1, at the cap (64) and past it, a batch of one."""
    rng = np.random.default_rng(5)
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate(lengths)])
    jagged, padded = _pair()
    got, got_grads = _logits_and_grads(jagged.train(), batch)
    want, want_grads = _logits_and_grads(padded.train(), batch)
    torch.testing.assert_close(got, want, **JAGGED_TOL)
    assert got_grads.keys() == want_grads.keys()
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **JAGGED_TOL, msg=lambda m: f"{name}: {m}")


def test_an_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention must be one of jagged, padded"):
        SoftmaxConfig(attention="dense")


def test_the_plan_function_is_pure_and_picklable():
    import pickle

    from kernels.flex.block_mask import build_block_mask

    rng = np.random.default_rng(6)
    batch = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((3, 90, 1))])
    fn = pickle.loads(pickle.dumps(_model(max_uih=64).plan_function()))
    plan = fn(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets"))
    kept = torch.tensor([0, 3, 67, 68])  # 90 events truncated to the model's 64
    expected = build_block_mask(kept, causal=True)
    assert plan.uih.num_q == 68 and all(
        torch.equal(a, b) for a, b in zip(plan.uih.tensors().values(), expected.tensors().values())
    )
    assert plan.target.num_q == batch.candidate_labels.shape[0] and plan.target.num_kv == 68


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "impl,tol",
    [
        ("flex", dict(rtol=2e-3, atol=2e-4)),  # TF32-free fp32, but FlexAttention's kernels sum in their own order
        ("varlen", dict(rtol=5e-2, atol=5e-3)),  # the fp32 model's attention runs in bf16 (kernels.varlen)
    ],
)
def test_the_jagged_model_on_cuda_has_the_padded_models_numbers(impl, tol):
    """FlexAttention with the loader's plan, varlen with none (it needs none)."""
    rng = np.random.default_rng(7)
    host = Batch.from_samples([_sample(i, n, rng) for i, n in enumerate((1, 200, 90, 7, 300))])
    jagged, padded = (m.cuda().train() for m in _pair(max_uih=256, attention_impl=impl))
    device = torch.device("cuda")
    assert jagged.needs_plan(device) == (impl == "flex")
    kw = {}
    if jagged.needs_plan(device):
        plan = jagged.plan_function()(host.host_offsets("uih_offsets"), host.host_offsets("candidate_offsets"))
        kw = dict(attention_plan=plan.pin_memory().to("cuda", non_blocking=True))
    batch = host.to("cuda")
    got, got_grads = _logits_and_grads(jagged, batch, **kw)
    want, want_grads = _logits_and_grads(padded, batch)
    torch.testing.assert_close(got, want, **tol)
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=lambda m: f"{name}: {m}")
