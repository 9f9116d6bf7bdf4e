"""The stage worker's copy to the GPU: the batches arrive on the device equal to the loader's, with the stream
order the step needs, and the loader resumes exactly through it. Needs a CUDA device."""

from __future__ import annotations

import pytest
import torch
from torchdata.nodes import BaseNode, Loader

from fsdata.batch import Batch
from fsdata.nodes.background import Background
from fsdata.nodes.device_copy import DeviceCopy, DeviceReady
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from tests.stateful import run_test_save_load_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _reader():
    return GlobalBatchReader(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=40, seed=3)), 4, 0, 1)


class _Consume(BaseNode):
    """What the trainer does with an item: wait for the copies, use the batch (here: bring it back)."""

    def __init__(self, source):
        super().__init__()
        self.source = source

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        batch, ready = next(self.source)
        assert isinstance(ready, DeviceReady) and all(t.is_cuda for t in batch.tensors().values())
        ready.wait()
        return batch.to("cpu")

    def get_state(self):
        return self.source.state_dict()


def test_batches_arrive_equal_on_the_device():
    expected = list(Loader(_reader()))
    got = list(Loader(_Consume(Background(DeviceCopy(_reader(), "cuda")))))
    assert len(got) == len(expected) and all(isinstance(b, Batch) and b.equals(e) for b, e in zip(got, expected))


def test_device_copy_resumes_exactly():
    run_test_save_load_state(lambda: Loader(_Consume(Background(DeviceCopy(_reader(), "cuda")))), midpoint=4)



def test_a_cpu_loaders_state_resumes_through_the_copy():
    cpu = Loader(Background(_reader()))
    it = iter(cpu)
    for _ in range(3):
        next(it)
    state, rest = cpu.state_dict(), list(it)
    gpu = Loader(_Consume(Background(DeviceCopy(_reader(), "cuda"))))
    gpu.load_state_dict(state)
    got = list(gpu)
    assert len(got) == len(rest) and all(b.equals(e) for b, e in zip(got, rest))
