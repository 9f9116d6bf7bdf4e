"""Jagged attention through torch's FlexAttention, compiled (its eager form materialises the N^2 scores).

Packed tokens ``[N, heads, dim]`` are viewed as one sequence ``[1, heads, N, dim]``; the block mask (built from
the offsets, :mod:`kernels.flex.block_mask`) keeps each sample's attention inside the sample, so the kernels visit
only the blocks that hold a sample's pairs. Differentiable (FlexAttention's own backward) on CUDA.
"""

from __future__ import annotations

import functools

import torch

from kernels.flex.block_mask import JaggedBlockMask


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    # Shapes change with every batch: compile for dynamic sizes at once rather than recompile per batch.
    return torch.compile(flex_attention, dynamic=True)


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: JaggedBlockMask) -> torch.Tensor:
    out = _compiled()(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=mask.block_mask(),
    )
    return out.squeeze(0).transpose(0, 1)
