"""The old path of fsdata.balance_measures, kept only while pipelines.job still imports it from here."""

from fsdata.balance_measures import imbalance, sparsity  # noqa: F401
