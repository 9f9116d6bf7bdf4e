"""Device-time sweep of the Triton kernels' launch constants on the bench workload (GPU only).

    PYTHONPATH=. python3 scripts/tune_kernels.py --world-sizes 32,512   # one line per setting, median of 10 calls

(PYTHONPATH=.: the workload is benchmarks/kernels.py's, which a source checkout holds and the wheel does not.)

What it varies: ranged_dispatch's block and warps; the jagged gather's elements per program and warps
(indexed_permute/global). The defaults in kernels/triton/ come from this sweep.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks import kernels as bench
from kernels import ops
from kernels.impl import Impl
from kernels.triton import triton_jagged_gather, triton_ranged


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = bench.Timer(device)
    for w in [int(x) for x in args.world_sizes.split(",")]:
        work = bench.Workload(args, w, device)
        want = ops.ranged_dispatch(work.local_ids, work.boundaries, impl=Impl.TORCH)
        for block, warps in itertools.product((32, 64, 128), (1, 2, 4)):
            triton_ranged.DISPATCH_BLOCK, triton_ranged.DISPATCH_WARPS = block, warps
            got = ops.ranged_dispatch(work.local_ids, work.boundaries)
            ok = all(torch.equal(a, b) for a, b in zip(got, want))
            us = timer.gpu_us(lambda work=work: ops.ranged_dispatch(work.local_ids, work.boundaries), 10)
            print(f"ranged_dispatch W={w} block={block} warps={warps}: {us:.1f} us ok={ok}", flush=True)
        n = work.global_ids.numel()
        for elements, warps in itertools.product((1024, 2048, 4096), (4, 8)):
            triton_jagged_gather.ELEMENTS_PER_PROGRAM, triton_jagged_gather.NUM_WARPS = elements, warps
            us = timer.gpu_us(
                lambda work=work: ops.indexed_permute(
                    work.global_ids, work.global_uih_offsets, work.order, output_size=n
                ),
                10,
            )
            print(
                f"indexed_permute/global W={w} elements={elements} warps={warps}: {us:.1f} us "
                f"({2 * n * 8 / us / 1e3:.0f} GB/s)",
                flush=True,
            )
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
