"""Partitioners of the sequence load balancer (Algorithm 1's P): gathered lengths + runtime info -> plan.

    from fsdata.partition import get_partitioner, GatheredLengths, RuntimeInfo, Plan
    plan = get_partitioner("fbs")(lengths, RuntimeInfo(step=i))

Built in: "none" (identity), "fbs", "vbs" (+ :class:`AutoTune`), "kk"; anything else is read as
"module:function" (see custom.py). ``RuntimeInfo(memory_budget=MemoryBudget(tokens))`` caps every rank's kept
tokens (budget.py); the built-ins (not "none") meet any budget >= ``guaranteed_tokens``. See docs/balancer.md
for the algorithms, their bounds and measured speed.
"""

from __future__ import annotations

from typing import Any, Optional

from fsdata.partition.agreement import PlanAgreement, partitioner_name
from fsdata.partition.base import (
    GatheredLengths,
    Partitioner,
    PartitionerError,
    PeerPartitionerError,
    Plan,
    RuntimeInfo,
)
from fsdata.partition.budget import BudgetSpec, MemoryBudget, MemoryModel, guaranteed_tokens, kept_tokens
from fsdata.partition.cost import CostModel, OnlineCostFit, rank_features
from fsdata.partition.custom import CustomPartitioner
from fsdata.partition.fbs import FBSPartitioner
from fsdata.partition.gate import BalanceGate
from fsdata.partition.identity import IdentityPartitioner
from fsdata.partition.kk import KKPartitioner
from fsdata.partition.vbs import AutoTune, VBSPartitioner

BUILTIN = {"none": IdentityPartitioner, "fbs": FBSPartitioner, "vbs": VBSPartitioner, "kk": KKPartitioner}


def get_partitioner(
    name: str, *, alpha: Optional[float] = None, cost_model: Optional[CostModel] = None, **kwargs: Any
) -> Partitioner:
    """The partitioner called ``name``: a built-in name or ``"module:function"``.

    ``alpha`` (or a whole ``cost_model``) sets the cost of the cost-based partitioners; other keyword arguments go
    to the partitioner's constructor (built-ins) or to every call of the user's function (custom).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"partitioner name must be a non-empty string, got {name!r}")
    if alpha is not None:
        if cost_model is not None:
            raise ValueError("give either alpha or cost_model, not both")
        cost_model = CostModel(alpha=float(alpha))
    key = name.lower()
    if key == "none":
        if kwargs:
            raise ValueError(f"partitioner 'none' takes no options, got {sorted(kwargs)}")
        return IdentityPartitioner()
    if key in BUILTIN:
        try:
            return BUILTIN[key](cost_model=cost_model, **kwargs)
        except TypeError as error:
            raise ValueError(f"partitioner {key!r}: bad options {sorted(kwargs)}: {error}") from error
    if ":" in name:
        if cost_model is not None:
            kwargs["cost_model"] = cost_model
        return CustomPartitioner(name, **kwargs)
    raise ValueError(f"unknown partitioner {name!r}: use one of {sorted(BUILTIN)} or 'module:function'")


__all__ = [
    "AutoTune",
    "BalanceGate",
    "BudgetSpec",
    "CostModel",
    "CustomPartitioner",
    "FBSPartitioner",
    "GatheredLengths",
    "IdentityPartitioner",
    "KKPartitioner",
    "MemoryBudget",
    "MemoryModel",
    "OnlineCostFit",
    "Partitioner",
    "PartitionerError",
    "PeerPartitionerError",
    "Plan",
    "PlanAgreement",
    "RuntimeInfo",
    "VBSPartitioner",
    "get_partitioner",
    "guaranteed_tokens",
    "kept_tokens",
    "partitioner_name",
    "rank_features",
]
