"""Loader stages, each a torchdata.nodes BaseNode that wraps the one before it."""

from fsdata.nodes.reader import GlobalBatchReader

__all__ = ["GlobalBatchReader"]
