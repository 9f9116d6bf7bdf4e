"""`python -m benchmarks hstu`: the jagged HSTU attention (kernels.hstu), forward and forward+backward.

Shapes (``--shapes``), the lengths drawn as generative-recommenders' benchmark draws them (numpy
``default_rng(seed).lognormal(log 1500, 1.0)``, rounded, clipped to [1, cap]), so a reference run of theirs
times the same batches:

    a   lognormal capped 4,096, B=64        b   lognormal capped 21,000, B=128
    c   equal lengths 4,096, B=32           tiny  lognormal capped 64, B=4 (CPU checks)

Per shape and head dim (``--dims``), ``--heads`` heads, bf16 on CUDA (fp32 on CPU), causal, no targets, alpha =
1/sqrt(dim), n = the cap, inputs uniform in [-0.1, 0.1]; variants (``--variants``):

    triton          the Triton kernel, no rab
    triton-rab      with rab: position and time-gap bucket weights [heads, 64] each, ordered timestamps
    triton-recompute, triton-rab-recompute
                    the same with nothing kept per pair (a batch over kernels.hstu's ``pair_budget``): the
                    backward's dQ pass recomputes the scores instead of reading the dS the dK/dV pass kept, and
                    every pass computes the pairs' buckets instead of reading the batch's
    padded          the padded twin (one [B, H, L, L] score tensor); skipped where its scores would exceed
                    ``--padded-max-gib``
    torch           the per-sample twin (CPU)

Timing: CUDA events around each call, median of ``--reps`` after ``--warmup`` (the first calls autotune and
compile); forward+backward clears the gradients before each call. FLOPs as generative-recommenders counts them:
forward 2 * heads * dim * sum(L^2) (two matmuls over the causal half), forward+backward 3.5 times that.
``--kernels`` also profiles each row's forward+backward (torch.profiler, 3 calls) and prints its GPU time by
kernel: which of the passes a variant's time goes to; ``--gaps N`` traces one forward+backward and prints its N
longest spans without a kernel, with the host's torch ops when it launched the kernel that ended each.

``--reference FILE.json`` (repeatable): rows of generative-recommenders' own benchmark (bench_hstu.py's
``--out``), run on the same machine in the same command; each of our rows then shows its speed-up over theirs at
the same shape and dim, and the gates (fwd+bwd >= 1.5x theirs and fwd >= 1.0x at dim 64, rab on <= 2x rab off)
are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch

from benchmarks.gpu_trace import describe_gap, trace
from benchmarks.timing import call_times_ms, kernel_times_ms
from kernels.attention import PackedOffsets
from kernels.hstu import hstu_attention, hstu_sequences

SHAPES = {
    "a": dict(batch=64, cap=4096, equal=False),
    "b": dict(batch=128, cap=21000, equal=False),
    "c": dict(batch=32, cap=4096, equal=True),
    "tiny": dict(batch=4, cap=64, equal=False),
}
VARIANTS = ("triton", "triton-rab", "triton-recompute", "triton-rab-recompute", "padded", "torch")
BUCKETS = 64
SPEEDUP_GATE = 1.5  # fwd+bwd over generative-recommenders' Triton kernel at dim 64
FORWARD_GATE = 1.0
RAB_GATE = 2.0  # rab on over rab off, fwd+bwd


@dataclass
class Record:
    shape: str
    dim: int
    variant: str
    batch: int
    tokens: int
    max_len: int
    fwd_ms: Optional[float]
    fwd_bwd_ms: Optional[float]
    fwd_tflops: Optional[float]
    fwd_bwd_tflops: Optional[float]
    reference_fwd_ms: Optional[float] = None
    reference_fwd_bwd_ms: Optional[float] = None
    speedup_fwd: Optional[float] = None
    speedup_fwd_bwd: Optional[float] = None
    skipped: Optional[str] = None
    kernels_ms: Optional[dict[str, float]] = None  # forward+backward's GPU time by kernel (--kernels)
    idle_gaps: Optional[list[dict]] = None  # --gaps: forward+backward's longest spans without a kernel

    def _skip(self, reason: str) -> "Record":
        self.skipped = reason
        return self


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes", default=None, help="comma list of a, b, c, tiny (default a,b,c on CUDA, tiny on CPU)"
    )
    parser.add_argument("--dims", default="64", help="comma list of head dims (value dim = head dim)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="numpy seed of the lengths (generative-recommenders': 0)")
    parser.add_argument(
        "--kernels", action="store_true", help="profile each row's forward+backward: GPU time by kernel (CUDA)"
    )
    parser.add_argument(
        "--gaps",
        type=int,
        default=0,
        metavar="N",
        help="trace each row's forward+backward (CUDA): the N longest spans without a kernel and the host's ops then",
    )
    parser.add_argument("--padded-max-gib", type=float, default=24.0)
    parser.add_argument("--reference", action="append", default=[], metavar="FILE.json")
    parser.add_argument("--json", default=None, metavar="PATH")


def lengths_of(shape: str, seed: int) -> np.ndarray:
    spec = SHAPES[shape]
    if spec["equal"]:
        return np.full(spec["batch"], spec["cap"], dtype=np.int64)
    raw = np.random.default_rng(seed).lognormal(mean=math.log(1500.0), sigma=1.0, size=spec["batch"])
    return np.clip(np.rint(raw), 1, spec["cap"]).astype(np.int64)


def fwd_flops(lengths: np.ndarray, heads: int, dim: int) -> float:
    return 2.0 * heads * dim * float(np.sum(lengths.astype(np.float64) ** 2))


def event_times(n: int) -> torch.Tensor:
    """int64 seconds of ``n`` events an exponential hour apart on average (non-decreasing; the same every run)."""
    gaps = torch.empty(n, dtype=torch.float64).exponential_(1.0 / 3600, generator=torch.Generator().manual_seed(7))
    return gaps.to(torch.int64).cumsum(0)


def _inputs(lengths: np.ndarray, heads: int, dim: int, device: torch.device, dtype: torch.dtype, rab: bool) -> dict:
    gen = torch.Generator().manual_seed(1001)
    n = int(lengths.sum())

    def uniform(*shape):
        return (torch.rand(*shape, generator=gen) * 0.2 - 0.1).to(device=device, dtype=dtype).requires_grad_()

    data = dict(q=uniform(n, heads, dim), k=uniform(n, heads, dim), v=uniform(n, heads, dim))
    data["grad"] = torch.randn(n, heads, dim, generator=gen).to(device=device, dtype=dtype)
    if rab:
        data["timestamps"] = event_times(n).to(device)
        data["position_weights"] = (torch.randn(heads, BUCKETS, generator=gen) * 0.1).to(device).requires_grad_()
        data["time_weights"] = (torch.randn(heads, BUCKETS, generator=gen) * 0.1).to(device).requires_grad_()
    return data


def _padded_gib(lengths: np.ndarray, heads: int, dtype: torch.dtype) -> float:
    longest = int(lengths.max())
    return len(lengths) * heads * longest * longest * torch.finfo(dtype).bits / 8 / 2**30


def attention_calls(
    lengths: np.ndarray,
    heads: int,
    dim: int,
    variant: str,
    device: torch.device,
    dtype: torch.dtype,
    seq_norm: int,
    deterministic: bool = False,
) -> tuple[dict, Callable[[], torch.Tensor], Callable[[], None]]:
    """One row's workload: its inputs (:func:`_inputs`), and the attention's forward and its forward+backward (the
    gradients cleared first) as calls to time, built as a model builds them for all its layers."""
    rab = variant.startswith("triton-rab")
    data = _inputs(lengths, heads, dim, device, dtype, rab)
    host = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    impl = "triton" if variant.startswith("triton") else variant
    offsets = PackedOffsets.from_host(host, device if device.type == "cuda" else None)
    # Built once, as a model does for all its layers: the offsets, targets and timestamps checked and on the device.
    budget = 0 if variant.endswith("-recompute") else None
    buckets = (BUCKETS, BUCKETS) if rab else None
    seqs = hstu_sequences(
        offsets, timestamps=data.get("timestamps"), impl=impl, device=device, pair_budget=budget, rab_buckets=buckets
    )
    extra = {key: data[key] for key in ("position_weights", "time_weights") if key in data}
    leaves = [data[key] for key in ("q", "k", "v", "position_weights", "time_weights") if key in data]

    def forward():
        return hstu_attention(
            data["q"],
            data["k"],
            data["v"],
            seqs,
            alpha=1.0 / math.sqrt(dim),
            seq_norm=seq_norm,
            impl=impl,
            deterministic=deterministic,
            **extra,
        )

    def forward_backward():
        for t in leaves:
            t.grad = None
        forward().backward(data["grad"])

    return data, forward, forward_backward


def bench_one(args, shape: str, dim: int, variant: str, device: torch.device, dtype: torch.dtype) -> Record:
    lengths = lengths_of(shape, args.seed)
    cap = SHAPES[shape]["cap"]
    base = dict(shape=shape, dim=dim, variant=variant, batch=len(lengths), tokens=int(lengths.sum()))
    base["max_len"] = int(lengths.max())
    if variant == "padded" and _padded_gib(lengths, args.heads, dtype) > args.padded_max_gib:
        return skipped(shape, dim, variant, args.seed, f"{_padded_gib(lengths, args.heads, dtype):.0f} GiB of scores")
    _, forward, forward_backward = attention_calls(lengths, args.heads, dim, variant, device, dtype, cap)
    with torch.no_grad():
        fwd_ms = statistics.median(call_times_ms(device, forward, args.reps, args.warmup))
    fwd_bwd_ms = statistics.median(call_times_ms(device, forward_backward, args.reps, args.warmup))
    kernels = kernel_times_ms(forward_backward) if args.kernels and device.type == "cuda" else None
    gaps = trace(forward_backward).idle_gaps(args.gaps) if args.gaps and device.type == "cuda" else None
    flops = fwd_flops(lengths, args.heads, dim)
    return Record(
        **base,
        fwd_ms=fwd_ms,
        fwd_bwd_ms=fwd_bwd_ms,
        fwd_tflops=flops / fwd_ms / 1e9,
        fwd_bwd_tflops=3.5 * flops / fwd_bwd_ms / 1e9,
        kernels_ms=kernels,
        idle_gaps=gaps,
    )


def skipped(shape: str, dim: int, variant: str, seed: int, reason: str) -> Record:
    lengths = lengths_of(shape, seed)
    return Record(
        shape, dim, variant, len(lengths), int(lengths.sum()), int(lengths.max()), None, None, None, None
    )._skip(reason)


def load_reference(paths: list[str]) -> dict[tuple[str, int], dict]:
    """generative-recommenders' rows by (shape letter, dim), from bench_hstu.py's JSON (config 'a/H4/D64')."""
    rows = {}
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"--reference {path}: not bench_hstu.py's JSON ({error})") from None
        for row in result.get("rows", []):
            if "error" in row or "fwd_ms" not in row:
                continue
            letter = row["config"].split("/")[0]
            rows[(letter, int(row["dim"]))] = row
    return rows


def _with_reference(record: Record, reference: dict[tuple[str, int], dict]) -> Record:
    ref = reference.get((record.shape, record.dim))
    if ref is None or record.fwd_ms is None:
        return record
    record.reference_fwd_ms, record.reference_fwd_bwd_ms = ref["fwd_ms"], ref["fwd_bwd_ms"]
    record.speedup_fwd = ref["fwd_ms"] / record.fwd_ms
    record.speedup_fwd_bwd = ref["fwd_bwd_ms"] / record.fwd_bwd_ms
    return record


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: list[Record]) -> str:
    head = "shape dim variant               tokens  fwd ms  f+b ms  fwd TF/s  f+b TF/s  ref fwd  ref f+b  x fwd  x f+b"
    lines = [head]
    for r in records:
        if r.skipped:
            lines.append(f"{r.shape:<5} {r.dim:>3} {r.variant:<20} {r.tokens:>8}  skipped: {r.skipped}")
            continue
        cells = [
            _fmt(r.fwd_ms, "7.3f"),
            _fmt(r.fwd_bwd_ms, "7.3f"),
            _fmt(r.fwd_tflops, "9.1f"),
            _fmt(r.fwd_bwd_tflops, "9.1f"),
            _fmt(r.reference_fwd_ms, "8.3f"),
            _fmt(r.reference_fwd_bwd_ms, "8.3f"),
            _fmt(r.speedup_fwd, "6.2f"),
            _fmt(r.speedup_fwd_bwd, "6.2f"),
        ]
        lines.append(f"{r.shape:<5} {r.dim:>3} {r.variant:<20} {r.tokens:>8} " + " ".join(cells))
    return "\n".join(lines)


def gates(records: list[Record]) -> list[str]:
    out = []
    for r in records:
        if r.variant == "triton" and r.dim == 64 and r.speedup_fwd_bwd is not None:
            ok = r.speedup_fwd_bwd >= SPEEDUP_GATE and r.speedup_fwd >= FORWARD_GATE
            out.append(
                f"gate {r.shape}/64: fwd+bwd {r.speedup_fwd_bwd:.2f}x (>= {SPEEDUP_GATE}), fwd {r.speedup_fwd:.2f}x "
                f"(>= {FORWARD_GATE}) over generative-recommenders: {'met' if ok else 'NOT met'}"
            )
    plain = {(r.shape, r.dim): r for r in records if r.variant == "triton" and r.fwd_bwd_ms}
    for r in records:
        if r.variant == "triton-rab" and r.fwd_bwd_ms and (r.shape, r.dim) in plain:
            cost = r.fwd_bwd_ms / plain[(r.shape, r.dim)].fwd_bwd_ms
            out.append(
                f"gate rab {r.shape}/{r.dim}: fwd+bwd {cost:.2f}x rab off (<= {RAB_GATE}): "
                f"{'met' if cost <= RAB_GATE else 'NOT met'}"
            )
    return out


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = (args.shapes or ("a,b,c" if cuda else "tiny")).split(",")
    variants = (args.variants or ("triton,triton-rab,padded" if cuda else "torch,padded")).split(",")
    for name, allowed, given in (("--shapes", SHAPES, shapes), ("--variants", VARIANTS, variants)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            raise ValueError(f"{name}: unknown {unknown}; choose from {', '.join(allowed)}")
    if not cuda and any(v.startswith("triton") for v in variants):
        raise ValueError("--variants triton*: the Triton kernel runs on CUDA; use torch,padded on CPU")
    reference = load_reference(args.reference)
    records = []
    for shape in shapes:
        for dim in (int(d) for d in args.dims.split(",")):
            for variant in variants:
                try:
                    record = bench_one(args, shape, dim, variant, device, dtype)
                except torch.OutOfMemoryError:
                    record = skipped(shape, dim, variant, args.seed, "out of memory")
                    torch.cuda.empty_cache()
                records.append(_with_reference(record, reference))
                print(table(records[-1:]).splitlines()[1], flush=True)
    print(table(records))
    for r in records:
        if r.kernels_ms:
            print(
                f"{r.shape}/{r.dim} {r.variant}, forward+backward by kernel (ms): "
                + ", ".join(f"{name.split('(')[0]} {ms:.3f}" for name, ms in r.kernels_ms.items())
            )
        for gap in r.idle_gaps or []:
            print(f"{r.shape}/{r.dim} {r.variant}: {describe_gap(gap)}")
    for line in gates(records):
        print(line)
    if args.json:
        setup = dict(device=str(device), heads=args.heads, dtype=str(dtype), torch=torch.__version__)
        setup["gpu"] = torch.cuda.get_device_name(device) if cuda else platform.processor()
        with open(args.json, "w") as f:
            json.dump(dict(setup=setup, records=[asdict(r) for r in records]), f, indent=1)
    return 0
