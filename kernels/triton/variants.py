"""How many variants of each Triton kernel this process compiled: a diagnostic the trainer reports (a run should
compile each kernel once per dtype and launch shape, not once per step). Apart from the kernels' shared helpers
(common.py), so that importing them never imports the kernels back."""

from __future__ import annotations


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each of this package's kernels in this process (all devices): a figure to check that
    a run compiled each kernel once per dtype and launch shape, not once per step. Empty where the Triton
    runtime keeps no per-device cache (the interpreter)."""
    from triton.runtime.jit import JITFunction

    from kernels.triton import triton_jagged_gather, triton_ranged, triton_segment

    out = {}
    for module in (triton_jagged_gather, triton_ranged, triton_segment):
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None) if isinstance(fn, JITFunction) else None
            if caches:
                out[name] = sum(len(cache[0]) for cache in caches.values())
    return out
