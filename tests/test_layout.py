"""The layout's rules, read from every library module's imports (top-level and inside functions alike): a package
imports only the packages below it (docs/architecture.md); no package imports or names the benchmarks, which live
beside the packages and out of the wheel; no function is longer than a screen."""

from __future__ import annotations

import ast
import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "fscomm", "fsdata", "fsembed", "pipelines")  # what the wheel installs
BENCHMARKS = "benchmarks"  # the benchmarks and research harnesses: a source checkout's only
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
    "pipelines.simulate",
]
TOP = {"pipelines.cli": 7, "pipelines.simulate": 7}  # both on top, neither imports the other
# A module named in a string, as the command table and the transport registry name theirs ("pkg.mod" or "pkg.mod:fn").
MODULE_PATH = re.compile(rf"{BENCHMARKS}(\.\w+)+(:\w+)?")


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


def _sources(*tops: str):
    for top in tops:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_import_runs_down_the_layers():
    wrong = []
    for path in _sources(*PACKAGES):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = _layer(module)
        if mine is None:  # pipelines/__init__.py: the public re-exports, by name
            continue
        for target in _imports(path):
            theirs = _layer(target)
            if theirs is not None and theirs > mine and not target.startswith(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(sorted(set(wrong)))


def test_the_checkpoints_import_nothing_of_the_launcher():
    """The launcher checks and uses the checkpoints (preflight, signals), so the checkpoints reach what they share
    with it (a rank's failure report) below both, never through it."""
    up = [
        f"{path.relative_to(ROOT)} imports {target}"
        for path in _sources("pipelines/job/checkpoint")
        for target in _imports(path)
        if target.startswith("pipelines.job.launch")
    ]
    assert not up, "\n".join(sorted(set(up)))


MAX_FUNCTION_LINES = 80


def test_no_library_function_is_longer_than_a_screen_unless_its_docstring_says_why():
    long = []
    for path in _sources(*PACKAGES, BENCHMARKS):
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


def test_no_package_imports_or_names_a_benchmark():
    wrong = []
    for path in _sources(*PACKAGES):
        where = path.relative_to(ROOT)
        wrong += [f"{where} imports {t}" for t in _imports(path) if t == BENCHMARKS or t.startswith(BENCHMARKS + ".")]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
                wrong.append(f"{where}:{node.lineno} names {node.value!r}")
    assert not wrong, "the installed packages reach into benchmarks/, which the wheel leaves out:\n" + "\n".join(wrong)


def test_the_wheel_takes_every_package_and_leaves_the_benchmarks_out():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    taken = lambda name: any(fnmatch.fnmatchcase(name, pattern) for pattern in include)
    assert all(taken(p) and taken(f"{p}.sub") for p in PACKAGES), include
    assert not taken(BENCHMARKS) and not taken(f"{BENCHMARKS}.kernels"), include
    assert (ROOT / BENCHMARKS / "__main__.py").is_file()  # run from the checkout: python -m benchmarks NAME
