"""FlexAttention's numbers from a cold and from a warm compile cache, one process per call (run as a script).

``python -m tests.kernels.flex_cache_probe warm``  compiles the kernel the way the other GPU work does (lengths
that fill whole 128-row blocks and lengths that do not, fp32 and bf16, deterministic algorithms on and off), so the
compile caches under ``TORCHINDUCTOR_CACHE_DIR`` hold what a machine that ran the benches holds.
``python -m tests.kernels.flex_cache_probe check OUT.pt``  runs the GPU tests' shapes forward and backward and
saves the outputs and gradients; two ``check`` runs against one cache directory, before and after ``warm``, must
give the same bits (tests/kernels/test_attention_gpu.py compares them).
"""

from __future__ import annotations

import sys

import torch

from kernels.attention import jagged_attention

# (heads, dim, dtype, lengths) as tests/kernels/test_attention_gpu.py and the deterministic test run them
CHECK_CASES = [
    (2, 16, torch.float32, [1]),
    (2, 16, torch.float32, [300]),
    (2, 16, torch.float32, [5, 700, 1, 0, 129, 128, 256]),
    (2, 16, torch.bfloat16, [5, 700, 1, 0, 129, 128, 256]),
    (4, 64, torch.bfloat16, [700, 3, 1500, 64]),
]
# what the benches and the deterministic runs compile: whole blocks (N % 128 == 0) and ragged ends
WARM_CASES = [
    (heads, dim, dtype, lengths)
    for heads, dim in ((2, 16), (4, 64))
    for dtype in (torch.float32, torch.bfloat16)
    for lengths in ([128] * 4, [4096] * 2, [256, 128, 640], [1000, 37, 2048], [384])
]


def _run(heads: int, dim: int, dtype: torch.dtype, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    n = int(offsets[-1])
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, heads, dim, generator=gen).to("cuda", dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(n, heads, dim, generator=gen).to("cuda", dtype)
    out = jagged_attention(q, k, v, offsets, causal=True, impl="flex")
    out.backward(grad)
    return [out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()]


def warm() -> None:
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        for case in WARM_CASES:
            _run(*case)
    torch.cuda.synchronize()


def check(path: str) -> None:
    torch.save([_run(*case) for case in CHECK_CASES], path)


if __name__ == "__main__":
    if sys.argv[1] == "warm":
        warm()
    elif sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.kernels.flex_cache_probe warm | check OUT.pt")
