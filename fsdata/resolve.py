"""A user's function named on the command line or in TOML: ``module.path:function`` or ``path/to/file.py:function``.

``module.path:function`` is imported as ``python -m`` would find it: on ``sys.path`` with the current directory
first, so ``--partitioner examples.custom_partitioner:round_robin_longest`` works from the repository root with no
PYTHONPATH. ``path/to/file.py:function`` is a filesystem path (relative to the current directory, or absolute): the
file is loaded as a module of its own, registered in ``sys.modules`` under a name derived from its absolute path,
so the objects it defines pickle and a second load returns the same module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable


def is_file_spec(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _load_file(path_text: str, spec: str, what: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: no file {path}")
    name = f"_freescale_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what} {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(name: str, spec: str, what: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # as `python -m` does: the current directory first
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ValueError(
            f"{what} {spec!r}: cannot import module {name!r} (looked on sys.path, current directory "
            f"{cwd} first): {error}; or name a file: path/to/file.py:function"
        ) from error


def load_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    """The callable named by ``spec`` (either form above); ValueError naming ``what`` and what is missing."""
    module_part, sep, attribute = spec.rpartition(":")
    if not sep or not module_part or not attribute:
        raise ValueError(f"{what} {spec!r} must be written 'module.path:function' or 'path/to/file.py:function'")
    module = (
        _load_file(module_part, spec, what) if is_file_spec(module_part) else _import_module(module_part, spec, what)
    )
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            owner = getattr(target, "__name__", type(target).__name__)
            raise ValueError(f"{what} {spec!r}: {owner!r} has no attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {spec!r} is a {type(target).__name__}, not a callable")
    return target
