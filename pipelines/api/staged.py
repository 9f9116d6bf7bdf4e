"""The old path of pipelines.api.wrap, kept only while pipelines.job still imports it from here."""

from pipelines.api.wrap import EARLY_START, EXCLUSIVE_START  # noqa: F401
