"""Names renamed so that each word has one meaning are gone, not aliased: the packages' old names raise
AttributeError, the old modules do not import, the modules' old names are not there, and TrainStep, predict,
evaluate and unwrap_model refuse the old ``stage=`` keyword."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import fscomm
import fsembed
import pipelines

OLD_NAMES = [
    (pipelines, "StagedPipeline"),
    (fscomm, "new_stage_group"),
    (fsembed, "StageTransports"),
    (fsembed, "stage_transports"),
    (fsembed, "EmbeddingHub"),
]


OLD_MODULES = [
    "pipelines.models.reference",
    "pipelines.models.torchrec_ref",
    "pipelines.job.run.schedule",
]

OLD_MODULE_NAMES = [
    ("pipelines.models.softmax", "SequenceModel"),
    ("pipelines.models.softmax", "ModelConfig"),
    ("pipelines.models.softmax", "MODEL_PRESETS"),
    ("pipelines.models.torchrec_baseline", "TorchrecReference"),
    ("pipelines.models.torchrec_baseline", "_TorchrecSequenceModel"),
    ("pipelines.models.torchrec_pec", "reference_target"),
    ("pipelines.job.checkpoint.export", "REFERENCE"),
    ("fscomm.pinned_pool", "StagingBuffer"),
    ("fscomm.shm", "_Plan.stage"),
    ("fsembed.transports", "EmbeddingTransports.staging_allocations"),
    ("fsembed.id_prefetch", "_SizedBatch"),
    ("fsembed.id_prefetch", "SIZES_KEY"),
    ("pipelines.job.run.record", "StepRecord.staging_allocations"),
]


@pytest.mark.parametrize("old", OLD_MODULES)
def test_an_old_module_is_gone(old):
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{old}'"):
        importlib.import_module(old)


@pytest.mark.parametrize("module,old", OLD_MODULE_NAMES, ids=[f"{module}.{old}" for module, old in OLD_MODULE_NAMES])
def test_an_old_module_name_is_gone(module, old):
    owner_path, _, name = old.rpartition(".")
    owner = importlib.import_module(module)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    assert not hasattr(owner, name)


@pytest.mark.parametrize("package,old", OLD_NAMES, ids=[old for _, old in OLD_NAMES])
def test_an_old_public_name_is_gone(package, old):
    with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute '{old}'"):
        getattr(package, old)
    assert old not in package.__all__


def test_the_old_stage_keyword_is_refused():
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="stage"):
        pipelines.TrainStep(model, None, torch.optim.SGD(model.parameters()), stage=None, rank=0, world_size=1)
    for function in (pipelines.predict, pipelines.evaluate):
        with pytest.raises(TypeError, match="stage"):
            function(model, [], stage=None)
    with pytest.raises(TypeError, match="stage"):
        pipelines.unwrap_model(model, stage=None)


def test_unwrap_model_without_a_wrap_is_one_line():
    with pytest.raises(
        ValueError, match=r"^unwrap_model: give the EmbeddingWrap that wrap_model returned for this model$"
    ):
        pipelines.unwrap_model(nn.Linear(2, 1))
