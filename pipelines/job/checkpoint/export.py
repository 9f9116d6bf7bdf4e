"""What ``freescale train --export PATH`` writes, and how a fresh process gets the model back.

PATH holds the trained model's own ``state_dict`` (``torch.save``, after ``unwrap_model``: the user's modules
with the trained tables, the keys of the model's class). Beside it, ``PATH.json`` says what built the model:

    {"format": "freescale-export", "version": 1, "model": "pipelines.models.softmax:SoftmaxModel",
     "config": {"num_items": 20000, "dim": 32, ...}}

For the built-in models (the softmax model, the HSTU model) ``config`` is the model's whole config dataclass,
so ``load_export(PATH)`` rebuilds it and loads the weights, with no job config and no data. For a model of a
user's factory (``--model module:function``) ``model`` names the factory and ``config`` is null: the factory's
arguments are the whole job, so the model comes back through the user's own class,
``MyModel(...).load_state_dict(torch.load(PATH))``. Loading runs no
code: the state dict is read with ``weights_only=True`` and the description names a class, never imports one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from pipelines.api.step import unwrap_model
from pipelines.models.hstu import HSTUConfig, HSTUModel
from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

FORMAT = "freescale-export"
VERSION = 1
SOFTMAX_MODEL = "pipelines.models.softmax:SoftmaxModel"
#: The models load_export rebuilds from their config alone: description name -> (class, config class).
BUILT_IN: dict[str, tuple[type, type]] = {
    SOFTMAX_MODEL: (SoftmaxModel, SoftmaxConfig),
    "pipelines.models.hstu:HSTUModel": (HSTUModel, HSTUConfig),
}
DESCRIPTION_SUFFIX = ".json"


def description_path(path: Union[str, Path]) -> Path:
    """The JSON that describes the export at ``path``: ``model.pt`` -> ``model.pt.json``."""
    return Path(str(path) + DESCRIPTION_SUFFIX)


def describe(model: nn.Module, factory: str) -> dict[str, Any]:
    """The description of ``model``: a built-in model by its whole config, any other by the factory that built it
    (``--model``)."""
    for name, (cls, _) in BUILT_IN.items():
        if type(model) is cls:
            return {"format": FORMAT, "version": VERSION, "model": name, "config": asdict(model.config)}
    return {"format": FORMAT, "version": VERSION, "model": factory, "config": None}


def export_trained(model: nn.Module, wrap: Any, path: Optional[str], factory: str, rank: int) -> None:
    """``--export PATH`` at the end of a run, on every rank (the tables are gathered to rank 0): the user's own
    modules back with the trained tables (mode torchrec refuses --export: pipelines.job.config.sections),
    written by rank 0 with PATH.json beside it (what built the model: load_export). Nothing without ``path``."""
    if not path:
        return
    if wrap is not None:
        unwrap_model(model, wrap, dst=0)
    if rank == 0:
        save_export(model, path, factory)


def save_export(model: nn.Module, path: Union[str, Path], factory: str) -> Path:
    """Writes ``model``'s state dict to ``path`` and its description beside it; returns the description's path.
    Called on the one rank that holds the gathered tables (``unwrap_model(..., dst=rank)``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    described = description_path(path)
    described.write_text(json.dumps(describe(model, factory), indent=2) + "\n")
    return described


def _description(path: Path) -> dict[str, Any]:
    described = description_path(path)
    own_class = f"load it into your own model's class: MyModel(...).load_state_dict(torch.load('{path}'))"
    if not described.is_file():
        raise ValueError(
            f"{path}: no {described.name} beside it, which `freescale train --export` writes to say what built "
            f"the model; for a state dict of your own model, {own_class}"
        )
    try:
        description = json.loads(described.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{described}: not valid JSON ({e})") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise ValueError(f'{described}: not a FreeScale export description (it lacks "format": "{FORMAT}")')
    if description.get("version") != VERSION:
        raise ValueError(f"{described}: export version {description.get('version')!r}; this FreeScale reads {VERSION}")
    if description.get("model") not in BUILT_IN:
        raise ValueError(
            f"{path}: exported from the model factory {description.get('model')!r}, which load_export does not "
            f"run; {own_class}"
        )
    return description


def _state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load's unpickler raises many types, all meaning the file is not a state dict
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path}: not a readable state dict (truncated, or not written by torch.save?): {first}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    return state


def load_export(path: Union[str, Path]) -> nn.Module:
    """The model a ``freescale train --export PATH`` of a built-in model (softmax or HSTU) saved, rebuilt from
    ``PATH.json`` with the trained weights, on the CPU and in eval mode (``.to(device)``, ``.train()`` as
    needed). A user's own model comes back through its class instead (the error says so)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such export file")
    description = _description(path)
    described = description_path(path)
    cls, config_cls = BUILT_IN[description["model"]]
    try:
        model = cls(config_cls(**description.get("config") or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{described}: its config does not describe a {cls.__name__}: {e}") from None
    state, expected = _state(path), model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshapen = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or misshapen:
        shapes = [f"{k} {tuple(state[k].shape)} for {tuple(expected[k].shape)}" for k in misshapen[:3]]
        raise ValueError(
            f"{path}: its tensors do not fit the model {described.name} describes (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, shapes {shapes})"
        )
    model.load_state_dict(state)
    return model.eval()
