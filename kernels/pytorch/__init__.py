"""Vectorized PyTorch twins of the jagged kernels: the CPU path and the reference the Triton kernels are tested
against. No per-sample Python loops: each twin is a handful of whole-tensor ops."""
