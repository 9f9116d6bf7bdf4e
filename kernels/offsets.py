"""Jagged offsets from lengths: the one prefix sum that the kernels' twins and the data types (fsdata.batch) share;
it lives here because kernels come first in the dependency order."""

from __future__ import annotations

from typing import Sequence, Union

import torch


def lengths_to_offsets(lengths: Union[torch.Tensor, Sequence[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[n] lengths (a tensor, or a host sequence such as an exchange's splits) -> [n+1] offsets of ``dtype`` from 0.
    The cumsum runs in int64 whatever ``dtype``, so int32 offsets cannot wrap before the cast."""
    lengths = lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(lengths, dtype=torch.int64)
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out.to(dtype)
