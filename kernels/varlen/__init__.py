"""Jagged attention through PyTorch's variable-length FlashAttention (``torch.nn.attention.varlen``).
Imported lazily by kernels.attention; CUDA only."""
