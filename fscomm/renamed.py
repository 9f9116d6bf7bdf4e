"""The one-release answer of a package to a name it renamed: the new object, with a DeprecationWarning pointed at
the caller's line (fscomm, fsembed and pipelines answer their old names so)."""

from __future__ import annotations

import warnings


def warn_renamed(package: str, old: str, new: str) -> None:
    """Called from the package's module ``__getattr__``: the warning points past it, at the caller's line."""
    warnings.warn(
        f"{package}.{old} is deprecated and goes in the next release: use {package}.{new}",
        DeprecationWarning,
        stacklevel=3,
    )
