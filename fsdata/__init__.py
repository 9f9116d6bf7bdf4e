"""fsdata: the sample and batch types, sources (Parquet, synthetic), loader stages and data metrics."""

from fsdata.batch import Batch, Sample

__all__ = ["Batch", "Sample"]
