"""The bucketed dense all-reduce: every rank ends with the sum of every rank's gradients and the bookkeeping
block, whatever the bucket size, also when one rank's backward leaves parameters without a gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))


def _step(rank, world_size, bucket_bytes, skip_last_layers):
    from pipelines.api.dense_sync import DenseSync

    model = _model()
    sync = DenseSync(model.parameters(), rank, world_size, torch.device("cpu"), bucket_bytes=bucket_bytes)
    out = []
    for step in range(2):
        sync.zero_grad()
        x = torch.full((4, 8), float(rank + 1 + step))
        if skip_last_layers and rank == 1:  # this rank's loss never reaches the last two layers
            loss = model[1](model[0](x)).sum()
        else:
            loss = model(x).sum()
        loss.backward()
        if step == 0:  # every global field from the host
            book = sync.all_reduce((1.0, float(rank), 2.0), (float(rank), 1.0, 2.0, 3.0, 4.0))
        else:  # the last two from a tensor (on the device in training: the loss, never read before)
            book = sync.all_reduce(
                (1.0,), (float(rank), 1.0, 2.0, 3.0, 4.0), device_scalars=torch.tensor([float(rank), 2.0])
            )
        out.append(([p.grad.clone() for p in model.parameters()], book))
    return sync.num_buckets, out


def _expected(world_size, skip_last_layers):
    """Gradients summed over ranks, computed in one process."""
    sums = []
    for step in range(2):
        model = _model()
        for rank in range(world_size):
            x = torch.full((4, 8), float(rank + 1 + step))
            loss = model[1](model[0](x)).sum() if skip_last_layers and rank == 1 else model(x).sum()
            loss.backward()
        sums.append([p.grad.clone() for p in model.parameters()])
    return sums


@pytest.mark.parametrize("bucket_bytes", [0, 300, 1 << 20])
@pytest.mark.parametrize("skip_last_layers", [False, True])
def test_every_rank_gets_the_summed_gradients_and_the_block(bucket_bytes, skip_last_layers):
    world_size = 2
    results = run_ranks(_step, world_size, (bucket_bytes, skip_last_layers))
    expected = _expected(world_size, skip_last_layers)
    for num_buckets, out in results:
        if bucket_bytes == 300:
            assert num_buckets > 2, "small buckets: several all-reduces overlap the backward"
        for step, (grads, book) in enumerate(out):
            for got, want in zip(grads, expected[step]):
                torch.testing.assert_close(got, want)
            assert book[:3].tolist() == [2.0, 1.0, 4.0]
            assert book[3:].reshape(world_size, 5).tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 3.0, 4.0]]


def test_negative_bucket_size_is_refused():
    from pipelines.api.dense_sync import DenseSync

    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        DenseSync(_model().parameters(), 0, 1, torch.device("cpu"), bucket_bytes=-1)


def test_wrong_number_of_fields_is_refused():
    from pipelines.api.dense_sync import DenseSync

    sync = DenseSync(_model().parameters(), 0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected 3 global fields"):
        sync.all_reduce((1.0,), (0.0, 1.0, 2.0, 3.0, 4.0), device_scalars=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="5 per-rank fields"):
        sync.all_reduce((1.0, 2.0, 3.0), (0.0,))


def _step_cuda(rank, world_size):
    from pipelines.api.dense_sync import DenseSync

    device = torch.device("cuda", 0)
    model = _model().to(device)
    sync = DenseSync(model.parameters(), rank, world_size, device, bucket_bytes=300)
    sync.zero_grad()
    model(torch.ones(4, 8, device=device)).sum().backward()
    book = sync.all_reduce((3.0,), (0.5, 1.0, 2.0, 3.0, 6.0), device_scalars=torch.tensor([4.0, 5.0], device=device))
    return book.dtype, book.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_block_comes_back_through_pinned_memory_on_cuda():
    dtype, book = run_ranks(_step_cuda, 1, backend="nccl", timeout=120)[0]
    assert dtype == np.float64 and book == [3.0, 4.0, 5.0, 0.5, 1.0, 2.0, 3.0, 6.0]


def test_the_block_is_read_by_field_name():
    """Each rank's slot holds PER_RANK_FIELDS in order after the global fields; the trainer reads them by name."""
    from pipelines.api.dense_sync import GLOBAL_FIELDS, PER_RANK_FIELDS, per_rank_of

    world, n = 3, len(PER_RANK_FIELDS)
    book = np.arange(len(GLOBAL_FIELDS) + world * n, dtype=np.float64)
    columns = per_rank_of(book, world)
    assert list(columns) == list(PER_RANK_FIELDS)
    for i, name in enumerate(PER_RANK_FIELDS):
        assert columns[name].tolist() == [len(GLOBAL_FIELDS) + r * n + i for r in range(world)]


def test_the_global_sums_are_added_in_rank_order_whatever_the_backend_did():
    """Float addition is not associative: a sum all-reduced by the backend takes its algorithm's order, which
    follows the layout of the ranks over hosts; the block's rows are added one rank after the other."""
    from pipelines.api.dense_sync import _ROW, GLOBAL_FIELDS, PER_RANK_FIELDS, _summed

    world = 3
    rows = np.zeros((world, _ROW), dtype=np.float32)
    rows[:, 1] = [2.0**60, 1.0, -(2.0**60)]  # loss_sum: (2^60 + 1) - 2^60 = 0 in rank order, 1 in another
    rows[:, 0] = [4.0, 5.0, 6.0]
    rows[:, len(GLOBAL_FIELDS) :] = np.arange(world * len(PER_RANK_FIELDS)).reshape(world, -1)
    book = _summed(rows.reshape(-1), world)
    assert book[:3].tolist() == [15.0, 0.0, 0.0]
    assert book[3:].tolist() == list(range(world * len(PER_RANK_FIELDS)))
