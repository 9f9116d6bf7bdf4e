"""fscomm: the Transport protocol and its backends (host-staged SM-free, NCCL, NCCL copy-engine, RDMA ring)."""
