"""`python -m benchmarks hstu-static`: what the HSTU attention kernels spend per score, read from their machine code,
and how much of a batch's attention a per-tile bias could cover: two tables that need no GPU.

Machine code. Each kernel (kernels.triton.triton_hstu_attention: ``fwd``, ``dkdv``, ``dq``, and ``dq-kept``, the dQ
pass from the kept dS) is compiled for ``--arch`` (default sm_90, the H100/H200) by the installed Triton and its
bundled ptxas, at the first launch configuration of its head-dim class (the one ``FREESCALE_HSTU_AUTOTUNE=0`` runs;
``--configs all`` for every one), bf16, no targets, no window, pointers and row strides 16-byte aligned as a launch
specializes them, with rab off, its position part, its time part, and both; the passes read the batch's pair buckets
and the dK/dV pass keeps dS, the forward reading the layer's per-pair bias (the defaults where they fit), or with
``--gathered`` gathering it per score at the read buckets, or with ``--unpaired`` none of them. Per variant: registers
and stack bytes per thread (spills land on the stack), and the SASS instructions of one pass of the tile loop over a
full tile (the masking branch taken past), per thread and per score (``instructions x threads / tile scores``);
``+inner``: one pass of each loop inside it, per score (the dK/dV pass sums dS per bucket: each bucket a tile's
pairs span costs one pass of its part's loop).
The counts are the compiler's, not the GPU's: they move with the Triton version, and a time ratio can exceed
the instruction ratio where the added work also stalls.

Tiles. The share of a batch's attending tiles (query block x key block under the causal mask) whose every pair
falls in one (position, time) bucket pair, at the ``bench hstu`` shapes and timestamps: the tiles whose bias a
kernel could add as one scalar instead of per score; and the mean buckets of each part a tile's pairs span.
Exact on the bucket functions of kernels.pytorch.pt_hstu_attention; a tile's distances and (non-decreasing) time
gaps span its blocks' extremes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch

from benchmarks.hstu import BUCKETS, SHAPES, event_times, lengths_of
from kernels.pytorch.pt_hstu_attention import position_bucket, time_bucket

KERNELS = ("fwd", "dkdv", "dq", "dq-kept", "pos-grads", "time-grads")
#: The passes that sum the kept dS into the weights' gradients: one variant (rab), one launch configuration.
AFTER_PASSES = ("pos-grads", "time-grads")
#: rab's parts per variant: (position, time).
VARIANTS = {"off": (False, False), "pos": (True, False), "time": (False, True), "rab": (True, True)}
#: (query block, key block): the forward's and dQ's 128 x 64 and 64 x 64, the dK/dV pass's 64 x 128.
TILES = ((128, 64), (64, 64), (64, 128))


@dataclass
class Resources:
    kernel: str
    variant: str
    block_m: int
    block_n: int
    warps: int
    stages: int
    registers: int
    stack_bytes: int
    shared_kib: float
    loop_instructions: int  # one pass of the tile loop on a full tile, per thread, its inner loops left out
    per_score: float  # loop_instructions x threads / scores in the tile
    inner_per_score: float  # one pass of each inner loop (the dK/dV pass: one bucket of each rab part), per score
    x_off: Optional[float] = None  # per_score over the same kernel's and config's rab-off row


@dataclass
class TileShare:
    shape: str
    block_m: int
    block_n: int
    tiles: int
    one_position: float  # share of tiles in one position bucket
    one_time: float  # in one time bucket
    one_pair: float  # in one (position, time) bucket pair
    position_span: float  # mean position buckets a tile's pairs span (the dK/dV pass's loop passes for that part)
    time_span: float  # mean time buckets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=64, help="head dim (queries, keys and values)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}; '' none")
    parser.add_argument("--configs", choices=("first", "all"), default="first")
    parser.add_argument("--shapes", default="a,b,c", help=f"tile shares at these shapes ({', '.join(SHAPES)}); '' none")
    parser.add_argument(
        "--unpaired",
        action="store_true",
        help="compile the passes that compute each pair's rab buckets (a batch over the pair budget), not the ones "
        "that read the batch's precomputed buckets and keep dS",
    )
    parser.add_argument(
        "--gathered",
        action="store_true",
        help="with the pair buckets read, compile the forward that gathers each score's bias from the joint table "
        "at its pair's buckets, not the one that reads the layer's per-pair bias",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH")


# ---------------------------------------------------------------- machine code
def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise OSError(f"{path}: not found (the Triton wheel's CUDA tools compile and read the kernels)")
    return path


def compile_cubin(kernel, constants: dict, warps: int, stages: int, arch: int) -> tuple[bytes, int]:
    """The kernel's cubin and shared memory bytes for ``arch``, compiled without a GPU: bf16 tensors, int32 offsets,
    int64 timestamps, fp32 bias tables and scalars."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in ("OFFSETS", "ORDER", "TARGETS"):
            return "*i32"
        if name in ("TS", "PAIR_BASE"):
            return "*i64"
        if name == "PAIRS":
            return "*i16"
        if name in ("RAB", "DPW", "DTW"):
            return "*fp32"
        if name in ("alpha", "inv_norm"):
            return "fp32"
        return "*bf16" if name.isupper() else "i32"

    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    signature = {name: kind(name) for name in kernel.arg_names}
    # What a launch specializes on: torch's allocations and the row strides are multiples of 16 bytes, so Triton
    # vectorizes and pipelines the loads; without the hint the counts would be those of unaligned scalar loads.
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name].startswith("*") or name.startswith("stride")
    }
    source = ASTSource(kernel, signature, constexprs=constants, attrs=aligned)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return compiled.asm["cubin"], int(compiled.metadata.shared)


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(name), *args, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the cubin's kernel, as cuobjdump reports them."""
    text = _run_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if found is None:
        raise ValueError(f"cuobjdump printed no resource usage: {text.strip()[:200]!r}")
    return int(found.group(1)), int(found.group(2))


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L\w+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L\w+)\)")


