"""PyTorch twins of the jagged kernels: the CPU path and what the Triton kernels are tested against.
Each twin is a handful of whole-tensor ops, except the jagged attention's, which runs one fused SDPA per sample
(a whole-batch masked version would hold N^2 scores)."""
