"""Precision and the deterministic mode (pipelines.api.numerics): the autocast dtype per device, the mode's set-up, and
the refusal of a model whose attention kernel would not be reproducible. The GPU end-to-end check:
test_deterministic_gpu.py."""

from __future__ import annotations

import pytest
import torch

from pipelines.api import numerics
from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu():
    assert numerics.autocast_dtype("auto", CUDA) is torch.bfloat16 and numerics.autocast_dtype("auto", CPU) is None
    assert numerics.autocast_dtype("bf16", CPU) is torch.bfloat16 and numerics.autocast_dtype("fp32", CUDA) is None
    with pytest.raises(ValueError, match="--precision"):
        numerics.autocast_dtype("fp8", CPU)


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_the_deterministic_mode_sets_the_flag_and_the_cublas_workspace(restore_determinism, monkeypatch):
    model = SoftmaxModel(SoftmaxConfig(num_items=10, dim=32, num_heads=2, max_uih=8))
    with pytest.raises(ValueError, match="deterministic algorithms are off"):
        numerics.check_determinism(model, CPU)
    numerics.enable_determinism()
    assert torch.are_deterministic_algorithms_enabled()
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in numerics.CUBLAS_WORKSPACES
    numerics.check_determinism(model, CPU)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG=':0:0'"):
        numerics.enable_determinism()


def test_a_kernel_that_is_not_reproducible_as_set_up_is_refused(restore_determinism, monkeypatch):
    """On CUDA, varlen's backward is reproducible only under the deterministic algorithms; FlexAttention always."""
    from kernels.attention import is_deterministic
    from kernels.impl import Impl

    varlen = SoftmaxModel(SoftmaxConfig(num_items=10, dim=32, num_heads=2, max_uih=8, attention_impl="varlen"))
    assert is_deterministic(Impl.FLEX, CUDA) and is_deterministic(Impl.TORCH, CPU)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", numerics.CUBLAS_WORKSPACES[0])
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    numerics.check_determinism(varlen, CUDA)  # the flag on: varlen's deterministic backward
    monkeypatch.setattr(numerics, "is_deterministic", lambda impl, device: impl is Impl.FLEX)
    with pytest.raises(ValueError, match="attention kernel 'varlen' is not reproducible"):
        numerics.check_determinism(varlen, CUDA)


def test_the_deterministic_job_picks_flex_for_the_softmax_model():
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from pipelines.job.builders import build_model_spec
    from pipelines.job.config.sections import JobConfig

    source = SyntheticSource(SyntheticConfig(num_samples=4))
    config = JobConfig()
    assert build_model_spec(config, source).plan is None  # varlen on CUDA: no plan stage
    config.run.deterministic = True
    spec = build_model_spec(config, source)
    assert spec.model.config.attention_impl == "flex" and spec.plan is not None
