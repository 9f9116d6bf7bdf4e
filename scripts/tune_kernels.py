"""Device-time sweep of the Triton kernels' launch constants on the bench workload (GPU only).

    PYTHONPATH=. python3 scripts/tune_kernels.py --world-sizes 32,512   # one line per setting, median of 10 calls
    PYTHONPATH=. python3 scripts/tune_kernels.py --hstu-dim 256 --hstu-shapes c,a   # the HSTU attention's tiles
    PYTHONPATH=. python3 scripts/tune_kernels.py --hstu-dim 256 --hstu-try dkdv:32x64x8x3   # and a candidate

(PYTHONPATH=.: the workloads are benchmarks/kernels.py's and benchmarks/hstu.py's, which a source checkout holds
and the wheel does not.)

What it varies: ranged_dispatch's block and warps; the jagged gather's elements per program and warps
(indexed_permute/global); with ``--hstu-dim``, each launch configuration of the HSTU attention's forward and dK/dV
passes at that head dim (bf16, ``--hstu-variant``: rab off or on; every other pass at its first configuration), and
each ``--hstu-try`` candidate after them, timed alone as the deterministic mode runs it, and its output and
gradients against the first one's. The defaults in kernels/triton/ come from this sweep.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from benchmarks import hstu as hstu_bench
from benchmarks import kernels as bench
from benchmarks.timing import call_times_ms
from kernels import ops
from kernels.impl import Impl
from kernels.triton import triton_hstu_attention, triton_jagged_gather, triton_ranged


def hstu_tiles(
    dim: int,
    shapes: list[str],
    variant: str = "triton",
    tries: dict[str, list[tuple[int, int, int, int]]] | None = None,
    heads: int = 4,
    device: torch.device = torch.device("cuda"),
) -> None:
    """One line per launch configuration of the forward and the dK/dV pass at head dim ``dim`` (the table's, then
    ``tries``' for that pass): forward and forward+backward ms and TFLOP/s at each shape (benchmarks/hstu.py's
    workload, ``variant``), and the largest difference from the first configuration's output and gradients
    (relative to their largest magnitude)."""
    module = triton_hstu_attention
    width = min(w for w in module._FWD_CONFIGS if w >= dim)  # the head-width class the kernels' autotuner takes
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    runs = {}
    for shape in shapes:
        lengths = hstu_bench.lengths_of(shape, 0)
        data, forward, forward_backward = hstu_bench.attention_calls(
            lengths, heads, dim, variant, device, dtype, hstu_bench.SHAPES[shape]["cap"], deterministic=True
        )
        runs[shape] = (hstu_bench.fwd_flops(lengths, heads, dim), data, forward, forward_backward)
        for _ in range(3):  # every pass compiled and the device busy before the first row's timing
            forward_backward()
    reference: dict[str, list] = {}
    passes = (("_FWD", module._fwd_kernel, module._FWD_CONFIGS), ("_DKDV", module._dkdv_kernel, module._DKDV_CONFIGS))
    for name, kernel, table in passes:
        kept = getattr(module, name)
        for config in table[width] + (tries or {}).get(name[1:].lower(), []):
            tuned = module._tuned(kernel, {width: [config]}, True, key=module._KEY)
            setattr(module, name, [tuned, tuned])  # both modes: the deterministic one's is what the calls launch
            cells = [f"{name[1:].lower()} {config}"]
            for shape, run in runs.items():
                cells.append(f"{shape}: {_hstu_timing(device, *run, reference.setdefault(shape, []))}")
            print(" | ".join(cells), flush=True)
        setattr(module, name, kept)


def _hstu_timing(device, flops: float, data: dict, forward, forward_backward, reference: list) -> str:
    try:
        with torch.no_grad():
            fwd = statistics.median(call_times_ms(device, forward, 10, 2))
            out = forward().float()
        forward_backward()
        results = [out] + [data[key].grad.float() for key in ("q", "k", "v")]
        both = statistics.median(call_times_ms(device, forward_backward, 8, 1))
    except Exception as error:  # noqa: BLE001
        # a configuration the device cannot run (its shared memory) is a result of the sweep, not its end
        return f"fails: {type(error).__name__}: {str(error)[:100]}"
    if not reference:
        reference.extend(results)
    err = max((g - r).abs().max().item() / max(r.abs().max().item(), 1e-9) for g, r in zip(results, reference))
    return (
        f"fwd {fwd:.3f} ms {flops / fwd / 1e9:.0f} TFLOP/s, f+b {both:.3f} ms {3.5 * flops / both / 1e9:.0f} "
        f"TFLOP/s, off the first {err:.1e}"
    )


def _candidate(text: str) -> tuple[str, tuple[int, int, int, int]]:
    """``--hstu-try``'s ``PASS:MxNxWxS`` as (pass, config)."""
    name, _, config = text.partition(":")
    numbers = config.split("x")
    if name not in ("fwd", "dkdv") or len(numbers) != 4 or not all(n.isdigit() for n in numbers):
        raise argparse.ArgumentTypeError(f"{text!r}: want fwd or dkdv, then BLOCK_M x BLOCK_N x warps x stages")
    return name, tuple(int(n) for n in numbers)


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--hstu-dim", type=int, default=0, help="the HSTU attention's tiles at this head dim only")
    parser.add_argument("--hstu-shapes", default="c,a", help="benchmarks/hstu.py's shapes to time them at")
    parser.add_argument("--hstu-variant", default="triton", choices=("triton", "triton-rab"), help="rab off or on")
    parser.add_argument(
        "--hstu-try",
        action="append",
        default=[],
        type=_candidate,
        metavar="PASS:MxNxWxS",
        help="a launch configuration to time after the table's: fwd or dkdv, BLOCK_M x BLOCK_N x warps x stages",
    )
    args = parser.parse_args()
    if args.hstu_dim:
        tries: dict[str, list[tuple[int, int, int, int]]] = {}
        for name, config in args.hstu_try:
            tries.setdefault(name, []).append(config)
        hstu_tiles(args.hstu_dim, args.hstu_shapes.split(","), args.hstu_variant, tries)
        return
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
