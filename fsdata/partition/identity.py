"""The "none" partitioner: no balancing, every sample stays on its source rank in its local order.

The baseline of every comparison (TorchRec's behaviour): Stage III becomes a local no-op copy. It moves nothing,
so it cannot honour a memory budget: it ignores ``runtime.memory_budget``, and the callers that report tokens
(the simulator) report its tokens against the budget without refusing the plan (``honours_budget``).
"""

from __future__ import annotations

from fsdata.partition.base import GatheredLengths, Plan, RuntimeInfo


class IdentityPartitioner:
    name = "none"
    honours_budget = False  # the baseline: what an unbalanced step would hold, reported, never refused

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        return Plan.identity(lengths)

    def __repr__(self) -> str:
        return "IdentityPartitioner()"
