"""Transports that have not yet run on the hardware they are written for: ``peer`` (copy-engine copies between
GPUs of one host over CUDA IPC) and ``nccl-ce`` (NCCL's zero-CTA copy-engine collectives). ``--transport`` does not
offer them; ``fscomm.get_transport`` reaches them by name (fscomm.transport.EXPERIMENTAL_BACKENDS) for the
benchmarks and their tests. One moves out of here once it has run on two GPUs or more and its figures are in
BENCHMARKS.md."""
