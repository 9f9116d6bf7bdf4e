"""The layout's one rule: a package imports only the packages below it (docs/architecture.md), read from every
library module's imports (top-level and inside functions alike)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first; a module may import its own layer and the ones before it.
LAYERS = [
    "kernels",
    "fscomm",
    "fsdata",
    "fsembed",
    "pipelines.models",
    "pipelines.api",
    "pipelines.job",
    "pipelines.cli",
    "pipelines.research",
]
TOP = {"pipelines.cli": 7, "pipelines.research": 7}  # both on top, neither imports the other


def _layer(module: str) -> int | None:
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return TOP.get(name, LAYERS.index(name))
    return None


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_every_import_runs_down_the_layers():
    wrong = []
    for top in ("kernels", "fscomm", "fsdata", "fsembed", "pipelines"):
        for path in (ROOT / top).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mine = _layer(module)
            if mine is None:  # pipelines/__init__.py: the public re-exports, by name
                continue
            for target in _imports(path):
                theirs = _layer(target)
                if theirs is not None and theirs > mine and not target.startswith(module):
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(sorted(set(wrong)))


MAX_FUNCTION_LINES = 80


def test_no_library_function_is_longer_than_a_screen_unless_its_docstring_says_why():
    long = []
    for top in ("kernels", "fscomm", "fsdata", "fsembed", "pipelines"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and "One function on purpose:" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines: split them, or say why in the docstring "
        "('One function on purpose: ...'):\n" + "\n".join(long)
    )
