"""A partitioner of your own, named on the command line as module:function.

    # from the repository root:
    freescale train --nproc 2 --steps 10 --partitioner examples.custom_partitioner:round_robin_longest
    freescale train --nproc 2 --steps 10 --partitioner /path/to/examples/custom_partitioner.py:round_robin_longest

``module:function`` is found on sys.path with the current directory first (as ``python -m`` does);
``path/to/file.py:function`` is a file path, from anywhere.

A partitioner is a pure function of the gathered lengths (and the gathered runtime info R): every rank calls it
on the same inputs and must get the same plan. It may return a Plan, (order, dest_offsets), or, as here, the
destination rank of every global sample. FreeScale checks what it returns on every call (each sample exactly
once, ranks in range) and names this function if it is wrong.
"""

import numpy as np

from fsdata.partition import GatheredLengths, RuntimeInfo


def round_robin_longest(lengths: GatheredLengths, runtime: RuntimeInfo) -> np.ndarray:
    """Deals samples to ranks longest first, like cards (ties by sample id, so every rank agrees)."""
    uih = lengths.uih_lengths.numpy()
    order = np.lexsort((lengths.sample_ids.numpy(), -uih))  # longest first, then by sample id
    dest = np.empty(lengths.num_samples, dtype=np.int64)
    dest[order] = np.arange(lengths.num_samples) % lengths.world_size
    return dest
