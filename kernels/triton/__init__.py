"""Triton versions of the jagged ops; imported lazily by kernels.ops so CPU-only users never import triton."""
