"""The step-time simulator: ``freescale simulate`` (simulator.py), the straggler effect of N ranks with and without
each partitioner, computed from a length distribution and a step-time model without N devices. The replay harness that
feeds it measured step times of the softmax model is a benchmark (``python -m benchmarks replay``, source
checkout only)."""
