"""Public names renamed so that each word has one meaning keep answering for one release, each with a one-line
DeprecationWarning pointed at the caller's line: the packages' old names, and the ``stage=`` keyword of TrainStep,
predict, evaluate and unwrap_model (now ``wrap=``, what wrap_model returns)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fscomm
import fsembed
import pipelines

OLD_NAMES = [
    (pipelines, "StagedPipeline", "EmbeddingWrap"),
    (fscomm, "new_stage_group", "new_thread_group"),
    (fsembed, "StageTransports", "EmbeddingTransports"),
    (fsembed, "stage_transports", "embedding_transports"),
]


@pytest.mark.parametrize("package,old,new", OLD_NAMES, ids=[old for _, old, _ in OLD_NAMES])
def test_an_old_public_name_is_the_new_object_with_a_warning_naming_both(package, old, new):
    name = package.__name__
    with pytest.warns(DeprecationWarning) as caught:
        found = getattr(package, old)
    assert found is getattr(package, new)
    assert [str(w.message) for w in caught] == [
        f"{name}.{old} is deprecated and goes in the next release: use {name}.{new}"
    ]
    assert caught[0].filename == __file__  # the caller's line, not the package's


def test_new_names_are_exported_and_old_ones_are_not_listed():
    assert "EmbeddingWrap" in pipelines.__all__ and "StagedPipeline" not in pipelines.__all__
    assert "new_thread_group" in fscomm.__all__ and "new_stage_group" not in fscomm.__all__
    assert {"EmbeddingTransports", "embedding_transports"} <= set(fsembed.__all__)
    assert not {"StageTransports", "stage_transports"} & set(fsembed.__all__)
    with pytest.raises(AttributeError, match="module 'pipelines' has no attribute 'Staged'"):
        pipelines.Staged  # noqa: B018


class _Wrap:
    """Records what the step and the evaluation call on the wrap they are given (flush, begin_step)."""

    inputs = None
    features = None
    prioritized = False

    def __init__(self):
        self.calls = []
        self._hook = self._after_hook = self  # unwrap_model removes both hooks
        self.hub = "hub"

    def flush(self):
        self.calls.append("flush")

    def begin_step(self, context):
        self.calls.append("begin_step")

    def remove(self):
        self.calls.append("remove hook")


def _one_warning(caught) -> str:
    """The one renaming warning among ``caught`` (a first import of torchmetrics adds warnings of its own)."""
    ours = [w for w in caught if "goes in the next release" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is DeprecationWarning, [str(w.message) for w in caught]
    assert ours[0].filename == __file__, ours[0].filename  # pointed at this test's call
    return str(ours[0].message)


def test_train_step_takes_its_wrap_under_the_old_keyword_with_a_warning():
    wrap, model = _Wrap(), nn.Linear(2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = pipelines.TrainStep(model, None, torch.optim.SGD(model.parameters()), stage=wrap, rank=0, world_size=1)
    assert step.wrap is wrap
    assert _one_warning(caught) == (
        "TrainStep: stage= is deprecated and goes in the next release: pass wrap= (what wrap_model returns)"
    )


def test_predict_and_evaluate_take_the_old_keyword_with_a_warning_at_the_callers_line():
    wrap, model = _Wrap(), nn.Linear(2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = pipelines.predict(model, [], stage=wrap)
    assert rows.samples == 0 and wrap.calls == ["flush"]
    assert _one_warning(caught) == (
        "predict: stage= is deprecated and goes in the next release: pass wrap= (what wrap_model returns)"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pipelines.evaluate(model, [], stage=wrap, world_size=1)
    assert result.samples == 0 and wrap.calls == ["flush", "flush"]
    assert _one_warning(caught).startswith("evaluate: stage= is deprecated")


def test_unwrap_model_takes_the_old_keyword_with_a_warning(monkeypatch):
    import fsembed.swap

    unswapped = []
    monkeypatch.setattr(fsembed.swap, "unswap_embeddings", lambda model, hub, dst: unswapped.append((hub, dst)))
    wrap, model = _Wrap(), nn.Linear(2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pipelines.unwrap_model(model, stage=wrap, dst=None) is model
    assert unswapped == [("hub", None)] and wrap.calls == ["flush", "remove hook", "remove hook"]
    assert _one_warning(caught).startswith("unwrap_model: stage= is deprecated")


def test_both_keywords_at_once_or_no_wrap_to_unwrap_is_one_line():
    wrap, model = _Wrap(), nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"^TrainStep: give wrap= alone; stage= is its old name$"):
        pipelines.TrainStep(
            model, None, torch.optim.SGD(model.parameters()), wrap=wrap, stage=wrap, rank=0, world_size=1
        )
    with pytest.raises(ValueError, match=r"^predict: give wrap= alone; stage= is its old name$"):
        pipelines.predict(model, [], wrap=wrap, stage=wrap)
    with pytest.raises(
        ValueError, match=r"^unwrap_model: give the EmbeddingWrap that wrap_model returned for this model$"
    ):
        pipelines.unwrap_model(model)
