"""Helpers shared by the Triton kernels: bit-level views (a copy kernel needs no arithmetic on the values, so
any dtype travels as an integer of its width) and launch-size arithmetic."""

from __future__ import annotations

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Tests set this so that every output buffer starts as 0xFF bytes (NaN for floats, -1 for integers, an invalid
# byte for bools): an element a kernel forgot to write then fails the comparison instead of passing by luck.
POISON_OUTPUTS = False


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised output buffer (poisoned when POISON_OUTPUTS is set)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if POISON_OUTPUTS and out.numel():
        out.view(torch.uint8).fill_(0xFF)
    return out


def as_bits(values: torch.Tensor) -> torch.Tensor:
    """Contiguous [N, D] integer view of ``values`` [N, *] with the same bytes (bool, bf16, fp32, int64 ...)."""
    flat = values.contiguous().reshape(values.shape[0], flat_width(values))
    width = flat.element_size()
    if width not in _INT_OF_WIDTH:
        raise ValueError(f"kernels: values of dtype {values.dtype} ({width}-byte elements) are not supported")
    return flat.view(_INT_OF_WIDTH[width])


def flat_width(values: torch.Tensor) -> int:
    """Elements per row of ``values`` [N, *] (1 for 1-D values)."""
    width = 1
    for size in values.shape[1:]:
        width *= int(size)
    return width


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def search_steps(size: int) -> int:
    """Binary-search iterations that narrow ``size`` candidates to one: ceil(log2(size))."""
    return max(0, int(size) - 1).bit_length()


def tile_shape(width: int, elements_per_program: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) for copying rows of ``width`` elements: whole rows (up to 256 columns) per tile,
    about ``elements_per_program`` elements per program."""
    block_d = min(next_power_of_2(max(width, 1)), 256)
    block_r = max(1, elements_per_program // block_d)
    return block_r, block_d


def fixed_code(*sizes: str) -> dict:
    """``triton.jit`` options for arguments that change every step (element counts, search depths).

    Triton compiles a variant per value class of an integer argument (equal to 1, divisible by 16, other): a
    size that varies per step would compile a new variant mid-training, tens to hundreds of milliseconds on one
    rank, which every other rank then waits for at the next collective. These sizes only bound loops and masks,
    so one compiled kernel serves them all."""
    return {"do_not_specialize": sizes, "do_not_specialize_on_alignment": sizes}
