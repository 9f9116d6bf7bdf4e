"""Research tools, apart from the library path a user imports: the replay simulation of the partitioners on the
model's measured step times (replay), the cost-model simulator (simulate) and the benchmarks behind
BENCHMARKS.md (bench). The command line reaches them as ``freescale simulate`` and ``freescale bench ...``."""
