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
    # Inductor's deterministic mode: the kernels it generates around the attention (the backward's row sums of
    # out * grad among them) take one configuration chosen by rule instead of the fastest of several timed at their
    # first launch. Timed choices differ from process to process with the machine's load, and the compile cache
    # keeps the first process's choice for every later one, so a reduction's order (and the gradients' last bits)
    # depended on which run had filled the cache; by rule, every process, cold or warm, runs the same kernels.
    return torch.compile(flex_attention, dynamic=True, options={"deterministic": True})


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: JaggedBlockMask) -> torch.Tensor:
    out = _compiled()(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=mask.block_mask(),
    )
    return out.squeeze(0).transpose(0, 1)
