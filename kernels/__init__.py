"""kernels: the jagged ops the models use, laid out per implementation (triton/, pytorch/, varlen/, flex/), with
one dispatch point per op family that validates inputs once and picks an implementation by one vocabulary,
:class:`kernels.impl.Impl`:

- ``from kernels import ops``: the jagged data ops (indexed permute, ranged dispatch/combine, keyed transpose,
  segment sums, collision masks): a Triton kernel and a vectorized PyTorch twin each.
- ``kernels.attention``: the jagged attention (varlen FlashAttention, FlexAttention over block masks built from
  offsets, per-sample SDPA, padded SDPA).
- ``kernels.hstu``: the jagged HSTU attention (SiLU instead of softmax, targets, window, relative bias from
  positions and timestamps): a Triton kernel, its per-sample twin, the padded baseline.
"""
