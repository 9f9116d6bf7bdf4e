"""The vectorized binary search the Triton kernels share."""

import triton
import triton.language as tl


@triton.jit
def last_le(sorted_ptr, keys, mask, size, steps):
    """Per lane: the largest p in [0, size-1] with sorted[p] <= key (0 if none), in ``steps`` =
    ceil(log2(size)) iterations (``common.search_steps``). ``keys``: int64 lanes; ``sorted``: ascending, int32
    or int64; masked lanes read nothing."""
    lo = keys * 0
    hi = lo + (size - 1)
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        right = tl.load(sorted_ptr + mid, mask=mask, other=0).to(tl.int64) <= keys
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    return lo