def loop_instructions(sass: str) -> tuple[int, list[int]]:
    """Instructions of one pass of the outermost loop (the span from a backward branch's target to the branch) on
    its shortest path: every forward branch inside it taken, so the code it jumps over (the masking, and the
    inner loops behind their guards) is left out; and the instructions of one pass of each inner loop."""
    addresses, labels, branches = [], {}, []
    pending = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        address = int(found.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        addresses.append(address)
        target = _BRANCH.search(found.group(2))
        if target:
            branches.append((address, target.group(1)))
    backward = [(labels[t], a) for a, t in branches if t in labels and labels[t] < a]
    if not backward:
        raise ValueError("no loop: the SASS has no backward branch")
    start, end = max(backward, key=lambda span: span[1] - span[0])
    skipped = set()
    for address, target in branches:
        if start <= address < end and target in labels and address < labels[target] <= end:
            skipped.update(a for a in addresses if address < a < labels[target])
    inner = [sum(1 for a in addresses if lo <= a <= hi) for lo, hi in backward if start < lo and hi < end]
    return sum(1 for a in addresses if start <= a <= end and a not in skipped), inner


def kernel_resources(args: argparse.Namespace) -> list[Resources]:
    from kernels.triton import triton_hstu_attention as hstu

    block_d = max(16, 1 << (args.dim - 1).bit_length())
    width = min((w for w in hstu._FWD_CONFIGS if w >= block_d), default=max(hstu._FWD_CONFIGS))
    tables = {
        "fwd": hstu._FWD_CONFIGS,
        "dkdv": hstu._DKDV_CONFIGS,
        "dq": hstu._DQ_CONFIGS,
        "dq-kept": hstu._DQ_KEPT_CONFIGS,
    }
    tables["pos-grads"] = {width: [(hstu._DISTANCE_BLOCK, hstu._DISTANCE_BLOCK, 4, 1)]}
    tables["time-grads"] = {width: [(hstu._TIME_QUERIES, hstu._TIME_KEYS, 4, 1)]}
    functions = {
        "fwd": hstu._fwd_kernel,
        "dkdv": hstu._dkdv_kernel,
        "dq": hstu._dq_kernel,
        "dq-kept": hstu._dq_kept_kernel,
        "pos-grads": hstu._position_grads_kernel,
        "time-grads": hstu._time_grads_kernel,
    }
    base = dict(
        H=args.heads,
        D=args.dim,
        DV=args.dim,
        BLOCK_D=block_d,
        BLOCK_DV=block_d,
        PER_SAMPLE_NORM=False,
        HAS_TARGETS=False,
        HAS_WINDOW=False,
        PRECISION="tf32",
        FAST=True,
        PAIRED=not args.unpaired,
        PAIR_BIAS=not (args.unpaired or args.gathered),
        **hstu._BUCKET_CONSTANTS,
    )
    rows = []
    for name in filter(None, args.kernels.split(",")):
        configs = tables[name][width] if args.configs == "all" else tables[name][width][:1]
        for block_m, block_n, warps, stages in configs:
            off = None
            variants = {"rab": VARIANTS["rab"]} if name in AFTER_PASSES else VARIANTS
            for variant, (pos, time) in variants.items():
                constants = dict(base, HAS_POS=pos, HAS_TIME=time, BLOCK_M=block_m, BLOCK_N=block_n)
                # a launch's: no bias without rab, and the dK/dV pass's (copy 0) by the launch's rule
                reads = hstu.reads_pair_bias(0 if name == "dkdv" else 1, block_d)
                constants.update(PAIR_BIAS=base["PAIR_BIAS"] and (pos or time) and reads)
                constants.update(PB=BUCKETS, TB=BUCKETS)
                if name == "pos-grads":  # blocks of distances and of keys, not of head dims
                    constants.update(BLOCK_D=block_m, BLOCK_C=block_n)
                if name == "dkdv":  # the time sums are the time-grads pass's where dS is kept
                    constants.update(KEEP_DS=not args.unpaired, TIME_SUMS=time and args.unpaired)
                if name == "time-grads":
                    constants.update(HP=1 << (args.heads - 1).bit_length())
                cubin, shared = compile_cubin(functions[name], constants, warps, stages, args.arch)
                registers, stack = resource_usage(cubin)
                loop, inner = loop_instructions(_run_tool("nvdisasm", ["-c"], cubin))
                per_score, inner_per_score = (x * warps * 32 / (block_m * block_n) for x in (loop, sum(inner)))
                row = Resources(
                    *(name, variant, block_m, block_n, warps, stages, registers, stack, shared / 1024),
                    *(loop, per_score, inner_per_score),
                )
                off = off or row
                row.x_off = per_score / off.per_score
                rows.append(row)
                print(resources_table([row]).splitlines()[1], flush=True)
    return rows


def resources_table(rows: list[Resources]) -> str:
    lines = ["kernel variant tile      warps stages  regs  stack B  smem KiB  loop instr  per score  x off  +inner"]
    for r in rows:
        tile = f"{r.block_m}x{r.block_n}"
        lines.append(
            f"{r.kernel:<6} {r.variant:<7} {tile:<9} {r.warps:>5} {r.stages:>6} {r.registers:>5} {r.stack_bytes:>8} "
            f"{r.shared_kib:>9.1f} {r.loop_instructions:>11} {r.per_score:>10.1f} {r.x_off:>6.2f} "
            f"{r.inner_per_score:>7.1f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- tiles in one bucket pair
def tile_buckets(times: np.ndarray, block_m: int, block_n: int) -> tuple[int, ...]:
    """For one sample with non-decreasing ``times``: its attending tiles; how many lie in one position bucket, one
    time bucket, and one bucket pair; and the position and time buckets their pairs span, summed over the tiles. A
    tile's attending pairs have distances from its blocks' nearest to farthest rows, and gaps from their nearest
    to farthest times; the buckets are monotone in both."""
    length = len(times)
    q0 = np.arange(0, length, block_m)
    q_last = np.minimum(q0 + block_m, length) - 1
    k0 = np.arange(0, length, block_n)
    k_last = np.minimum(k0 + block_n, length) - 1
    qi, ki = np.nonzero(k0[None, :] <= q_last[:, None])  # the causal mask: a key block at or before the query's last
    near, far = np.maximum(q0[qi] - k_last[ki], 0), q_last[qi] - k0[ki]
    pos_span = position_bucket(torch.from_numpy(far), BUCKETS) - position_bucket(torch.from_numpy(near), BUCKETS) + 1
    gap_near = np.maximum(times[q0[qi]] - times[k_last[ki]], 0)
    gap_far = times[q_last[qi]] - times[k0[ki]]
    time_span = time_bucket(torch.from_numpy(gap_far), BUCKETS) - time_bucket(torch.from_numpy(gap_near), BUCKETS) + 1
    one_pos, one_time = pos_span == 1, time_span == 1
    counts = (one_pos.sum(), one_time.sum(), (one_pos & one_time).sum(), pos_span.sum(), time_span.sum())
    return (len(qi), *(int(c) for c in counts))


def tile_shares(shapes: list[str], seed: int) -> list[TileShare]:
    rows = []
    for shape in shapes:
        lengths = lengths_of(shape, seed)
        times = event_times(int(lengths.sum())).numpy()
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for block_m, block_n in TILES:
            counts = np.zeros(6, dtype=np.int64)
            for start, length in zip(starts, lengths):
                counts += tile_buckets(times[start : start + length], block_m, block_n)
            tiles = int(counts[0])
            rows.append(TileShare(shape, block_m, block_n, tiles, *(float(c) / tiles for c in counts[1:])))
    return rows


def shares_table(rows: list[TileShare]) -> str:
    lines = ["shape tile      tiles  one position  one time  one pair  position buckets  time buckets"]
    for r in rows:
        tile = f"{r.block_m}x{r.block_n}"
        lines.append(
            f"{r.shape:<5} {tile:<9} {r.tiles:>6} {r.one_position:>13.1%} {r.one_time:>9.1%} {r.one_pair:>9.1%} "
            f"{r.position_span:>17.2f} {r.time_span:>13.2f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import triton

    kernels, shapes = list(filter(None, args.kernels.split(","))), list(filter(None, args.shapes.split(",")))
    unknown = [k for k in kernels if k not in KERNELS] + [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown {unknown}: --kernels from {', '.join(KERNELS)}, --shapes from {', '.join(SHAPES)}")
    resources = []
    if kernels and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("--kernels: TRITON_INTERPRET=1 runs the kernels as Python; unset it to compile them")
    if kernels:
        print(
            f"machine code: sm_{args.arch}, Triton {triton.__version__}, head dim {args.dim}, {args.heads} heads, bf16"
        )
        resources = kernel_resources(args)
        print(resources_table(resources))
    shares = tile_shares(shapes, args.seed)
    if shares:
        print(f"\ntiles whose every attending pair shares one bucket ({BUCKETS} position and {BUCKETS} time buckets)")
        print(shares_table(shares))
    if args.json:
        setup = dict(arch=args.arch, triton=triton.__version__, dim=args.dim, heads=args.heads, dtype="bfloat16")
        with open(args.json, "w") as f:
            json.dump(
                dict(setup=setup, resources=[asdict(r) for r in resources], tiles=[asdict(r) for r in shares]),
                f,
                indent=1,
            )
    return 0
