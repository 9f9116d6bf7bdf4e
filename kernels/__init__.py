"""kernels: jagged ops, each a dispatcher over a Triton kernel and a vectorized PyTorch twin."""
