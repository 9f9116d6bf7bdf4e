"""FreeScale's top-level import names (``fsdata``, ``fsembed``, ``fscomm``, ``kernels``, ``pipelines``) next to
other installed distributions: ``kernels`` and ``pipelines`` are also names of distributions on PyPI. Where one of
those names resolves to another distribution's package instead of FreeScale's, FreeScale's imports of it would
fail obscurely (``cannot import name 'ops' from 'kernels'``): :func:`check_shadowed_names` says so in one line
instead, naming the other distribution. A source checkout on ``PYTHONPATH`` comes first on ``sys.path`` and is
found as FreeScale's own, so that way of running is unaffected.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

CLASHING_NAMES = ("kernels", "pipelines")
_checked = False


def _distribution_of(name: str, origin: Path) -> str:
    """``"<distribution> <version>"`` that installed the top-level ``name`` found at ``origin``, if known."""
    from importlib import metadata

    owners = metadata.packages_distributions().get(name, [])
    for dist_name in owners:
        if dist_name.lower() == "freescale":
            continue
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        files = [Path(dist.locate_file(f)).resolve() for f in (dist.files or ())]
        if any(origin == f or origin in f.parents for f in files) or not files:
            return f"{dist_name} {dist.version}"
    return f"{owners[0]}" if owners else "an unknown distribution"


def shadowed_names(root: Optional[Path] = None) -> list[str]:
    """One line per clashing name that does not resolve to FreeScale's own package beside ``root`` (the directory
    holding FreeScale's packages)."""
    root = (root or Path(__file__).resolve().parents[1]).resolve()
    lines = []
    for name in CLASHING_NAMES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            continue
        package_dir = Path(spec.origin).resolve().parent
        if package_dir == root / name:
            continue
        lines.append(
            f"freescale: the top-level module {name!r} is {package_dir}, installed by "
            f"{_distribution_of(name, package_dir)}, not FreeScale's (which installs '{name}' too): "
            f"uninstall one of them, or give FreeScale an environment of its own"
        )
    return lines


def check_shadowed_names() -> None:
    """Prints :func:`shadowed_names`' lines to stderr, once per process."""
    global _checked
    if _checked:
        return
    _checked = True
    for line in shadowed_names():
        print(line, file=sys.stderr)
