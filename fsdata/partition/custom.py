"""A user's own partitioner, named as ``"module.path:function"`` or ``"path/to/file.py:function"`` (``--partitioner``).

The callable has the partitioner signature ``fn(lengths: GatheredLengths, runtime: RuntimeInfo, **kwargs)`` and
returns one of

- a :class:`Plan`;
- a pair ``(order, dest_offsets)`` (the two fields of a Plan);
- a 1-D integer array of length G: the destination rank of every global sample (each rank then receives its
  samples in ascending global index).

Whatever it returns is checked on every call (exactly once, offsets consistent, ranks in range, and no rank over
``runtime.memory_budget`` when there is one), and a failure names the callable, because a wrong plan would
otherwise surface much later as lost or duplicated samples, or as one rank out of memory.
The callable must be deterministic: every rank calls it on the same inputs and must get the same plan (the
partition stage compares the ranks' plans each step and names the partitioner when they differ, and names it
with the step when it raises: fsdata.partition.agreement).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from fsdata.partition.base import GatheredLengths, PartitionerError, Plan, RuntimeInfo


def load_callable(spec: str) -> Callable[..., Any]:
    """Imports ``"module.path:function"`` or loads ``"path/to/file.py:function"`` (fsdata.resolve)."""
    from fsdata.resolve import load_callable as load

    return load(spec, "custom partitioner")


class CustomPartitioner:
    """Wraps a user callable and validates its result."""

    def __init__(self, spec: str, **kwargs: Any) -> None:
        self.spec = spec
        self.fn = load_callable(spec)
        self.kwargs = kwargs
        self.name = spec

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan:
        result = self.fn(lengths, runtime, **self.kwargs)
        who = f"custom partitioner {self.spec!r} at step {runtime.step}"
        try:
            plan = self._to_plan(result, lengths, who)
            plan.validate(
                lengths.num_samples, lengths.world_size, who=who, lengths=lengths, budget=runtime.memory_budget
            )
        except ValueError as error:  # every message names the callable already; the type says whose fault it is
            raise error if isinstance(error, PartitionerError) else PartitionerError(str(error)) from error
        return plan

    def _to_plan(self, result: Any, lengths: GatheredLengths, who: str) -> Plan:
        if isinstance(result, Plan):
            return result
        if isinstance(result, tuple) and len(result) == 2:
            try:
                return Plan(*result)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{who} returned a pair that is not (order, dest_offsets): {error}") from error
        if isinstance(result, (torch.Tensor, np.ndarray, list)):
            dest = np.asarray(result.cpu() if isinstance(result, torch.Tensor) else result)
            if dest.ndim != 1 or dest.size != lengths.num_samples or not np.issubdtype(dest.dtype, np.integer):
                raise ValueError(
                    f"{who} returned an array of shape {dest.shape} and dtype {dest.dtype}; a destination array must be"
                    f" 1-D integer with one rank per sample (G={lengths.num_samples})"
                )
            try:
                return Plan.from_destinations(dest, lengths.world_size)
            except ValueError as error:
                raise ValueError(f"{who}: {error}") from error
        raise ValueError(
            f"{who} returned {type(result).__name__}; expected a Plan, an (order, dest_offsets) pair or a"
            " destination-rank array"
        )

    def __repr__(self) -> str:
        return f"CustomPartitioner({self.spec!r})"
