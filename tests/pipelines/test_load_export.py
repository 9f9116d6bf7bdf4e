"""The export's description (pipelines.job.checkpoint.export): the softmax model comes back from its file alone with
same logits bit for bit; a user's model, a missing or foreign description and tensors of another shape are one
line naming the file and what to do. The round trip through `freescale train --export` is in test_export.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fsdata.synthetic import SyntheticConfig, SyntheticSource
from pipelines import load_export
from pipelines.job.checkpoint.export import SOFTMAX_MODEL, description_path, save_export
from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

CONFIG = SoftmaxConfig(num_items=300, dim=16, num_heads=2, num_labels=2, dense_dim=4, max_uih=32)


def _probe():
    return SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=12, num_labels=2, uih_max=32)).read(0, 0, 12)


def _trained(seed: int = 3) -> SoftmaxModel:
    torch.manual_seed(seed)
    return SoftmaxModel(CONFIG).eval()


def test_the_softmax_model_comes_back_from_its_file_alone(tmp_path):
    model = _trained()
    described = save_export(model, tmp_path / "model.pt", "tiny")
    assert described == tmp_path / "model.pt.json" == description_path(tmp_path / "model.pt")
    assert json.loads(described.read_text()) == {
        "format": "freescale-export",
        "version": 1,
        "model": SOFTMAX_MODEL,
        "config": {**CONFIG.__dict__},
    }
    loaded = load_export(tmp_path / "model.pt")
    assert not loaded.training and loaded.config == CONFIG
    with torch.no_grad():
        assert torch.equal(loaded(_probe()), model(_probe()))


def test_the_hstu_model_comes_back_from_its_file_alone(tmp_path):
    from pipelines.models.hstu import HSTUConfig, HSTUModel

    config = HSTUConfig(num_items=50, dim=16, num_layers=1, num_heads=2, head_dim=8, max_uih=16, dense_dim=4)
    torch.manual_seed(5)
    model = HSTUModel(config).eval()
    with torch.no_grad():  # rab weights away from their zero start, so that loading them is checked too
        for layer in model.layers:
            layer.position_weights.normal_()
    described = save_export(model, tmp_path / "hstu.pt", "hstu")
    assert json.loads(described.read_text())["model"] == "pipelines.models.hstu:HSTUModel"
    loaded = load_export(tmp_path / "hstu.pt")
    assert isinstance(loaded, HSTUModel) and loaded.config == config and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(_probe()), model(_probe()))


class Mine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(10, 4)


def test_a_users_model_is_named_with_the_way_back_through_its_class(tmp_path):
    path = tmp_path / "model.pt"
    save_export(Mine(), path, "my_model.py:build")
    assert json.loads(description_path(path).read_text())["model"] == "my_model.py:build"
    with pytest.raises(ValueError) as e:
        load_export(path)
    assert str(e.value) == (
        f"{path}: exported from the model factory 'my_model.py:build', which load_export does not run; load it "
        f"into your own model's class: MyModel(...).load_state_dict(torch.load('{path}'))"
    )
    Mine().load_state_dict(torch.load(path, weights_only=True))  # the way the line names


def test_a_state_dict_without_its_description_is_one_line(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(_trained().state_dict(), path)
    with pytest.raises(ValueError) as e:
        load_export(path)
    assert str(e.value) == (
        f"{path}: no model.pt.json beside it, which `freescale train --export` writes to say what built the "
        f"model; for a state dict of your own model, load it into your own model's class: "
        f"MyModel(...).load_state_dict(torch.load('{path}'))"
    )
    with pytest.raises(FileNotFoundError, match="nosuch.pt: no such export file"):
        load_export(tmp_path / "nosuch.pt")


def test_a_foreign_description_or_tensors_of_another_shape_are_one_line(tmp_path):
    path = tmp_path / "model.pt"
    save_export(_trained(), path, "tiny")
    described = description_path(path)
    good = json.loads(described.read_text())
    described.write_text('{"model": "x"}')
    with pytest.raises(ValueError, match='model.pt.json: not a FreeScale export description .it lacks "format"'):
        load_export(path)
    described.write_text(json.dumps({**good, "config": {**good["config"], "dim": 32}}))
    with pytest.raises(ValueError) as e:
        load_export(path)
    assert str(e.value).startswith(f"{path}: its tensors do not fit the model model.pt.json describes (missing [], ")
    assert "shapes ['item_embedding.weight (300, 16) for (300, 32)'" in str(e.value) and "\n" not in str(e.value)
    described.write_text(json.dumps({**good, "config": {**good["config"], "heads": 2}}))
    with pytest.raises(ValueError, match="model.pt.json: its config does not describe a SoftmaxModel: .*heads"):
        load_export(path)
    described.write_text(json.dumps(good))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.pt: not a readable state dict .truncated, or not written by torch"):
        load_export(path)
