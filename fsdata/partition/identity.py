"""The "none" partitioner: no balancing, every sample stays on its source rank in its local order.

The baseline of every comparison (TorchRec's behaviour): Stage III becomes a local no-op copy.
"""

from __future__ import annotations

from fsdata.partition.base import GatheredLengths, Plan, RuntimeInfo


class IdentityPartitioner:
    name = "none"

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        return Plan.identity(lengths)

    def __repr__(self) -> str:
        return "IdentityPartitioner()"
