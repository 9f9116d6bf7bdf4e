"""Loader stages, each a torchdata.nodes BaseNode that wraps the one before it (see fsdata.loader)."""

from fsdata.nodes.async_stage import AsyncStage
from fsdata.nodes.background import Background
from fsdata.nodes.gather_lengths import GatherCandidateLengths, GatherLengths, StepFeedback
from fsdata.nodes.partition_stage import PartitionStage
from fsdata.nodes.reader import GlobalBatchReader
from fsdata.nodes.shuffle import ShuffleSamples

__all__ = [
    "AsyncStage",
    "Background",
    "GatherCandidateLengths",
    "GatherLengths",
    "GlobalBatchReader",
    "PartitionStage",
    "ShuffleSamples",
    "StepFeedback",
]
