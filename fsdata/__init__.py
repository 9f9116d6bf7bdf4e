"""fsdata: the sample and batch types, sources (Parquet, synthetic), loader stages and balance measures.

The loader and its stages need torchdata; they load on first use, so the types import where it is absent.
"""

from __future__ import annotations

import importlib
from typing import Any

from fsdata.install_names import check_shadowed_names

check_shadowed_names()  # before anything imports `kernels`: a clash is named in one line, not an obscure failure

from fsdata.batch import Batch, Jagged, Sample  # noqa: E402, F401  (re-exported: __all__)
from fsdata.item import LoaderItem  # noqa: E402, F401
from fsdata.source import SampleSource  # noqa: E402, F401

_LAZY = {
    "LoaderConfig": "fsdata.loader",
    "build_loader": "fsdata.loader",
    "release_loader": "fsdata.loader",
    "shutdown_loader": "fsdata.loader",
    "BalancerConfig": "fsdata.balancer",
    "balancer_stages": "fsdata.balancer",
    "ParquetSource": "fsdata.parquet",
    "SyntheticConfig": "fsdata.synthetic",
    "SyntheticSource": "fsdata.synthetic",
}

__all__ = sorted(["Batch", "Jagged", "LoaderItem", "Sample", "SampleSource", *_LAZY])


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fsdata' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
