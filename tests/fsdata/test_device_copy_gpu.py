"""The stage worker's copy to the GPU: the batches arrive on the device equal to the loader's, with the stream
order the step needs (run under TORCH_CUDA_SANITIZER=1 by scripts/gpu_suite.sh check), and the loader resumes
exactly through it. Needs a CUDA device."""

from __future__ import annotations

import pytest
import torch
from torchdata.nodes import BaseNode, Loader

from fsdata.batch import Batch
from fsdata.nodes.background import Background
from fsdata.nodes.device_copy import DeviceCopy
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from tests.stateful import run_test_save_load_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _reader():
    return GlobalBatchReader(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=40, seed=3)), 4, 0, 1)


class _Map(BaseNode):
    """Applies ``fn`` to every item of ``source``; its state is the source's."""

    def __init__(self, source, fn):
        super().__init__()
        self.source, self.fn = source, fn

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        return self.fn(next(self.source))

    def get_state(self):
        return self.source.state_dict()


def _use(item):
    """What the trainer does with an item: use its batch (here: bring it back), with nothing to wait for."""
    assert all(t.is_cuda for t in item.batch.tensors().values())
    return item.batch.to("cpu")


def _consume(source):
    return _Map(source, _use)


def test_batches_arrive_equal_on_the_device():
    expected = list(Loader(_reader()))
    got = list(Loader(_consume(Background(DeviceCopy(_reader(), "cuda")))))
    assert len(got) == len(expected) and all(isinstance(b, Batch) and b.equals(e) for b, e in zip(got, expected))


def test_device_copy_resumes_exactly():
    run_test_save_load_state(lambda: Loader(_consume(Background(DeviceCopy(_reader(), "cuda")))), midpoint=4)


def test_a_cpu_loaders_state_resumes_through_the_copy():
    cpu = Loader(Background(_reader()))
    it = iter(cpu)
    for _ in range(3):
        next(it)
    state, rest = cpu.state_dict(), list(it)
    gpu = Loader(_consume(Background(DeviceCopy(_reader(), "cuda"))))
    gpu.load_state_dict(state)
    got = list(gpu)
    assert len(got) == len(rest) and all(b.equals(e) for b, e in zip(got, rest))


class _Done:
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result

    def is_completed(self):
        return True


def test_prefetched_ids_arrive_on_the_device_with_the_batch():
    """The ID prefetch's exchange is completed in the node, and its send permutation and result are copied with
    the batch: the step's forward finds them on the device."""
    from fsdata.item import LoaderItem
    from fsembed.context import StepContext
    from fsembed.id_prefetch import PrefetchedIds, ShardedIds

    perm, shard_ids = torch.randperm(1000), torch.arange(7, 1007)
    exchange = PrefetchedIds(
        {"items": ShardedIds("items", 1000, [1000], perm, [600, 400], [500, 500], _Done(shard_ids))}
    )
    context = StepContext({"items": torch.arange(1000)}, exchange)

    consumer = torch.cuda.Stream()  # the node orders this stream after its copies
    with torch.cuda.stream(consumer):
        with_ids = _Map(_reader(), lambda batch: LoaderItem(batch, context=context))
        item = next(iter(Loader(DeviceCopy(with_ids, "cuda", consumer_stream=consumer))))
        batch, moved = item.batch, item.context.exchange
        assert isinstance(moved, PrefetchedIds) and batch.uih_item_ids.is_cuda
        assert item.context.ids["items"].is_cuda
        sid = moved["items"]
        assert sid.perm.is_cuda and torch.equal(sid.perm.sort().values.cpu(), torch.arange(1000))
        assert torch.equal(sid.perm.cpu(), perm)
        assert any(t.is_cuda and torch.equal(t.cpu(), shard_ids) for t in moved.tensors())  # the result, copied
        got = sid.wait()
        assert got.is_cuda and torch.equal(got.cpu(), shard_ids)  # read on the stream that made it
    assert sid.send_splits == [600, 400] and sid.recv_splits == [500, 500]
