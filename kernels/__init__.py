"""kernels: jagged ops, each a dispatcher over a Triton kernel and a vectorized PyTorch twin.

Public entry point: ``from kernels import ops`` (see kernels/ops.py); ``ops.Impl`` picks an implementation. The jagged attention
(FlexAttention over a block mask built from offsets, or per-sample SDPA) has its own: ``kernels.attention``.
"""
